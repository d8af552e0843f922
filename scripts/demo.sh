#!/usr/bin/env bash
# The main job: the seeds' cnn on Fashion-MNIST, one epoch, evaluated on the test set.
set -euo pipefail
build=${1:-build}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$build/cohort" train --model cnn --data fashion-mnist --epochs 1 --batch 64 --lr 0.01 \
  --optimizer momentum --eval-every 300 --metrics "$out/metrics.jsonl"
echo "metrics: $(tail -n 1 "$out/metrics.jsonl")"
