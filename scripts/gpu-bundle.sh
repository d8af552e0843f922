#!/usr/bin/env bash
# Packs what scripts/gpu-check.sh needs on a GPU machine that has PyTorch 2.11 but no Debian
# packages and no network (the device tool's machines): the cohort binary, libcohort, the gpu test
# program, the GPU codec benchmark (bench/gpu_codec.cpp), every shared library they need that is
# neither LibTorch's (the GPU machine's torch wheel has those) nor the C/C++ runtime's, and
# Fashion-MNIST. Stripped, and the programs and libraries packed as build-gpu/programs.tar.gz
# (gzip: 31 MB of them become 13), which scripts/gpu-check.sh unpacks in place on the GPU machine;
# the device tool carries at most 64 MiB with the working tree, so the bundle must fit beside the
# tracked files with 2 MiB to spare.
#
#   bash scripts/gpu-bundle.sh [BUILD]     # BUILD defaults to build; writes build-gpu/
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
out="$root/build-gpu"

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

libraries=$(ls "$out/lib" | wc -l)
tar -C "$out" -cf - bin lib | gzip -9 > "$out/programs.tar.gz"
rm -rf "$out/bin" "$out/lib"

mib=$((1024 * 1024))
bundle_bytes=$(du -sb "$out" | cut -f1)
tree_bytes=$(cd "$root" && git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
limit_bytes=$((62 * mib - tree_bytes))
echo "gpu-bundle: $out: $((bundle_bytes / mib)).$((bundle_bytes % mib * 10 / mib)) MiB ($libraries libraries)," \
  "tracked tree $((tree_bytes / mib)).$((tree_bytes % mib * 10 / mib)) MiB; together at most 62 of the 64 MiB carried"
if [ "$bundle_bytes" -gt "$limit_bytes" ]; then
  echo "gpu-bundle: the bundle and the tree are over 62 MiB: the device tool carries 64 MiB in all" >&2
  exit 1
fi
