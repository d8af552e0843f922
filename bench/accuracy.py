#!/usr/bin/env python3
"""Test accuracy of cohort's built-in models on Fashion-MNIST, as the trunk issue states them.

    .venv/bin/python bench/accuracy.py [--build build]

cnn: 3 epochs, mlp: 1 epoch; both momentum 0.9, lr 0.01, batch 64, seed 1, all cores.
Prints the test accuracy after each epoch and the final figures.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, run  # noqa: E402

RUNS = [("mlp", 1, 0.80), ("cnn", 3, 0.88)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    args = p.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        for model, epochs, target in RUNS:
            metrics = os.path.join(tmp, f"{model}.jsonl")
            run([os.path.join(args.build, "cohort"), "train", "--model", model, "--data", "fashion-mnist",
                 "--epochs", str(epochs), "--batch", "64", "--lr", "0.01", "--optimizer", "momentum",
                 "--momentum", "0.9", "--eval-every", "938", "--progress", "off", "--metrics", metrics])
            with open(metrics) as f:
                evals = [json.loads(l) for l in f if '"event":"eval"' in l]
            curve = ", ".join(f"{e['accuracy']:.4f}" for e in evals)
            done = done_event(metrics)
            verdict = "meets" if done["test_accuracy"] >= target else "MISSES"
            print(f"{model}: {epochs} epoch(s), test accuracy per epoch [{curve}], final "
                  f"{done['test_accuracy']:.4f} ({verdict} the {target:.2f} target), "
                  f"{done['samples_per_s']:.0f} samples/s, {done['wall_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
