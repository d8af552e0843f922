#!/usr/bin/env python3
"""Replicas as threads of one process, and averaging with an outer optimizer.

    .venv/bin/python bench/replicas.py [--build build] [--runs 5] [--sections mirrored,hogwild,outer]

mirrored: cnn on 2 cores, the same global batch (128): --strategy mirrored --replicas 2 (one
          process, 2 replica threads of 1 intra-op thread), split evenly and with --balance-shards
          (its median largest shard is printed), against 2 processes of allreduce (batch 64 each,
          1 thread each) and one process with 2 intra-op threads; plus one single-threaded
          worker at batch 64, whose double is the linear limit; two such workers run at once as
          independent processes (the machine's own ceiling for two workers); mirrored with one
          replica at batch 64 (the scheme's costs without a second thread). Median of alternating
          runs, with the median step time of each configuration and, for mirrored, where a
          replica's step goes (the replica_*_s fields of the step events: hand-off, forward,
          backward, copy into the buckets, sums, optimizer, waiting for the other replicas).
hogwild:  mlp, global batch 128 for --epochs epochs (default 2, the issue's): hogwild --replicas 2
          against mirrored --replicas 2 and ps async (2 workers of batch 64, 1 shard), the three
          alternating run by run: samples/s, test accuracy, mean staleness.
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
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, run, single_thread_env, wait_all  # noqa: E402

STEPS_CNN = 120
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
    return 1000 * median(step_fields(tmp, ["step_s"])["step_s"])


def step_fields(tmp, names, metrics="m.jsonl"):
    """Each named field of the last run's step events (its first 5 steps left out)."""
    with open(os.path.join(tmp, metrics)) as f:
        steps = [e for e in map(json.loads, f) if e.get("event") == "step" and e["step"] > 5]
    return {n: [e[n] for e in steps] for n in names}


def train_pair(build, tmp, model, flags):
    """Two independent single-threaded trainers at the same time (no exchange): what two cores give
    two workers that share nothing but the machine. Returns the sum of their samples/s and the
    median of their median step times."""
    env = single_thread_env()
    procs, paths = [], []
    for i in range(2):
        path = os.path.join(tmp, f"pair{i}.jsonl")
        if os.path.exists(path):
            os.remove(path)
        paths.append(path)
        cmd = [os.path.join(build, "cohort"), "train", "--model", model, "--data", "fashion-mnist", "--threads", "1",
               "--optimizer", "momentum", "--lr", "0.01", "--progress", "off", "--metrics", path,
               "--seed", str(i + 1)] + flags
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    wait_all(procs, "two independent trainers")
    rate = sum(done_event(p)["samples_per_s"] for p in paths)
    step = median([median(step_fields(tmp, ["step_s"], os.path.basename(p))["step_s"]) for p in paths])
    return {"samples_per_s": rate}, 1000 * step


BREAKDOWN = ["handoff", "forward", "backward", "copy", "sum", "optimizer", "wait"]


def section_mirrored(args, tmp):
    steps = ["--steps", str(STEPS_CNN)]
    # (name, processes, flags, intra-op threads); processes 0: two independent trainers at once.
    configs = [
        ("mirrored R=2, batch 128", 1, ["--strategy", "mirrored", "--replicas", "2", "--batch", "128"], "1"),
        ("mirrored R=2 balanced, batch 128", 1,
         ["--strategy", "mirrored", "--replicas", "2", "--batch", "128", "--balance-shards"], "1"),
        ("allreduce 2 processes, batch 64 each", 2, ["--strategy", "allreduce", "--batch", "64"], "1"),
        ("1 process, 2 intra-op threads, batch 128", 1, ["--batch", "128"], "2"),
        ("1 process, 1 thread, batch 64", 1, ["--batch", "64"], "1"),
        ("2 independent 1-thread processes at once, batch 64 each", 0, ["--batch", "64"], "1"),
        ("mirrored R=1, batch 64", 1, ["--strategy", "mirrored", "--replicas", "1", "--batch", "64"], "1"),
    ]
    if args.mirrored_only:
        configs = [c for c in configs if c[0].split(",")[0] in args.mirrored_only.split(";")]
    rates = {name: [] for name, _, _, _ in configs}
    step_ms = {name: [] for name, _, _, _ in configs}
    parts = {name: {b: [] for b in BREAKDOWN} for name, _, _, _ in configs}  # per run: median ms per step
    largest = {name: [] for name, _, _, _ in configs}  # --balance-shards: per run, the median largest shard
    for i in range(args.runs):
        for name, workers, flags, threads in configs:
            if workers == 0:
                d, ms = train_pair(args.build, tmp, "cnn", steps + flags)
            else:
                d = train(args.build, tmp, workers, "cnn", steps + flags, threads)
                ms = step_median_ms(tmp)
                if "replica_wait_s" in d:
                    fields = step_fields(tmp, [f"replica_{b}_s" for b in BREAKDOWN])
                    for b in BREAKDOWN:
                        parts[name][b].append(1000 * median(fields[f"replica_{b}_s"]))
                if "--balance-shards" in flags:
                    largest[name].append(median(step_fields(tmp, ["replica_largest_shard"])["replica_largest_shard"]))
            rates[name].append(d["samples_per_s"])
            step_ms[name].append(ms)
        print(f"  run {i + 1}: " + ", ".join(f"{n.split(',')[0]} {rates[n][-1]:.1f}" for n, _, _, _ in configs),
              flush=True)
    m = {n: median(v) for n, v in rates.items()}
    spread = {n: (min(v), max(v)) for n, v in rates.items()}
    for n in m:
        print(f"cnn {n}: median {m[n]:.1f} samples/s (min {spread[n][0]:.1f}, max {spread[n][1]:.1f}); median step "
              f"{median(step_ms[n]):.2f} ms", flush=True)
        if parts[n]["wait"]:
            print("    per replica, median ms per step: " +
                  ", ".join(f"{b} {median(parts[n][b]):.2f}" for b in BREAKDOWN) +
                  f"; total {sum(median(parts[n][b]) for b in BREAKDOWN):.2f}", flush=True)
        if largest[n]:
            print(f"    largest shard, median per run: {', '.join(str(v) for v in largest[n])}", flush=True)
    names = [c[0] for c in configs]
    if len(names) == 7:
        mirrored, balanced, allreduce, intra, single, pair, _ = (m[n] for n in names)
        for label, rate in (("mirrored", mirrored), ("mirrored balanced", balanced)):
            print(f"{label} / (2 x single-threaded worker) = {rate / (2 * single):.3f}; {label} / allreduce = "
                  f"{rate / allreduce:.3f}x; {label} / 2 intra-op threads = {rate / intra:.3f}x; {label} / 2 "
                  f"independent trainers = {rate / pair:.3f}", flush=True)
        print(f"2 independent trainers / (2 x single) = {pair / (2 * single):.3f}", flush=True)


def section_hogwild(args, tmp):
    epochs = ["--epochs", str(args.epochs)]
    configs = [
        ("hogwild R=2, batch 128", 1, ["--strategy", "hogwild", "--replicas", "2", "--batch", "128"], 0),
        ("mirrored R=2, batch 128", 1, ["--strategy", "mirrored", "--replicas", "2", "--batch", "128"], 0),
        ("ps async, 2 workers x batch 64, 1 shard", 2, ["--strategy", "ps", "--ps-mode", "async", "--batch", "64"], 1),
    ]
    results = {name: [] for name, _, _, _ in configs}
    for r in range(args.runs):  # the configurations alternate run by run
        for name, workers, flags, ps in configs:
            d = train(args.build, tmp, workers, "mlp", epochs + flags, ps=ps)
            results[name].append((d["samples_per_s"], d["test_accuracy"], d.get("staleness_mean", 0.0)))
            print(f"  run {r + 1}, {name}: {d['samples_per_s']:.1f} samples/s, test accuracy "
                  f"{d['test_accuracy']:.4f}", flush=True)
    for name, rows in results.items():
        rates = [x[0] for x in rows]
        print(f"mlp {args.epochs} epoch(s), {name}: {median(rates):.1f} samples/s (min {min(rates):.1f}, max "
              f"{max(rates):.1f}), test accuracy {median([x[1] for x in rows]):.4f} (min "
              f"{min(x[1] for x in rows):.4f}, max {max(x[1] for x in rows):.4f}), mean staleness "
              f"{median([x[2] for x in rows]):.3f}", flush=True)


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
    p.add_argument("--epochs", type=int, default=2, help="hogwild section: epochs of the mlp")
    p.add_argument("--mirrored-only", default="",
                   help="mirrored section: only these configurations, by the name before the comma, ';'-separated "
                        "(e.g. 'mirrored R=2;1 process')")
    args = p.parse_args()
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for section in args.sections.split(","):
            print(f"== {section}", flush=True)
            globals()[f"section_{section}"](args, tmp)


if __name__ == "__main__":
    main()
