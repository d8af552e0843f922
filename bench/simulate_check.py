#!/usr/bin/env python3
"""`cohort simulate` against emulated clusters: real cohort jobs in network namespaces joined by
`tc tbf`-limited links (bench/bandwidth.py's set-up), each beside the simulator's prediction for
the same configuration.

    /usr/bin/python3 bench/simulate_check.py [--build build] [--rates 100mbit,1gbit] [--workers 2,3,4] [--steps 30]
                                    [--calibration FILE] [--runs 1]          # as root

First `cohort simulate --calibrate` measures this machine (model cnn, batch 64, 1 thread), unless
--calibration names a file. Then, at each rate, for each worker count N: allreduce with --codec
none and threshold:0.001, ps async with 1 and 2 shards. Every process (workers and shards) has its
own namespace and a full-duplex link of the rate to a bridge; all of them share this machine's
cores, which the simulator is told (--cores = the machine's cores). The table lists every pair
(measured samples/s, predicted, error = predicted / measured - 1, the chief's bytes sent per step
measured and predicted in MB, whether the prediction is CPU-bound) and the median and largest
absolute error.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bandwidth import create, destroy, ns_name, set_rate  # noqa: E402
from common import ROOT, done_event, machine, median, wait_all  # noqa: E402

CONFIGS = [("allreduce", "none", 0), ("allreduce", "threshold:0.001", 0), ("ps", "none", 1), ("ps", "none", 2)]


def train_flags(args, metrics):
    return [os.path.join(args.build, "cohort"), "train", "--model", "cnn", "--data", "fashion-mnist", "--batch", "64",
            "--threads", "1", "--steps", str(args.steps), "--progress", "off", "--timeout", "300",
            "--metrics", metrics]


def run_job(args, tmp, scheme, codec, workers, shards):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    base = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0")
    for k in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]:
        base.pop(k, None)
    procs = []
    if scheme == "allreduce":
        for r in range(workers):
            env = dict(base, RANK=str(r), WORLD_SIZE=str(workers), MASTER_ADDR="10.77.0.1", MASTER_PORT="29500")
            cmd = train_flags(args, metrics) + ["--strategy", "allreduce", "--codec", codec]
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns_name(r)] + cmd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    else:
        cluster = {"chief": ["10.77.0.1:29500"],
                   "worker": [f"10.77.0.{i + 1}:29500" for i in range(1, workers)],
                   "ps": [f"10.77.0.{workers + s + 1}:2222" for s in range(shards)]}
        tasks = [("ps", s, workers + s) for s in range(shards)] + [("chief", 0, 0)] + \
                [("worker", i - 1, i) for i in range(1, workers)]
        for kind, index, ns in tasks:
            env = dict(base, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}),
                       COHORT_AUTH_TOKEN="simulate-check")
            cmd = train_flags(args, metrics) + ["--strategy", "ps", "--ps-mode", "async", "--codec", codec]
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns_name(ns)] + cmd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    wait_all(procs, f"{scheme} --codec {codec} x{workers}", timeout=900)
    done = done_event(metrics)
    return done["samples_per_s"], done["bytes_sent"] / max(1, done["steps"])


def predict(args, scheme, codec, workers, shards, rate):
    cmd = [os.path.join(args.build, "cohort"), "simulate", "--calibration", args.calibration, "--strategy", scheme,
           "--codec", codec, "--workers", str(workers), "--bandwidth", rate, "--cores", str(os.cpu_count()),
           "--batch", "64", "--steps", "100", "--json"]
    if scheme == "ps":
        cmd += ["--ps-mode", "async", "--shards", str(shards)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        row = json.loads(line)
        if row.get("workers") == workers:
            return row
    raise RuntimeError(f"no prediction for {workers} workers in:\n{out}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--workers", default="2,3,4")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--calibration", default="")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/simulate_check.py needs root to create network namespaces")
    print(f"machine: {machine()}", flush=True)
    tmp_cal = None
    if not args.calibration:
        tmp_cal = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        args.calibration = tmp_cal
        subprocess.run([os.path.join(args.build, "cohort"), "simulate", "--calibrate", "--model", "cnn", "--batch", "64",
                        "--calibration", args.calibration], check=True, capture_output=True, text=True)
    with open(args.calibration) as f:
        print("calibration:", f.read().replace("\n", " "), flush=True)
    counts = [int(w) for w in args.workers.split(",")]
    n = max(counts) + 2
    rows = []
    try:
        create(n)
        with tempfile.TemporaryDirectory() as tmp:
            for rate in args.rates.split(","):
                set_rate(n, rate)
                for workers in counts:
                    for scheme, codec, shards in CONFIGS:
                        try:
                            runs = [run_job(args, tmp, scheme, codec, workers, shards) for _ in range(args.runs)]
                            measured = median([r[0] for r in runs])
                            sent = median([r[1] for r in runs])
                            row = predict(args, scheme, codec, workers, shards, rate)
                            predicted = row["samples_per_s"]
                        except (RuntimeError, subprocess.CalledProcessError) as e:
                            print(f"FAILED {rate} {scheme} {codec} {shards} x{workers}: {str(e)[-2000:]}", flush=True)
                            continue
                        error = predicted / measured - 1
                        name = f"{scheme} {codec}" + (f" {shards} shard{'s' if shards > 1 else ''}" if shards else "")
                        rows.append((rate, name, workers, measured, predicted, error))
                        # The chief's bytes sent per step, measured (its counters) and predicted, and
                        # whether the prediction is CPU-bound (--cores): for reading the misses.
                        print(f"| {rate} | {name} | {workers} | {measured:.1f} | {predicted:.1f} | {error * 100:+.1f} % "
                              f"| {sent / 1e6:.3f} | {row['bytes_per_step'] / 1e6:.3f} "
                              f"| {'yes' if row['cpu_bound'] else 'no'} |", flush=True)
    finally:
        destroy(n)
        if tmp_cal:
            os.remove(tmp_cal)
    errors = sorted(abs(r[5]) for r in rows)
    print(f"pairs: {len(rows)}; |error| median {median(errors) * 100:.1f} %, max {max(errors) * 100:.1f} %")


if __name__ == "__main__":
    main()
