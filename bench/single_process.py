#!/usr/bin/env python3
"""cohort's single-process throughput against Python PyTorch on the same model, side by side.

    .venv/bin/python bench/single_process.py [--build build] [--runs 5] [--models mlp,cnn]
        [--device cpu] [--autocast off|bf16|both]

Both: Fashion-MNIST, batch 64, momentum SGD, 1 intra-op thread, data preloaded; runs alternate
cohort / PyTorch so that machine noise hits both. Prints each run, then the medians and the ratio.
--autocast bf16 runs both loops under autocast (cohort's --autocast bf16, torch.autocast); both
adds cohort's float32 runs beside them, alternating, and the ratio of the two.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, run, single_thread_env  # noqa: E402

STEPS = {"mlp": 600, "cnn": 150}


def cohort_rate(binary, model, steps, tmp, device, autocast="off"):
    metrics = os.path.join(tmp, "m.jsonl")
    run([binary, "train", "--model", model, "--data", "fashion-mnist", "--steps",
         str(steps), "--batch", "64", "--threads", "1", "--optimizer", "momentum", "--lr", "0.01",
         "--progress", "off", "--device", device, "--autocast", autocast, "--metrics", metrics],
        env=single_thread_env())
    return done_event(metrics)["samples_per_s"]


def pytorch_rate(model, steps, device, autocast="off"):
    proc, _ = run([sys.executable, os.path.join(ROOT, "bench", "pytorch_single.py"), "--model", model,
                   "--steps", str(steps), "--threads", "1", "--device", device, "--autocast", autocast],
                  env=single_thread_env())
    return json.loads(proc.stdout.strip().splitlines()[-1])["samples_per_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N, for both loops")
    p.add_argument("--cohort", help="the cohort binary (default: BUILD/cohort)")
    p.add_argument("--autocast", default="off", choices=["off", "bf16", "both"],
                   help="both loops under autocast bf16; both: float32 and bf16 runs alternating")
    args = p.parse_args()
    binary = args.cohort or os.path.join(args.build, "cohort")
    print(f"machine: {machine()}, device {args.device}, autocast {args.autocast}")
    modes = ["off", "bf16"] if args.autocast == "both" else [args.autocast]
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            steps = STEPS.get(model, 200)
            ours = {m: [] for m in modes}
            theirs = {m: [] for m in modes}
            for i in range(args.runs):
                for m in modes:
                    ours[m].append(cohort_rate(binary, model, steps, tmp, args.device, m))
                    theirs[m].append(pytorch_rate(model, steps, args.device, m))
                    print(f"  {model} run {i + 1} autocast {m}: cohort {ours[m][-1]:8.1f}  "
                          f"pytorch {theirs[m][-1]:8.1f} samples/s", flush=True)
            for m in modes:
                report(f"{model} autocast {m}: cohort", ours[m], "PyTorch", theirs[m])
            if len(modes) == 2:
                report(f"{model}: cohort bf16", ours["bf16"], "cohort float32", ours["off"])
                report(f"{model}: PyTorch bf16", theirs["bf16"], "PyTorch float32", theirs["off"])


def report(name, ours, other, theirs):
    ratios = sorted(a / b for a, b in zip(ours, theirs))
    print(f"{name} median {median(ours):.1f} samples/s, {other} median {median(theirs):.1f} "
          f"samples/s, ratio of medians {median(ours) / median(theirs):.3f}x "
          f"(per-pair ratios {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)

if __name__ == "__main__":
    main()
