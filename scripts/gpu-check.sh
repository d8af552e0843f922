#!/usr/bin/env bash
# The GPU check: run on a machine with a CUDA GPU and PyTorch 2.11 (the device tool's), from the
# repository root, with build-gpu/ (scripts/gpu-bundle.sh, made on a cpp-kernels machine) carried:
#
#   device run, carry ["build-gpu"]:  bash scripts/gpu-check.sh
#
# Runs the gpu tests, then the figures, and writes a report to $OUT (or ./gpu-out): the machine,
# each test's result, and each figure with the command that produced it. At most 8 minutes (its
# timeouts: 200 s of tests, 230 + 30 s of figures; GPU_CHECK_* below change them): call it with the
# device tool's timeout_s near 480. GPU_CHECK_SECTIONS picks the figures (bench/gpu_figures.py:
# single, resnet, ws1, streams, ddp2 by default; autocast, cohort and PyTorch under autocast bf16,
# on request).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bundle="$root/build-gpu"
out="${OUT:-$root/gpu-out}"
mkdir -p "$out"
report="$out/gpu-report.md"
python="${COHORT_GPU_PYTHON:-python3}"

# The programs and libraries travel packed (scripts/gpu-bundle.sh): unpacked in place, once. tar
# if the machine has it, else Python's tarfile.
if [ ! -x "$bundle/bin/cohort" ] && [ -f "$bundle/programs.tar.gz" ]; then
  tar -xzf "$bundle/programs.tar.gz" -C "$bundle" 2>/dev/null ||
    "$python" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$bundle/programs.tar.gz" "$bundle" ||
    { echo "gpu-check: could not unpack $bundle/programs.tar.gz" >&2; exit 1; }
fi
[ -x "$bundle/bin/cohort" ] || { echo "gpu-check: $bundle/bin/cohort is missing: run scripts/gpu-bundle.sh first and carry build-gpu" >&2; exit 1; }
torch_lib="$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')" ||
  { echo "gpu-check: $python has no torch" >&2; exit 1; }
# The bundle's libraries for cohort's programs only (the machine's Python keeps its own): a wrapper
# that the tests and the benchmark start as "cohort".
libs="$bundle/lib:$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# (Outside $OUT: the device tool brings back at most 8 files from there.)
wrappers="$(mktemp -d)"
for program in "$bundle"/bin/*; do
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' "$libs" "$program" > "$wrappers/$(basename "$program")"
  chmod +x "$wrappers/$(basename "$program")"
done
wrapper="$wrappers/cohort"
export COHORT_TEST_BINARY="$wrapper"
export COHORT_TEST_SOURCE_DIR="$root"
export COHORT_FASHION_MNIST_DIR="$bundle/data/fashion-mnist"

{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
  nproc
  echo "libraries not found: $(LD_LIBRARY_PATH="$libs" ldd "$bundle/bin/cohort" "$bundle/bin/gpu_tests" | grep -c 'not found')"
  "$wrapper" --version 2>&1
  echo '```'
} > "$report"

# The gpu tests, one test suite per process, all at once (each starts its own small jobs on the one
# GPU; its memory and 16 cores hold them), each bounded by its own timeout, so that a suite that
# hangs costs only itself. GPU_CHECK_FILTER (a gtest filter) runs a part.
echo "## gpu tests" >> "$report"
logs="$(mktemp -d)"
filter="${GPU_CHECK_FILTER:-*}"
# "Suite.Test" per line, for the tests the filter selects; one process per suite.
LD_LIBRARY_PATH="$libs" "$bundle/bin/gpu_tests" --gtest_list_tests --gtest_filter="$filter" |
  awk '/^Running/ {next} /^[^ ]/ {suite=$1; next} {print suite $1}' > "$logs/tests"
suites=$(sed 's/\.[^.]*$/./' "$logs/tests" | sort -u)
for suite in $suites; do
  name=$(echo "$suite" | tr '/.' '__')
  tests=$(awk -v s="$suite" 'index($0, s) == 1' "$logs/tests" | paste -sd: -)
  ( LD_LIBRARY_PATH="$libs" timeout -k 5 "${GPU_CHECK_TESTS_S:-200}" "$bundle/bin/gpu_tests" --gtest_filter="$tests" \
      > "$logs/$name.log" 2>&1
    echo $? > "$logs/$name.rc" ) &
done
wait
tests_status=0
: > "$out/gpu_tests.log"
{
  echo '```'
  for suite in $suites; do
    name=$(echo "$suite" | tr '/.' '__')
    rc=$(cat "$logs/$name.rc")
    [ "$rc" = 0 ] || tests_status=1
    grep -E '^\[ +(OK|FAILED) +\] .* \([0-9]+ ms\)$' "$logs/$name.log"
    echo "$suite: exit status $rc$([ "$rc" = 124 ] && echo ' (timed out)')"
    { echo "===== $suite (exit status $rc)"; cat "$logs/$name.log"; } >> "$out/gpu_tests.log"
  done
  echo '```'
} >> "$report"

# Figures: cohort against PyTorch 2.11 on the same GPU (bench/gpu_figures.py: alternating runs,
# medians and per-pair ratios). It starts no run after its budget; the timeout is the backstop.
echo "## figures" >> "$report"
{
  echo '```'
  [ "${GPU_CHECK_SECTIONS:-all}" = none ] || PYTHONUNBUFFERED=1 timeout "${GPU_CHECK_FIGURES_S:-230}" "$python" "$root/bench/gpu_figures.py" --cohort "$wrapper" --resnet "$wrappers/resnet_ddp" \
    --runs "${GPU_CHECK_RUNS:-2}" --budget "${GPU_CHECK_BUDGET_S:-150}" --sections "${GPU_CHECK_SECTIONS:-single,resnet,ws1,streams,ddp2}" 2>&1 |
    tee "$out/figures.log"
  # fp16's encode of a 25 MB bucket on the GPU against the device's own copy, and topk's and
  # threshold's and onebit's encode on the host against on the device (bench/gpu_codec.cpp).
  [ -n "${GPU_CHECK_NO_CODEC:-}" ] || LD_LIBRARY_PATH="$libs" timeout 30 "$bundle/bin/gpu_codec" 2>&1 | tee "$out/gpu_codec.log"
  echo '```'
} >> "$report"
cat "$report"
exit $tests_status
