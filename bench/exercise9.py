#!/usr/bin/env python3
"""Géron's exercise 9: train several networks with different hyper-parameters, keep the top three
on a validation set, ensemble them: does the ensemble beat the individual networks?

    .venv/bin/python bench/exercise9.py [--build build] [--sweep bench/exercise9.toml] [--parallel 2]

1. cohort sweep FILE --parallel P --top 3: the trials (each one process, the cores split among
   the P running at once), ranked by validation accuracy; the best 3 models kept.
2. cohort ensemble of the top 3 on the validation and the test set (the average of their softmax
   outputs), each model's accuracy beside the ensemble's; and, for comparison, the ensemble of
   every finished trial.
Accuracy only, no timing: one sweep. The standard error of a test accuracy p on 10000 examples is
sqrt(p (1 - p) / 10000), about 0.3 points here; it is printed with the table.
"""
import argparse
import glob
import json
import math
import os
import shlex
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, machine, run  # noqa: E402


def read_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ensemble(cohort, models, metrics, validation):
    cmd = [cohort, "ensemble", *models, "--data", "fashion-mnist", "--validation", str(validation), "--threads", "2",
           "--metrics", metrics]
    proc, seconds = run(cmd)
    print(proc.stdout, flush=True)
    events = read_lines(metrics)
    return cmd, [e for e in events if e["event"] == "model"], [e for e in events if e["event"] == "ensemble"][0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--sweep", default=os.path.join(ROOT, "bench", "exercise9.toml"))
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--validation", type=int, default=5000, help="the sweep file's validation")
    parser.add_argument("--out", default="", help="keep the sweep's folder here (default: a temporary one)")
    args = parser.parse_args()
    cohort = os.path.join(args.build, "cohort")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or os.path.join(tmp, "sweep")
        sweep_cmd = [cohort, "sweep", args.sweep, "--parallel", str(args.parallel), "--top", "3", "--out", out]
        proc, sweep_seconds = run(sweep_cmd, timeout=3600)
        print(proc.stdout, flush=True)
        trials = read_lines(os.path.join(out, "results.jsonl"))
        top = sorted(glob.glob(os.path.join(out, "top", "*.pt")))
        assert len(top) == 3, top
        top_cmd, top_models, top_ensemble = ensemble(cohort, top, os.path.join(tmp, "top3.jsonl"), args.validation)
        everything = [os.path.join(out, "runs", t["trial"], "model.pt") for t in trials if t["status"] == "ok"]
        all_cmd, _, all_ensemble = ensemble(cohort, everything, os.path.join(tmp, "all.jsonl"), args.validation)

    best_val = max(m["val_accuracy"] for m in top_models)
    best_test = max(m["test_accuracy"] for m in top_models)
    mean_test = sum(m["test_accuracy"] for m in top_models) / len(top_models)
    p = top_ensemble["test_accuracy"]
    result = {
        "machine": machine(),
        "sweep_command": " ".join(shlex.quote(c) for c in sweep_cmd),
        "sweep_seconds": sweep_seconds,
        "ensemble_command": " ".join(shlex.quote(c) for c in top_cmd),
        "trials": [{k: t.get(k) for k in ("trial", "rank", "status", "options", "val_accuracy", "test_accuracy",
                                          "samples_per_s", "wall_s")} for t in trials],
        "top3": [{k: m[k] for k in ("path", "val_accuracy", "test_accuracy", "test_loss", "test_macro_f1")}
                 for m in top_models],
        "ensemble_top3": {k: top_ensemble[k] for k in ("val_accuracy", "test_accuracy", "test_loss", "test_macro_f1")},
        "ensemble_all": {k: all_ensemble[k] for k in ("models", "val_accuracy", "test_accuracy", "test_loss",
                                                      "test_macro_f1")},
        "ensemble_minus_best_val_points": 100 * (top_ensemble["val_accuracy"] - best_val),
        "ensemble_minus_best_test_points": 100 * (p - best_test),
        "ensemble_minus_mean_test_points": 100 * (p - mean_test),
        "test_standard_error_points": 100 * math.sqrt(p * (1 - p) / 10000),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
