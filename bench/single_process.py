#!/usr/bin/env python3
"""cohort's single-process throughput against Python PyTorch on the same model, side by side.

    .venv/bin/python bench/single_process.py [--build build] [--runs 5] [--models mlp,cnn]

Both: Fashion-MNIST, batch 64, momentum SGD, 1 intra-op thread, data preloaded; runs alternate
cohort / PyTorch so that machine noise hits both. Prints each run, then the medians and the ratio.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, run, single_thread_env  # noqa: E402

STEPS = {"mlp": 600, "cnn": 150}


def cohort_rate(binary, model, steps, tmp, device):
    metrics = os.path.join(tmp, "m.jsonl")
    run([binary, "train", "--model", model, "--data", "fashion-mnist", "--steps",
         str(steps), "--batch", "64", "--threads", "1", "--optimizer", "momentum", "--lr", "0.01",
         "--progress", "off", "--device", device, "--metrics", metrics], env=single_thread_env())
    return done_event(metrics)["samples_per_s"]


def pytorch_rate(model, steps, device):
    proc, _ = run([sys.executable, os.path.join(ROOT, "bench", "pytorch_single.py"), "--model", model,
                   "--steps", str(steps), "--threads", "1", "--device", device], env=single_thread_env())
    return json.loads(proc.stdout.strip().splitlines()[-1])["samples_per_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N, for both loops")
    p.add_argument("--cohort", help="the cohort binary (default: BUILD/cohort)")
    args = p.parse_args()
    binary = args.cohort or os.path.join(args.build, "cohort")
    print(f"machine: {machine()}, device {args.device}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            steps = STEPS.get(model, 200)
            ours, theirs = [], []
            for i in range(args.runs):
                ours.append(cohort_rate(binary, model, steps, tmp, args.device))
                theirs.append(pytorch_rate(model, steps, args.device))
                print(f"  {model} run {i + 1}: cohort {ours[-1]:8.1f}  pytorch {theirs[-1]:8.1f} samples/s",
                      flush=True)
            ratios = sorted(a / b for a, b in zip(ours, theirs))
            print(f"{model}: cohort median {median(ours):.1f} samples/s, PyTorch median {median(theirs):.1f} "
                  f"samples/s, ratio of medians {median(ours) / median(theirs):.3f}x "
                  f"(per-pair ratios {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)


if __name__ == "__main__":
    main()
