#!/usr/bin/env bash
# The main job: the seeds' cnn on Fashion-MNIST, trained by 2 worker processes with synchronous
# allreduce (one epoch, one core each), then evaluated on the test set.
set -euo pipefail
build=${1:-build}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$build/cohort" launch -n 2 -- "$build/cohort" train --strategy allreduce --model cnn \
  --data fashion-mnist --epochs 1 --batch 64 --lr 0.01 --optimizer momentum --eval-every 200 \
  --metrics "$out/metrics.jsonl"
echo "metrics: $(tail -n 1 "$out/metrics.jsonl")"
