#!/usr/bin/env bash
# Every benchmark, one after the other (they would disturb each other if run together).
set -euo pipefail
build=${1:-build}
here=$(cd "$(dirname "$0")" && pwd)
/usr/bin/python3 "$here/single_process.py" --build "$build"
"$build/bench/codec_throughput" --reps 31
/usr/bin/python3 "$here/accuracy.py" --build "$build"
/usr/bin/python3 "$here/dataparallel.py" --build "$build"
/usr/bin/python3 "$here/library.py" --build "$build"
/usr/bin/python3 "$here/ps.py" --build "$build"
/usr/bin/python3 "$here/pipeline.py" --build "$build"
/usr/bin/python3 "$here/gossip.py" --build "$build"
/usr/bin/python3 "$here/replicas.py" --build "$build"
# Needs root (network namespaces, tc).
/usr/bin/python3 "$here/bandwidth.py" --build "$build"
