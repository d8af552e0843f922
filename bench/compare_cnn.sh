#!/bin/bash
# Issue 15's full comparison on the cnn, one run at a time: each run holds the exclusive machine
# lock (machine-lock bench) alone, so that builds can go on between runs but never beside one.
# The rounds alternate (run 1 of every configuration, then run 2, ...), and `cohort compare` is
# resumable, so the script can be stopped and started again. At the end, the full report.
# usage: bench/compare_cnn.sh COHORT_BINARY OUTDIR [extra compare options, e.g. --network 100mbit]
set -u
bin=$1 out=$2; shift 2
configs="local allreduce average-k4 average-k16 ps-sync ps-sync-backup ps-async ps-softsync ps-ssp gossip pipeline"
lock=${MACHINE_LOCK:-machine-lock}
for r in 1 2 3; do
  for c in $configs; do
    [ -f "$out/runs/$c.r$r/status.json" ] && continue
    echo "=== $(date +%T) run $r $c"
    $lock bench "$bin" compare --model cnn --epochs 2 --runs $r --only $c --out "$out" --no-png "$@" || true
  done
done
echo "=== $(date +%T) all runs done; the full report"
"$bin" compare --model cnn --epochs 2 --runs 3 --out "$out" "$@"
