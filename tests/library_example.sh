#!/usr/bin/env bash
# Installs cohort into a temporary prefix, builds examples/library against it as an outside
# project would (find_package(cohort CONFIG REQUIRED)), and runs the examples under
# `cohort launch -n 2`. Usage: library_example.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
source=$2
work=$(mktemp -d /tmp/cohort-library-XXXXXX)
trap 'rm -rf "$work"' EXIT

cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
# The package's public interface (what a consumer compiles and links with) is torch and the
# standard library: no source tree, no gRPC, protobuf or Gloo, and not this build's LibTorch by
# its paths (the consumer's find_dependency(Torch) supplies it).
targets=$(grep -h "INTERFACE_" "$work"/prefix/lib*/cmake/cohort/cohortTargets*.cmake)
for leak in "$source/src" grpc protobuf gloo libc10 site-packages/torch; do
  if grep -qi -- "$leak" <<<"$targets"; then
    echo "FAIL: the installed cohort::cohort target mentions '$leak'" >&2
    exit 1
  fi
done
test -f "$work/prefix/include/cohort/cohort.h"

launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$source/examples/library" -B "$work/example" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" "${launcher[@]}" \
  > "$work/configure.log"
cmake --build "$work/example" -j 2 > "$work/build.log" || { cat "$work/build.log"; exit 1; }

cohort="$work/prefix/bin/cohort"
run() {
  echo "+ $*"
  timeout 300 "$@" 2>&1 | tee "$work/out.log"
  grep -q "done:" "$work/out.log" || { echo "FAIL: no 'done:' line" >&2; exit 1; }
}
run "$cohort" launch -n 2 -- "$work/example/resnet_ddp" --steps 40 --batch 32
# 40 steps of 2 x 32 examples take the ResNet well past chance (0.1).
accuracy=$(grep -o "test accuracy [0-9.]*" "$work/out.log" | awk '{print $3}')
awk -v a="$accuracy" 'BEGIN { exit !(a > 0.3) }' || { echo "FAIL: test accuracy $accuracy after 40 steps" >&2; exit 1; }
# cohort::Autocast from the installed headers, in the user's loop under DataParallel.
run "$cohort" launch -n 2 -- "$work/example/resnet_ddp" --steps 20 --batch 32 --autocast bf16
# float16 with cohort::GradScaler in the user's loop (emulated on a CPU, so a few steps).
run "$cohort" launch -n 2 -- "$work/example/resnet_ddp" --steps 4 --batch 16 --autocast fp16
run "$cohort" launch -n 2 -- "$work/example/resnet_schemes" --scheme average --period 4 --steps 20 --batch 32
run "$cohort" launch -n 2 --ps 1 -- "$work/example/resnet_schemes" --scheme ps --steps 20 --batch 32
echo "library example: all passed"
