#!/usr/bin/env bash
# `make bench`: ten benchmarks, one after the other (they would disturb each other if run together);
# the rest of bench/ runs on its own, with the commands docs/BENCHMARKS.md gives.
set -euo pipefail
build=${1:-build}
here=$(cd "$(dirname "$0")" && pwd)
# The Python peer is the torch 2.11 wheel that scripts/setup.sh installed (COHORT_VENV, default .venv).
python="${COHORT_VENV:-$here/../.venv}/bin/python"
"$python" "$here/single_process.py" --build "$build"
"$build/bench/codec_throughput" --reps 31
"$python" "$here/accuracy.py" --build "$build"
"$python" "$here/dataparallel.py" --build "$build"
"$python" "$here/library.py" --build "$build"
"$python" "$here/ps.py" --build "$build"
"$python" "$here/pipeline.py" --build "$build"
"$python" "$here/gossip.py" --build "$build"
"$python" "$here/replicas.py" --build "$build"
# Needs root (network namespaces, tc).
"$python" "$here/bandwidth.py" --build "$build"
