#!/usr/bin/env python3
"""The seeds' scaling figures and Chen et al.'s backup-worker comparison, re-derived by `cohort simulate`
from a calibration of this machine (the link, reduction, shard and codec costs) and the stated
assumptions about the 2016 hardware and models. Prints markdown tables.

    .venv/bin/python bench/simulate_tables.py [--build build] [--calibration tests/data/calibration_cnn.json]
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Q1 2016 (the seeds' date): K40 GPUs, 10 Gbit/s Ethernet, 100 us per message.
NETWORK = ["--bandwidth", "10gbit", "--latency-us", "100"]
# Inception v3: 23.8 M parameters, ~25 examples/s per K40 (40 ms each), batch 32 per worker.
DENSE = ["--params", "23.8e6", "--example-ms", "40", "--batch", "32"]
# A sparse model in the RankBrain mould: 500 M parameters (mostly embeddings), 1 % of the rows
# touched per step, 5 ms per example, batch 32.
SPARSE = ["--params", "500e6", "--example-ms", "5", "--batch", "32", "--density", "0.01"]


def simulate(args, extra):
    cmd = [os.path.join(args.build, "cohort"), "simulate", "--calibration", args.calibration, "--json"] + extra
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    return [r for r in rows if "event" not in r], [r for r in rows if "event" in r]


def speedups(args, model, scheme, counts):
    rows, knees = simulate(args, model + NETWORK + scheme + ["--workers", ",".join(map(str, [1] + counts))])
    by = {r["workers"]: r for r in rows}
    return [by[c]["speedup"] for c in counts], knees[0]["stops_paying_workers"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--calibration", default=os.path.join(ROOT, "tests", "data", "calibration_cnn.json"))
    args = p.parse_args()

    counts = [8, 50, 500]
    print("| model | scheme | 8 workers | 50 | 500 | stops paying at |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    configs = [("dense (Inception v3 size)", DENSE, f"ps async, {k} shard{'s' if k > 1 else ''}{' ' + c if c != 'none' else ''}",
                ["--strategy", "ps", "--ps-mode", "async", "--shards", str(k), "--codec", c])
               for k in (1, 4, 16) for c in ("none", "fp16", "threshold:0.001")]
    configs += [("dense (Inception v3 size)", DENSE, "allreduce (ring)", ["--strategy", "allreduce"]),
                ("dense (Inception v3 size)", DENSE, "allreduce fp16", ["--strategy", "allreduce", "--codec", "fp16"])]
    configs += [("sparse (500 M, 1 % rows)", SPARSE, f"ps async, {k} shards", ["--strategy", "ps", "--shards", str(k)])
                for k in (16, 64)]
    configs += [("sparse (500 M, 1 % rows)", SPARSE, "allreduce (rows allgathered)", ["--strategy", "allreduce"])]
    for model_name, model, name, scheme in configs:
        s, knee = speedups(args, model, scheme, counts)
        print(f"| {model_name} | {name} | {s[0]:.1f}x | {s[1]:.1f}x | {s[2]:.1f}x | {knee or 'beyond 500'} |")

    print()
    print("| workers | scheme | time per update (s) | samples/s | compute (s) | waiting (s) | staleness |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    chen = DENSE + NETWORK + ["--strategy", "ps", "--shards", "16", "--stragglers", "pareto:2:0.03", "--steps", "300"]
    for w in (50, 100):
        runs = [("sync", ["--ps-mode", "sync"])]
        runs += [(f"sync, {b} backup", ["--ps-mode", "sync", "--backup-workers", str(b)]) for b in (2, 4, 6)]
        runs += [("async", ["--ps-mode", "async"])]
        for name, extra in runs:
            rows, _ = simulate(args, chen + extra + ["--workers", str(w)])
            r = rows[0]
            print(f"| {w} | {name} | {r['step_s']:.2f} | {r['samples_per_s']:.0f} | {r['compute_s']:.2f} | "
                  f"{r['wait_s']:.2f} | {r['staleness']:.0f} |")


if __name__ == "__main__":
    main()
