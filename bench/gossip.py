#!/usr/bin/env python3
"""gossip against ps --ps-mode async and allreduce, with one worker slowed on purpose.

    .venv/bin/python bench/gossip.py [--build build] [--runs 3] [--epochs 2] [--slow 0.05] [--model mlp]

3 workers x 1 thread on Fashion-MNIST, batch 64, momentum SGD lr 0.01; worker 2 sleeps --slow
seconds in every step (--test-slow-worker). gossip sends to all peers every step, or (K=1) to one
random peer per step (the other's share waits for its turn, summed). The schemes alternate within each run, so they
share the machine's load; medians over the runs. For each: samples/s (cohort's steady-state
figure, every worker's samples as the chief counts them), the chief's test accuracy at the end
of every epoch, wall time, the chief's median step time, bytes per step, and gossip's staleness.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, run, single_thread_env  # noqa: E402

WORKERS = 3
BATCH = 64
TRAIN = 60000
SCHEMES = [("allreduce", ["--strategy", "allreduce"], 0),
           ("ps async", ["--strategy", "ps", "--ps-mode", "async"], 1),
           ("gossip", ["--strategy", "gossip"], 0),
           ("gossip K=1", ["--strategy", "gossip", "--gossip-peers", "1"], 0)]


def train(args, tmp, flags, shards):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cohort = os.path.join(args.build, "cohort")
    per_epoch = TRAIN // WORKERS // BATCH
    cmd = [cohort, "train", "--model", args.model, "--data", "fashion-mnist", "--batch", str(BATCH), "--threads", "1",
           "--optimizer", "momentum", "--lr", "0.01", "--progress", "off", "--epochs", str(args.epochs),
           "--eval-every", str(per_epoch), "--test-slow-worker", f"{WORKERS - 1}:{args.slow}", "--timeout", "300",
           "--metrics", metrics] + flags
    cmd = [cohort, "launch", "-n", str(WORKERS)] + (["--ps", str(shards)] if shards else []) + ["--"] + cmd
    run(cmd, env=single_thread_env())
    steps, evals = [], []
    with open(metrics) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "step" and e["step"] > 5:
                steps.append(e)
            elif e.get("event") == "eval":
                evals.append(e["accuracy"])
    done = done_event(metrics)
    done["epoch_accuracy"] = evals[:args.epochs - 1] + [done["test_accuracy"]]
    done["step_ms"] = 1000 * median([e["step_s"] for e in steps])
    done["kb_per_step"] = median([e["bytes_sent"] + e["bytes_received"] for e in steps]) / 1e3
    return done


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--slow", type=float, default=0.05, help="seconds worker 2 sleeps per step")
    p.add_argument("--model", default="mlp")
    args = p.parse_args()
    print(f"machine: {machine()}")
    print(f"{args.model}, {WORKERS} workers x 1 thread, batch {BATCH}, {args.epochs} epochs, worker {WORKERS - 1} "
          f"sleeps {args.slow} s per step, median of {args.runs} alternating runs", flush=True)
    results = {name: [] for name, _, _ in SCHEMES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name, flags, shards in SCHEMES:
                d = train(args, tmp, flags, shards)
                results[name].append(d)
                print(f"  run {i + 1} {name:12s} {d['samples_per_s']:8.1f} samples/s, accuracy per epoch "
                      f"{[round(a, 4) for a in d['epoch_accuracy']]}, wall {d['wall_s']:.1f} s", flush=True)
    base = median([d["samples_per_s"] for d in results["allreduce"]])
    for name, _, _ in SCHEMES:
        r = results[name]
        rate = median([d["samples_per_s"] for d in r])
        accuracy = [median([d["epoch_accuracy"][e] for d in r]) for e in range(args.epochs)]
        extra = ""
        if name.startswith("gossip"):
            extra = (f", staleness mean {median([d['staleness_mean'] for d in r]):.1f} max "
                     f"{median([d['staleness_max'] for d in r]):.0f}")
        elif name == "ps async":
            extra = f", staleness mean {median([d['staleness_mean'] for d in r]):.1f}"
        print(f"{name:12s} {rate:8.1f} samples/s ({rate / base:5.2f}x allreduce), accuracy per epoch "
              f"{' '.join(f'{a:.4f}' for a in accuracy)}, chief step {median([d['step_ms'] for d in r]):6.1f} ms, "
              f"{median([d['kb_per_step'] for d in r]):8.1f} kB/step, wall {median([d['wall_s'] for d in r]):5.1f} s"
              f"{extra}", flush=True)


if __name__ == "__main__":
    main()
