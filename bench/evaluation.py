#!/usr/bin/env python3
"""Evaluation off the critical path, and 8-bit models.

    .venv/bin/python bench/evaluation.py [--build build] [--runs 3] [--sections evaluator,quantize]

evaluator: allreduce, 2 workers x 1 thread, cnn, batch 64, evaluation (test + 5000 validation
           examples) every 200 steps: training throughput when the chief evaluates (every rank
           waits for it) against an evaluator process reading the checkpoints (cohort launch
           --evaluator), and without evaluation as the reference. Throughput here is the samples of
           all steps over the wall time of the last step event: evaluation pauses count (the done
           event's samples_per_s leaves them out by design). Alternating runs, medians.
quantize:  a cnn and an mlp trained one epoch on Fashion-MNIST, then `cohort quantize`: file size,
           test accuracy and inference speed (1 thread; batch 1000, and batch 1 unless
           --quantize-batches leaves it out) of int8 against float.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import done_event, machine, median, run, single_thread_env  # noqa: E402


def training_rate(metrics):
    """Samples of every step over the wall time of the last step; and the number of eval events."""
    samples, last_wall, evals = 0, 0.0, 0
    with open(metrics) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "step":
                samples += e["samples"]
                last_wall = e["wall_s"]
            elif e.get("event") == "eval":
                evals += 1
    return samples / last_wall, evals


def evaluator_section(build, runs, steps):
    cohort = os.path.join(build, "cohort")
    modes = ["none", "chief", "evaluator"]
    rates = {m: [] for m in modes}
    evaluated = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(runs):
            for mode in modes:
                metrics = os.path.join(tmp, f"{mode}.jsonl")
                ckpt = os.path.join(tmp, f"ckpt-{mode}-{r}")
                train = [cohort, "train", "--strategy", "allreduce", "--model", "cnn", "--data", "fashion-mnist",
                         "--batch", "64", "--threads", "1", "--steps", str(steps), "--validation", "5000",
                         "--progress", "off", "--metrics", metrics]
                launch = [cohort, "launch", "-n", "2"]
                if mode == "chief":
                    train += ["--eval-every", "200"]
                elif mode == "evaluator":
                    launch.append("--evaluator")
                    train += ["--eval-every", "200", "--checkpoint-dir", ckpt]
                run(launch + ["--"] + train, env=single_thread_env())
                rate, evals = training_rate(metrics)
                rates[mode].append(rate)
                if mode == "evaluator":
                    with open(os.path.join(ckpt, "evaluator-0.jsonl")) as f:
                        evaluated[mode].append(sum(1 for line in f if '"eval"' in line))
                    shutil.rmtree(ckpt)
                else:
                    evaluated[mode].append(evals - 1)  # mid-run evaluations (the last one is after training)
                print(f"run {r} {mode}: {rate:.1f} samples/s, evaluations {evaluated[mode][-1]}", flush=True)
    out = {"steps": steps, "runs": runs}
    for m in modes:
        out[m] = {"median": median(rates[m]), "min": min(rates[m]), "max": max(rates[m]), "evaluations": evaluated[m]}
    out["evaluator_over_chief"] = out["evaluator"]["median"] / out["chief"]["median"]
    out["evaluator_over_none"] = out["evaluator"]["median"] / out["none"]["median"]
    out["chief_over_none"] = out["chief"]["median"] / out["none"]["median"]
    return out


def quantize_section(build, runs, batches):
    cohort = os.path.join(build, "cohort")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in ["cnn", "mlp"]:
            path = os.path.join(tmp, f"{model}.pt")
            run([cohort, "train", "--model", model, "--data", "fashion-mnist", "--epochs", "1", "--threads", "2",
                 "--progress", "off", "--save-model", path])
            out[model] = {}
            for batch in batches:
                metrics = os.path.join(tmp, f"q-{model}-{batch}.jsonl")
                repeat = runs if batch > 1 else 1
                cmd = [cohort, "quantize", path, "--out", os.path.join(tmp, f"{model}-int8.pt"), "--threads", "1",
                       "--repeat", str(repeat), "--batch", str(batch), "--metrics", metrics]
                proc, _ = run(cmd, env=single_thread_env())
                with open(metrics) as f:
                    q = json.loads(f.readline())
                out[model][f"batch{batch}"] = q
                print(proc.stdout, flush=True)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--sections", default="evaluator,quantize")
    parser.add_argument("--quantize-batches", default="1000,1", help="inference batch sizes timed by quantize")
    args = parser.parse_args()
    sections = args.sections.split(",")
    result = {"machine": machine()}
    if "evaluator" in sections:
        result["evaluator"] = evaluator_section(args.build, args.runs, args.steps)
    if "quantize" in sections:
        result["quantize"] = quantize_section(args.build, args.runs,
                                              [int(b) for b in args.quantize_batches.split(",")])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
