#!/usr/bin/env python3
"""Replicas as threads of one process, and averaging with an outer optimizer.

    /usr/bin/python3 bench/replicas.py [--build build] [--runs 5] [--sections mirrored,hogwild,outer]

mirrored: cnn on 2 cores, the same global batch (128): --strategy mirrored --replicas 2 (one
          process, 2 replica threads of 1 intra-op thread) against 2 processes of allreduce (batch
          64 each, 1 thread each) and one process with 2 intra-op threads; plus one single-threaded
          worker at batch 64, whose double is the linear limit. Median of alternating runs, with the
          median step time of each configuration and mirrored's waits of replicas for each other.
hogwild:  mlp, global batch 128 for EPOCHS epochs: hogwild --replicas 2 against mirrored --replicas
          2 and ps async (2 workers of batch 64, 1 shard): samples/s, test accuracy.
tensor:   mlp and mlp:4096 (hidden 4096), 2 processes: tensor --ways 2 against pipeline --stages 2
          and allreduce (batch 64 per replica): samples/s, bytes sent per step by the chief, the
          chief's peak memory.
outer:    cnn, 2 and 4 workers, the same examples (STEPS_OUTER steps of batch 64 per worker):
          average --period K (K 16, 64) plainly and with an outer Nesterov optimizer (lr 0.7,
          momentum 0.9, DiLoCo's), against allreduce: test accuracy and bytes sent by the chief.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, run, single_thread_env  # noqa: E402

STEPS_CNN = 120
EPOCHS = 1
STEPS_OUTER = 160


def train(build, tmp, workers, model, flags, threads="1", ps=0):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [os.path.join(build, "cohort"), "train", "--model", model, "--data", "fashion-mnist", "--threads", threads,
           "--optimizer", "momentum", "--lr", "0.01", "--progress", "off", "--metrics", metrics] + flags
    if workers > 1:
        launch = [os.path.join(build, "cohort"), "launch", "-n", str(workers)]
        if ps:
            launch += ["--ps", str(ps)]
        cmd = launch + ["--"] + cmd
    env = single_thread_env()
    if threads != "1":
        for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(k, None)
    run(cmd, env=env)
    return done_event(metrics)


def step_median_ms(tmp):
    """The median step time of the last run (its first 5 steps left out), in ms."""
    with open(os.path.join(tmp, "m.jsonl")) as f:
        steps = [e["step_s"] for e in map(json.loads, f) if e.get("event") == "step" and e["step"] > 5]
    return 1000 * median(steps)


def section_mirrored(args, tmp):
    steps = ["--steps", str(STEPS_CNN)]
    configs = [
        ("mirrored R=2, batch 128", 1, ["--strategy", "mirrored", "--replicas", "2", "--batch", "128"], "1"),
        ("allreduce 2 processes, batch 64 each", 2, ["--strategy", "allreduce", "--batch", "64"], "1"),
        ("1 process, 2 intra-op threads, batch 128", 1, ["--batch", "128"], "2"),
        ("1 process, 1 thread, batch 64", 1, ["--batch", "64"], "1"),
    ]
    rates = {name: [] for name, _, _, _ in configs}
    step_ms = {name: [] for name, _, _, _ in configs}
    waits = []  # mirrored: the replicas' mean time waiting for each other per run, s
    for i in range(args.runs):
        for name, workers, flags, threads in configs:
            d = train(args.build, tmp, workers, "cnn", steps + flags, threads)
            rates[name].append(d["samples_per_s"])
            step_ms[name].append(step_median_ms(tmp))
            if "replica_wait_s" in d:
                waits.append(d["replica_wait_s"])
        print(f"  run {i + 1}: " + ", ".join(f"{n.split(',')[0]} {rates[n][-1]:.1f}" for n, _, _, _ in configs),
              flush=True)
    m = {n: median(v) for n, v in rates.items()}
    spread = {n: (min(v), max(v)) for n, v in rates.items()}
    for n in m:
        print(f"cnn {n}: median {m[n]:.1f} samples/s (min {spread[n][0]:.1f}, max {spread[n][1]:.1f}); median step "
              f"{median(step_ms[n]):.1f} ms", flush=True)
    if waits:
        print(f"mirrored: replicas waiting for each other {median(waits):.3f} s per replica over {STEPS_CNN} steps "
              f"(median of runs)", flush=True)
    mirrored, allreduce, intra, single = (m[c[0]] for c in configs)
    print(f"mirrored / (2 x single-threaded worker) = {mirrored / (2 * single):.3f}; mirrored / allreduce = "
          f"{mirrored / allreduce:.3f}x; mirrored / 2 intra-op threads = {mirrored / intra:.3f}x", flush=True)


def section_hogwild(args, tmp):
    epochs = ["--epochs", str(EPOCHS)]
    configs = [
        ("hogwild R=2, batch 128", 1, ["--strategy", "hogwild", "--replicas", "2", "--batch", "128"], 0),
        ("mirrored R=2, batch 128", 1, ["--strategy", "mirrored", "--replicas", "2", "--batch", "128"], 0),
        ("ps async, 2 workers x batch 64, 1 shard", 2, ["--strategy", "ps", "--ps-mode", "async", "--batch", "64"], 1),
    ]
    for name, workers, flags, ps in configs:
        rates, accs, stale = [], [], []
        for _ in range(max(1, args.runs // 2)):
            d = train(args.build, tmp, workers, "mlp", epochs + flags, ps=ps)
            rates.append(d["samples_per_s"])
            accs.append(d["test_accuracy"])
            stale.append(d.get("staleness_mean", 0.0))
        print(f"mlp {EPOCHS} epoch(s), {name}: {median(rates):.1f} samples/s (min {min(rates):.1f}, max "
              f"{max(rates):.1f}), test accuracy {median(accs):.4f}, mean staleness {median(stale):.3f}", flush=True)


def section_outer(args, tmp):
    for workers in (2, 4):
        configs = [("allreduce", ["--strategy", "allreduce"])]
        for k in (16, 64):
            configs.append((f"average K={k}", ["--strategy", "average", "--period", str(k)]))
            configs.append((f"average K={k} + outer nesterov", ["--strategy", "average", "--period", str(k),
                                                                 "--outer-optimizer", "nesterov", "--outer-lr", "0.7",
                                                                 "--outer-momentum", "0.9"]))
        for name, flags in configs:
            d = train(args.build, tmp, workers, "cnn", ["--steps", str(STEPS_OUTER), "--batch", "64"] + flags)
            print(f"cnn {workers} workers, {STEPS_OUTER} steps x 64 per worker, {name}: test accuracy "
                  f"{d['test_accuracy']:.4f}, loss {d['test_loss']:.4f}, {d['bytes_sent'] / 1e6:.1f} MB sent by the "
                  f"chief, {d['samples_per_s']:.1f} samples/s", flush=True)


def step_bytes(tmp):
    sent, n = 0, 0
    with open(os.path.join(tmp, "m.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "step" and e["step"] > 5:
                sent += e["bytes_sent"]
                n += 1
    return sent / max(n, 1)


def section_tensor(args, tmp):
    for model, steps in (("mlp", 200), ("mlp:4096", 40)):
        configs = [("tensor --ways 2", ["--strategy", "tensor", "--ways", "2"]),
                   ("pipeline --stages 2", ["--strategy", "pipeline", "--stages", "2"]),
                   ("allreduce", ["--strategy", "allreduce"])]
        results = {name: [] for name, _ in configs}
        for _ in range(max(1, args.runs // 2)):
            for name, flags in configs:
                d = train(args.build, tmp, 2, model, ["--steps", str(steps), "--batch", "64"] + flags)
                results[name].append((d["samples_per_s"], step_bytes(tmp), d["max_rss_mb"], d["test_accuracy"]))
        for name, _ in configs:
            rows = results[name]
            print(f"{model}, 2 processes, {name}: {median([r[0] for r in rows]):.1f} samples/s, "
                  f"{median([r[1] for r in rows]) / 1e6:.3f} MB sent per step by the chief, chief's peak memory "
                  f"{median([r[2] for r in rows]):.0f} MB, test accuracy {median([r[3] for r in rows]):.4f}",
                  flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--sections", default="mirrored,hogwild,outer,tensor")
    args = p.parse_args()
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for section in args.sections.split(","):
            print(f"== {section}", flush=True)
            globals()[f"section_{section}"](args, tmp)


if __name__ == "__main__":
    main()
