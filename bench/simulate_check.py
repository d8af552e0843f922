#!/usr/bin/env python3
"""`cohort simulate` against emulated clusters: real cohort jobs in network namespaces joined by
`tc tbf`-limited links (bench/bandwidth.py's set-up), each beside the simulator's prediction for
the same configuration.

    .venv/bin/python bench/simulate_check.py [--build build] [--rates 100mbit,1gbit] [--workers 2,3,4] [--steps 30]
                                    [--calibration FILE] [--runs 1] [--configs ar,ar-thr,ps1,ps2]
                                    [--ps-lr LR] [--keep DIR]                # as root

First `cohort simulate --calibrate` measures this machine (model cnn, batch 64, 1 thread; the
compute of ranks sharing the cores from its own short allreduce jobs over loopback, never from the
jobs below), unless --calibration names a file. Then, at each rate, for each worker count N: allreduce with --codec
none and threshold:0.001, ps async with 1 and 2 shards. Every process (workers and shards) has its
own namespace and a full-duplex link of the rate to a bridge; all of them share this machine's
cores, which the simulator is told (--cores = the machine's cores). The table lists every pair
(measured samples/s, predicted, error = predicted / measured - 1, the chief's bytes sent per step
measured and predicted in MB, whether the prediction is CPU-bound) and the median and largest
absolute error. --configs runs a subset (ar: allreduce none, ar-thr: threshold:0.001, ps1, ps2: ps
async with 1 and 2 shards); --ps-lr sets the ps jobs' learning rate (asynchronous workers diverge
at train's default with 4 of them; the prediction does not depend on it); --keep DIR keeps each
job's metrics file. For each pair a second line compares the real chief's steady steps (medians of
step_s, compute_s, comm_wait_s and, for ps, the shard's server_wait_s) with the predicted split.
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

CONFIGS = {"ar": ("allreduce", "none", 0), "ar-thr": ("allreduce", "threshold:0.001", 0), "ps1": ("ps", "none", 1),
           "ps2": ("ps", "none", 2)}
WARMUP = 5  # the trainer's steady state starts after this many steps


# One TCP bulk transfer through the emulated links, timed by the receiver from its first byte to its
# last: what a flow achieves against the nominal rate (--link-probe).
RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = int(sys.argv[2]); got = 0; first = None
while got < n:
    b = c.recv(1 << 20)
    if not b: break
    if first is None: first = time.perf_counter()
    got += len(b)
print(got, time.perf_counter() - first, flush=True)
"""
SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); n = int(sys.argv[3]); block = b"x" * (1 << 20)
while n > 0:
    c.sendall(block[:min(n, len(block))]); n -= len(block)
c.shutdown(socket.SHUT_WR); c.recv(1)
"""


def link_probe(pairs, megabytes):
    """Concurrent bulk transfers, one per (from, to) namespace index; returns each one's Mbit/s."""
    n = int(megabytes * 1e6)
    receivers = []
    for i, (src, dst) in enumerate(pairs):
        r = subprocess.Popen(["ip", "netns", "exec", ns_name(dst), sys.executable, "-c", RECEIVER, str(5300 + i),
                              str(n)], stdout=subprocess.PIPE, text=True)
        r.stdout.readline()
        receivers.append(r)
    senders = [subprocess.Popen(["ip", "netns", "exec", ns_name(src), sys.executable, "-c", SENDER,
                                 f"10.77.0.{dst + 1}", str(5300 + i), str(n)])
               for i, (src, dst) in enumerate(pairs)]
    rates = []
    for r in receivers:
        got, seconds = r.stdout.readline().split()
        rates.append(int(got) * 8 / float(seconds) / 1e6)
        r.wait(timeout=120)
    for snd in senders:
        snd.kill()
        snd.wait()
    return rates


def chief_split(metrics):
    """Medians over the chief's steady steps: step_s, compute_s, comm_wait_s, server_wait_s."""
    steps = []
    with open(metrics) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "step" and e.get("step", 0) > WARMUP:
                steps.append(e)
    return {k: median([e.get(k, 0.0) for e in steps]) if steps else 0.0
            for k in ("step_s", "compute_s", "comm_wait_s", "server_wait_s")}


def train_flags(args, metrics):
    return [os.path.join(args.build, "cohort"), "train", "--model", "cnn", "--data", "fashion-mnist", "--batch", "64",
            "--threads", "1", "--steps", str(args.steps), "--progress", "off", "--timeout", "300",
            "--metrics", metrics]


def run_job(args, tmp, scheme, codec, workers, shards, rate):
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
            if args.ps_lr:
                cmd += ["--lr", args.ps_lr]
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns_name(ns)] + cmd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    # One deadline for the whole job: its processes wait on each other.
    wait_all(procs, f"{scheme} --codec {codec} x{workers}", timeout=args.job_timeout, shared_deadline=True)
    done = done_event(metrics)
    split = chief_split(metrics)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        name = f"{rate}-{scheme}-{codec.replace(':', '')}-{shards}shards-{workers}w.jsonl"
        with open(metrics) as f, open(os.path.join(args.keep, name), "w") as out:
            out.write(f.read())
    return done["samples_per_s"], done["bytes_sent"] / max(1, done["steps"]), split


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


def report(args, m):
    """One measured job (a dict) beside its prediction: the table row and the split line."""
    row = predict(args, m["scheme"], m["codec"], m["workers"], m["shards"], m["rate"])
    predicted = row["samples_per_s"]
    error = predicted / m["measured"] - 1
    name = f"{m['scheme']} {m['codec']}" + (f" {m['shards']} shard{'s' if m['shards'] > 1 else ''}" if m["shards"] else "")
    # The chief's bytes sent per step, measured (its counters) and predicted, and whether the
    # prediction is CPU-bound (--cores): for reading the misses.
    print(f"| {m['rate']} | {name} | {m['workers']} | {m['measured']:.1f} | {predicted:.1f} | {error * 100:+.1f} % "
          f"| {m['sent'] / 1e6:.3f} | {row['bytes_per_step'] / 1e6:.3f} "
          f"| {'yes' if row['cpu_bound'] else 'no'} |", flush=True)
    split = m["split"]
    print(f"  split (s per chief step): real step {split['step_s']:.4f} compute "
          f"{split['compute_s']:.4f} comm_wait {split['comm_wait_s']:.4f} server_wait "
          f"{split['server_wait_s']:.4f}; predicted step {row['step_s']:.4f} compute "
          f"{row['compute_s']:.4f} comm {row['comm_s']:.4f} wait {row['wait_s']:.4f} "
          f"server {row['server_s']:.4f}", flush=True)
    return error


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--workers", default="2,3,4")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--calibration", default="")
    p.add_argument("--configs", default="ar,ar-thr,ps1,ps2")
    p.add_argument("--ps-lr", default="")
    p.add_argument("--keep", default="")
    p.add_argument("--job-timeout", type=float, default=900, help="seconds before a job's processes are killed")
    p.add_argument("--results", default="", help="append each measured job to this JSON-lines file")
    p.add_argument("--repredict", default="",
                   help="run no job: the measurements in this --results file beside the current predictions "
                        "(needs --calibration)")
    p.add_argument("--link-probe", type=float, default=0,
                   help="first time a bulk TCP transfer of this many MB through the links at each rate: "
                        "one way, both ways at once (a ring's link), two senders into one (a shard's)")
    args = p.parse_args()
    if args.repredict:
        if not args.calibration:
            sys.exit("--repredict needs --calibration FILE (the one the jobs were measured with)")
        with open(args.repredict) as f:
            errors = sorted(abs(report(args, json.loads(line))) for line in f if line.strip())
        print(f"pairs: {len(errors)}; |error| median {median(errors) * 100:.1f} %, max {max(errors) * 100:.1f} %")
        return
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
    errors = []
    try:
        create(n)
        with tempfile.TemporaryDirectory() as tmp:
            for rate in args.rates.split(","):
                set_rate(n, rate)
                if args.link_probe > 0:
                    one = link_probe([(0, 1)], args.link_probe)
                    both = link_probe([(0, 1), (1, 0)], args.link_probe)
                    into = link_probe([(0, 2), (1, 2)], args.link_probe)
                    print(f"link {rate}: one flow {one[0]:.1f} Mbit/s; both ways at once "
                          f"{' / '.join(f'{x:.1f}' for x in both)}; two into one "
                          f"{' / '.join(f'{x:.1f}' for x in into)} Mbit/s of payload", flush=True)
                for workers in counts:
                    for scheme, codec, shards in [CONFIGS[c] for c in args.configs.split(",")]:
                        try:
                            runs = [run_job(args, tmp, scheme, codec, workers, shards, rate) for _ in range(args.runs)]
                            runs.sort(key=lambda r: r[0])
                            m = {"rate": rate, "scheme": scheme, "codec": codec, "shards": shards, "workers": workers,
                                 "measured": median([r[0] for r in runs]), "runs": [r[0] for r in runs],
                                 "sent": median([r[1] for r in runs]), "split": runs[len(runs) // 2][2],
                                 "lr": args.ps_lr if scheme == "ps" else ""}
                            if args.results:
                                with open(args.results, "a") as f:
                                    f.write(json.dumps(m) + "\n")
                            errors.append(abs(report(args, m)))
                        except (RuntimeError, subprocess.CalledProcessError) as e:
                            print(f"FAILED {rate} {scheme} {codec} {shards} x{workers}: {str(e)[-2000:]}", flush=True)
    finally:
        destroy(n)
        if tmp_cal:
            os.remove(tmp_cal)
    errors.sort()
    if errors:
        print(f"pairs: {len(errors)}; |error| median {median(errors) * 100:.1f} %, max {max(errors) * 100:.1f} %")


if __name__ == "__main__":
    main()
