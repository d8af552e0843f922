#!/usr/bin/env python3
"""cohort as a library, measured against the command line and against PyTorch.

    .venv/bin/python bench/library.py [--build build] [--runs 5] [--sections train,resnet,unused,resnet-bf16]

train:  the cnn, 2 workers x 1 thread, batch 64: `cohort train --strategy allreduce` against the
        same loop written by a user with the library (bench/library_loop.cpp), with the gradients
        dropped as the CLI does and with optimizer.zero_grad(). Target: library / train >= 0.98.
resnet: examples/library/resnet_ddp.cpp (a ResNet with BatchNorm and skip connections, the user's
        own loop, cohort::DataParallel) against its Python twin under PyTorch DDP
        (bench/resnet_ddp.py), 2 workers x 1 thread, batch 32. Target: cohort / PyTorch >= 1.10.
resnet-bf16: (not in the default set) resnet's pair with both loops under autocast in bfloat16
        (the example's --autocast bf16: cohort::Autocast; torch.autocast), and the example's float32
        runs beside them: cohort / PyTorch, and the example's bf16 / float32.
unused: the library loop (zero_grad) with and without DataParallelOptions::findUnusedParameters,
        whose cost is an allreduce of an int32 per parameter per step; the ratio, and the bytes
        and the time waited on communication per step.
Runs alternate within each section; medians, the spread (min-max) and the ratio of medians.
"""
import argparse
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, run, single_thread_env  # noqa: E402


def json_line(stdout):
    for line in stdout.splitlines():
        if "samples_per_s" in line:
            return json.loads(line.split("] ", 1)[-1])
    raise RuntimeError(stdout)


def cohort_train(build, tmp, steps):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cohort = os.path.join(build, "cohort")
    run([cohort, "launch", "-n", "2", "--", cohort, "train", "--strategy", "allreduce", "--model", "cnn",
         "--batch", "64", "--threads", "1", "--optimizer", "momentum", "--lr", "0.01", "--progress", "off",
         "--steps", str(steps), "--metrics", metrics], env=single_thread_env())
    return done_event(metrics)["samples_per_s"]


def library_loop(build, steps, zero_grad, find_unused=False, everything=False):
    cmd = [os.path.join(build, "cohort"), "launch", "-n", "2", "--", os.path.join(build, "bench", "library_loop"),
           "--steps", str(steps)] + (["--zero-grad"] if zero_grad else [])
    cmd += ["--find-unused-parameters"] if find_unused else []
    proc, _ = run(cmd, env=single_thread_env())
    line = json_line(proc.stdout)
    return line if everything else line["samples_per_s"]


def resnet_cohort(build, steps, autocast="off"):
    proc, _ = run([os.path.join(build, "cohort"), "launch", "-n", "2", "--", os.path.join(build, "bench", "resnet_ddp"),
                   "--steps", str(steps), "--batch", "32", "--autocast", autocast], env=single_thread_env())
    m = re.search(r"([0-9.]+) samples/s", proc.stdout)
    if not m:
        raise RuntimeError(proc.stdout)
    return float(m.group(1))


def resnet_pytorch(build, steps, autocast="off"):
    proc, _ = run([os.path.join(build, "cohort"), "launch", "-n", "2", "--", sys.executable,
                   os.path.join(ROOT, "bench", "resnet_ddp.py"), "--steps", str(steps), "--batch", "32",
                   "--autocast", autocast], env=single_thread_env())
    return json_line(proc.stdout)["samples_per_s"]


def summary(name, values):
    return f"{name:<32} median {median(values):8.1f} samples/s  (min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--sections", default="train,resnet,unused")
    args = p.parse_args()
    sections = args.sections.split(",")
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        if "train" in sections:
            rates = {"cohort train": [], "library (grads dropped)": [], "library (zero_grad)": []}
            for _ in range(args.runs):
                rates["cohort train"].append(cohort_train(args.build, tmp, 300))
                rates["library (grads dropped)"].append(library_loop(args.build, 300, False))
                rates["library (zero_grad)"].append(library_loop(args.build, 300, True))
            print("\n[train] cnn, 2 workers x 1 thread, batch 64, 300 steps")
            for name, values in rates.items():
                print(summary(name, values))
            base = median(rates["cohort train"])
            for name in ("library (grads dropped)", "library (zero_grad)"):
                print(f"ratio {name} / cohort train: {median(rates[name]) / base:.3f}")
        if "unused" in sections:
            steps = 300
            runs = {False: [], True: []}
            for _ in range(args.runs):
                for find in (False, True):
                    runs[find].append(library_loop(args.build, steps, True, find_unused=find, everything=True))
            print(f"\n[unused] cnn library loop (zero_grad), 2 workers x 1 thread, batch 64, {steps} steps")
            for find in (False, True):
                name = "findUnusedParameters" if find else "default"
                rates = [r["samples_per_s"] for r in runs[find]]
                sent = median([r["bytes_sent"] / r["steps"] for r in runs[find]])
                wait = median([1000 * r["comm_wait_s"] / r["steps"] for r in runs[find]])
                print(summary(name, rates) + f"  sent/step {sent:.0f} B  waited/step {wait:.2f} ms")
            base = median([r["samples_per_s"] for r in runs[False]])
            print(f"ratio findUnusedParameters / default: "
                  f"{median([r['samples_per_s'] for r in runs[True]]) / base:.3f}")
        if "resnet" in sections:
            rates = {"cohort DataParallel (C++)": [], "PyTorch DDP (Python)": []}
            for _ in range(args.runs):
                rates["cohort DataParallel (C++)"].append(resnet_cohort(args.build, 80))
                rates["PyTorch DDP (Python)"].append(resnet_pytorch(args.build, 80))
            print("\n[resnet] examples/library ResNet, 2 workers x 1 thread, batch 32, 80 steps")
            for name, values in rates.items():
                print(summary(name, values))
            print(f"ratio cohort / PyTorch DDP: "
                  f"{median(rates['cohort DataParallel (C++)']) / median(rates['PyTorch DDP (Python)']):.3f}")
        if "resnet-bf16" in sections:
            names = ("cohort bf16", "PyTorch DDP bf16", "cohort float32")
            rates = {name: [] for name in names}
            for _ in range(args.runs):
                rates["cohort bf16"].append(resnet_cohort(args.build, 80, "bf16"))
                rates["PyTorch DDP bf16"].append(resnet_pytorch(args.build, 80, "bf16"))
                rates["cohort float32"].append(resnet_cohort(args.build, 80))
            print("\n[resnet-bf16] examples/library ResNet under autocast bf16, 2 workers x 1 thread, batch 32, 80 steps")
            for name, values in rates.items():
                print(summary(name, values))
            ours = rates["cohort bf16"]
            print(f"ratio cohort bf16 / PyTorch DDP bf16: {median(ours) / median(rates['PyTorch DDP bf16']):.3f} "
                  f"(per pair {', '.join(f'{a / b:.3f}' for a, b in zip(ours, rates['PyTorch DDP bf16']))})")
            print(f"ratio cohort bf16 / cohort float32: {median(ours) / median(rates['cohort float32']):.3f} "
                  f"(per pair {', '.join(f'{a / b:.3f}' for a, b in zip(ours, rates['cohort float32']))})")


if __name__ == "__main__":
    main()
