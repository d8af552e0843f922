#!/usr/bin/env python3
"""Bandwidth saturation, emulated: workers in network namespaces joined by links that `tc tbf` limits.

    sudo .venv/bin/python bench/bandwidth.py [--build build] [--runs 1] [--steps 30] [--rates 100mbit,1gbit,unlimited]
                                             [--schemes allreduce,ps] [--codecs none,fp16]

The script creates its own namespaces (root needed; they are removed at the end, also on error):
one per process, each with an `eth0` veth whose other end sits on a bridge in a hub namespace.
Both ends of every veth get `tbf rate R` (netem is not available on these kernels; tbf is), so
every process has a full-duplex link of R to the switch. Workers run with RANK/WORLD_SIZE/
MASTER_ADDR on 10.77.0.x and GLOO_SOCKET_IFNAME=eth0; the ps job with a TF_CONFIG (chief, worker,
one shard, each in its own namespace).

Measured: samples/s (cohort's steady-state figure from the chief's done event) of the cnn on
Fashion-MNIST, 2 workers x 1 thread, batch 64, for allreduce with --codec none / fp16 /
threshold:0.001 and ps async with --codec none / threshold:0.001 (pushes are compressed; the pulled
parameters are not), at each rate. Ratios are against `none` of the same scheme and rate. The runs of
one rate alternate between the configurations; each row gives the median over the runs and, in
parentheses, the lowest and highest run, and the ratio of the medians with the lowest and highest
ratio of one run to the median of `none`. For allreduce, the chief's median step breaks down into
backward_s (with the end-of-backward wait), comm_wait_s, and the codec's communication thread
(encode_s, wire_s, decode_s), from its step events after step 10.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, wait_all  # noqa: E402

TAG = f"cbw{os.getpid() % 100000}"
HUB = f"{TAG}-hub"
SCHEMES = [("allreduce", "none"), ("allreduce", "fp16"), ("allreduce", "threshold:0.001"),
           ("ps", "none"), ("ps", "threshold:0.001")]
PHASES = ["step_s", "backward_s", "comm_wait_s", "encode_s", "wire_s", "decode_s"]


def sh(*cmd, check=True):
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def ns_name(i):
    return f"{TAG}-{i}"


def create(n):
    sh("ip", "netns", "add", HUB)
    sh("ip", "netns", "exec", HUB, "ip", "link", "add", "br0", "type", "bridge")
    sh("ip", "netns", "exec", HUB, "ip", "link", "set", "br0", "up")
    for i in range(n):
        ns = ns_name(i)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", f"{TAG}a{i}", "type", "veth", "peer", "name", f"{TAG}b{i}")
        sh("ip", "link", "set", f"{TAG}a{i}", "netns", ns)
        sh("ip", "link", "set", f"{TAG}b{i}", "netns", HUB)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", f"{TAG}a{i}", "name", "eth0")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"10.77.0.{i + 1}/24", "dev", "eth0")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", HUB, "ip", "link", "set", f"{TAG}b{i}", "master", "br0")
        sh("ip", "netns", "exec", HUB, "ip", "link", "set", f"{TAG}b{i}", "up")


def destroy(n):
    for i in range(n):
        sh("ip", "netns", "del", ns_name(i), check=False)
    sh("ip", "netns", "del", HUB, check=False)


def set_rate(n, rate):
    for i in range(n):
        for ns, dev in [(ns_name(i), "eth0"), (HUB, f"{TAG}b{i}")]:
            if rate == "unlimited":
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            else:
                burst = "1mb" if rate.endswith("gbit") else "128kb"
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", burst, "latency", "50ms")


def train_flags(args, metrics):
    return [os.path.join(args.build, "cohort"), "train", "--model", "cnn", "--data", "fashion-mnist", "--batch", "64",
            "--threads", "1", "--steps", str(args.steps), "--progress", "off", "--timeout", "300",
            "--metrics", metrics]


def run_job(args, tmp, scheme, codec):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    # The namespaces' addresses are not loopback: shards there need the job's secret.
    base = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
                COHORT_AUTH_TOKEN=os.urandom(16).hex())
    for k in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]:
        base.pop(k, None)
    procs = []
    if scheme == "allreduce":
        for r in range(2):
            env = dict(base, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="10.77.0.1", MASTER_PORT="29500")
            cmd = train_flags(args, metrics) + ["--strategy", "allreduce", "--codec", codec]
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns_name(r)] + cmd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    else:
        cluster = {"chief": ["10.77.0.1:29500"], "worker": ["10.77.0.2:29500"], "ps": ["10.77.0.3:2222"]}
        tasks = [("ps", 0, 2), ("chief", 0, 0), ("worker", 0, 1)]
        for kind, index, ns in tasks:
            env = dict(base, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}),
                       COHORT_AUTH_TOKEN="bandwidth-bench")
            cmd = train_flags(args, metrics) + ["--strategy", "ps", "--ps-mode", "async", "--codec", codec]
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns_name(ns)] + cmd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    wait_all(procs, f"{scheme} --codec {codec}")
    done = done_event(metrics)
    steps = []
    with open(metrics) as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "step" and event["step"] > 10:
                steps.append(event)
    done["phases"] = {k: statistics.median(e[k] for e in steps) for k in PHASES if steps and k in steps[0]}
    return done


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rates", default="100mbit,1gbit,unlimited")
    p.add_argument("--schemes", default="allreduce,ps", help="which schemes' rows to run")
    p.add_argument("--codecs", default=",".join(sorted({c for _, c in SCHEMES})),
                   help="which codecs' rows to run (none always runs: the ratios are against it)")
    args = p.parse_args()
    codecs = set(args.codecs.split(",")) | {"none"}
    schemes = [s for s in SCHEMES if s[0] in args.schemes.split(",") and s[1] in codecs]
    if not schemes:
        sys.exit(f"bench/bandwidth.py: --schemes {args.schemes} names none of allreduce, ps")
    if os.geteuid() != 0:
        sys.exit("bench/bandwidth.py needs root to create network namespaces (run it with sudo)")
    print(f"machine: {machine()}")
    print(f"cnn, 2 workers x 1 thread (ps: + 1 shard), batch 64, {args.steps} steps, median of {args.runs}", flush=True)
    n = 3
    try:
        create(n)
        with tempfile.TemporaryDirectory() as tmp:
            for rate in args.rates.split(","):
                set_rate(n, rate)
                results = {s: [] for s in schemes}
                for _ in range(args.runs):
                    for scheme, codec in schemes:
                        results[(scheme, codec)].append(run_job(args, tmp, scheme, codec))
                for scheme, codec in schemes:
                    r = results[(scheme, codec)]
                    rates = [d["samples_per_s"] for d in r]
                    rate_s = median(rates)
                    base = median([d["samples_per_s"] for d in results[(scheme, "none")]])
                    sent = median([d["bytes_sent"] / d["steps"] for d in r]) / 1e6
                    print(f"{rate:9s} {scheme:9s} --codec {codec:16s} {rate_s:8.1f} ({min(rates):.1f}-{max(rates):.1f}) "
                          f"samples/s  {rate_s / base:5.2f}x ({min(rates) / base:.2f}-{max(rates) / base:.2f}) none  "
                          f"{sent:7.3f} MB sent per chief step", flush=True)
                    phases = {k: median([d["phases"][k] for d in r]) for k in PHASES if k in r[0]["phases"]}
                    if scheme == "allreduce" and phases:
                        print("          median step ms: " + " ".join(f"{k}={1e3 * v:.2f}" for k, v in phases.items()),
                              flush=True)
    finally:
        destroy(n)


if __name__ == "__main__":
    main()
