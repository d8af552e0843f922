#!/usr/bin/env bash
# Packs what scripts/gpu-check.sh needs on a GPU machine that has PyTorch 2.11 but no Debian
# packages and no network (the device tool's machines): the cohort binary, libcohort, the gpu test
# program, the GPU codec benchmark (bench/gpu_codec.cpp), every shared library they need that is
# neither LibTorch's (the GPU machine's torch wheel has those) nor the C/C++ runtime's, and
# Fashion-MNIST. Stripped; the device tool carries at most
# 64 MiB with the working tree, so the bundle must stay under 60.
#
#   bash scripts/gpu-bundle.sh [BUILD]     # BUILD defaults to build; writes build-gpu/
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
out="$root/build-gpu"
limit_mb=60

# libcohort.so by its file: Ninja's target `cohort` is the binary of that name, not the library.
cmake --build "$build" --target libcohort.so cohort_cli gpu_tests gpu_codec resnet_ddp
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/data/fashion-mnist"
cp "$build/cohort" "$build/tests/gpu_tests" "$build/bench/gpu_codec" "$build/bench/resnet_ddp" "$out/bin/"
cp -P "$build"/libcohort.so* "$out/lib/"

# Libraries the GPU machine has already: LibTorch's own (and the CUDA libraries beside it), and
# the C and C++ runtime, which must be the machine's own (LibTorch was built against them).
skip='^(libtorch|libc10|libcaffe2|libgomp|libcud|libcublas|libcusparse|libcufft|libcurand|libcusolver|libnccl|libnvrtc|libnvJitLink|libcupti|libnvshmem|libcufile|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread|libutil|libresolv|ld-linux|libstdc\+\+|libgcc_s|linux-vdso)'
for f in "$out"/bin/* "$out/lib/libcohort.so.0"; do
  ldd "$f" | awk '/=> \//{print $1, $3}' | while read -r name path; do
    if ! [[ "$name" =~ $skip ]] && [ ! -e "$out/lib/$name" ]; then cp -L "$path" "$out/lib/$name"; fi
  done
done
strip --strip-unneeded "$out/bin/"* "$out"/lib/*.so* 2>/dev/null || true
cp /usr/share/datasets/fashion-mnist/*.gz "$out/data/fashion-mnist/"

size_mb=$(du -sm "$out" | cut -f1)
echo "gpu-bundle: $out: ${size_mb} MiB ($(ls "$out/lib" | wc -l) libraries)"
if [ "$size_mb" -gt "$limit_mb" ]; then
  echo "gpu-bundle: over the ${limit_mb} MiB the device tool can carry beside the tree" >&2
  exit 1
fi
