#!/usr/bin/env python3
"""Compression on the wire (--codec): Strom's table on real gradients, and the accuracy cost.

    .venv/bin/python bench/compression.py [--build build] [--table-steps 60] [--epochs 2] [--skip-table] [--skip-accuracy]

1. Bytes per update (build/bench/codec_table): a 14.6M-parameter mlp (784-2510-2510-2510-10) and
   the cnn train briefly on Fashion-MNIST (SGD, momentum 0.9, lr 0.01, batch 64); every step's
   gradient is encoded by every codec, each keeping its own residual. One message per update for
   the whole flattened gradient. Reduction = bytes of none / bytes of the codec.
2. Accuracy cost: the cnn on Fashion-MNIST, 2 workers (cohort launch -n 2, --strategy allreduce),
   --epochs E, each codec, side by side with none in the same run.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, run  # noqa: E402

TABLE_CODECS = {
    "mlp14m": ["none", "fp16", "bf16", "threshold:0.001", "threshold:0.003", "threshold:0.01", "threshold:0.03",
               "topk:0.01", "topk:0.001", "onebit"],
    "cnn": ["none", "fp16", "bf16", "threshold:0.001", "threshold:0.003", "threshold:0.01", "threshold:0.03",
            "topk:0.01", "topk:0.001", "onebit"],
}
ACCURACY_CODECS = ["none", "fp16", "bf16", "threshold:0.003", "threshold:0.01", "topk:0.01", "onebit"]


def table(build, model, steps):
    proc, seconds = run([os.path.join(build, "bench", "codec_table"), model, str(steps)] + TABLE_CODECS[model],
                        timeout=3600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    base = next(r for r in rows if r["codec"] == "none")["bytes_per_update"]
    print(f"\n{model}: {rows[0]['parameters']} parameters, {steps} steps, loss {rows[0]['loss_first']:.3f} -> "
          f"{rows[0]['loss_last']:.3f} ({seconds:.0f} s)")
    print("| codec | bytes per update | entries sent per update | bytes per entry sent | reduction vs none | encode ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        per_entry = r["bytes_per_update"] / r["entries_sent_per_update"] if r["entries_sent_per_update"] else float("nan")
        print(f"| {r['codec']} | {r['bytes_per_update']:.0f} | {r['entries_sent_per_update']:.0f} | {per_entry:.2f} | "
              f"**{base / r['bytes_per_update']:.1f}x** | {r['encode_ms']:.1f} |", flush=True)


def accuracy(build, epochs, codecs):
    cohort = os.path.join(build, "cohort")
    print(f"\ncnn, Fashion-MNIST, 2 workers, allreduce, {epochs} epoch(s), batch 64 per worker, momentum 0.9, lr 0.01")
    print(f"| codec | test accuracy | vs {codecs[0]} (points) | MB sent by the chief | samples/s | wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for port, codec in enumerate(codecs):
            metrics = os.path.join(tmp, "m.jsonl")
            run([cohort, "launch", "-n", "2", "--port", str(29700 + 7 * port), "--", cohort, "train", "--model", "cnn",
                 "--data", "fashion-mnist", "--epochs", str(epochs), "--batch", "64", "--lr", "0.01", "--optimizer",
                 "momentum", "--momentum", "0.9", "--strategy", "allreduce", "--codec", codec, "--progress", "off",
                 "--metrics", metrics], timeout=7200)
            done = done_event(metrics)
            acc = done["test_accuracy"]
            base = acc if base is None else base
            print(f"| {codec} | {acc:.4f} | {100 * (acc - base):+.2f} | {done['bytes_sent'] / 1e6:.1f} | "
                  f"{done['samples_per_s']:.0f} | {done['wall_s']:.0f} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--table-steps", type=int, default=60)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--skip-table", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--codecs", default=",".join(ACCURACY_CODECS),
                   help="the accuracy runs' codecs, comma-separated; the first is the reference")
    args = p.parse_args()
    print(f"machine: {machine()}")
    if not args.skip_table:
        for model in ("mlp14m", "cnn"):
            table(args.build, model, args.table_steps)
    if not args.skip_accuracy:
        accuracy(args.build, args.epochs, args.codecs.split(","))


if __name__ == "__main__":
    main()
