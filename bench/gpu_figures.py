#!/usr/bin/env python3
"""cohort on a CUDA GPU against PyTorch on the same GPU, side by side (scripts/gpu-check.sh runs it).

    python3 bench/gpu_figures.py --cohort COHORT [--runs 2] [--budget 200] [--sections single,ws1,ddp2]

single: cohort train --device cuda against the same loop in PyTorch (bench/pytorch_single.py), cnn
        and mlp, Fashion-MNIST, batch 64, momentum SGD: samples/s in steady state.
ws1:    cohort --strategy allreduce at world size 1 (DataParallel's buckets and hooks on the GPU)
        against --strategy local, cnn: samples/s and peak GPU memory.
resnet: the ResNet of examples/library (resnet_ddp.cpp, a user's own loop with cohort's handles) alone
        on the GPU against its Python twin (bench/resnet_ddp.py) alone, batch 32: samples/s.
streams: where a step's time goes, per CUDA stream and CPU thread: one run each of --strategy
        allreduce at world size 1 and --strategy local, cnn, with --profile over 10 steps of the
        steady state (the PyTorch profiler: each stream's busy time per step, its top kernel).
ddp2:   2 ranks sharing cuda:0: cohort --strategy allreduce against PyTorch DDP (gloo over CUDA
        tensors, bench/pytorch_ddp.py), cnn and mlp: samples/s over both ranks.
autocast: (not in the default set) single's pair with both loops under autocast in bfloat16
        (cohort train --autocast bf16, torch.autocast), cnn and mlp; and resnet's, with --resnet.

Runs alternate cohort / the comparison so that noise hits both; prints each run, the medians, the
ratio of medians and the per-pair ratios. Stops starting runs once --budget seconds have passed,
and says so (a figure with fewer runs than asked is marked).
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, single_thread_env  # noqa: E402

STEPS = {"mlp": 3000, "cnn": 1500}
DEADLINE = [float("inf")]
DEVICE = ["cuda"]


RUN_TIMEOUT_S = 90


def out_of_time():
    return time.time() > DEADLINE[0]


def run(cmd):
    """Runs cmd in a process group of its own, at most RUN_TIMEOUT_S seconds; on a failure or past the
    limit, the whole group is killed (the ranks of a launch too) and RuntimeError names the command
    and the end of its output."""
    proc = subprocess.Popen(cmd, env=single_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise RuntimeError(f"{' '.join(cmd)}: still running after {RUN_TIMEOUT_S} s, killed; its output ended:\n"
                           f"{out[-1500:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-1500:]}")
    return out


def cohort_train(binary, tmp, model, steps, flags, workers=0):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [binary, "train", "--model", model, "--data", "fashion-mnist", "--steps", str(steps), "--batch", "64",
           "--threads", "1", "--optimizer", "momentum", "--lr", "0.01", "--progress", "off", "--device", DEVICE[0],
           "--timeout", "60", "--metrics", metrics] + flags
    if workers > 0:  # under cohort launch (a cluster of that many ranks)
        cmd = [binary, "launch", "-n", str(workers), "--"] + cmd
    run(cmd)
    return done_event(metrics)


def profiled(binary, tmp, label, flags):
    """One cnn run with --profile over steps 101..110: prints its lanes (busy ms per step)."""
    trace = os.path.join(tmp, f"{label}.trace.json")
    metrics = os.path.join(tmp, "p.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run([binary, "train", "--model", "cnn", "--data", "fashion-mnist", "--steps", "120", "--batch", "64",
         "--threads", "1", "--optimizer", "momentum", "--lr", "0.01", "--progress", "off", "--device", DEVICE[0],
         "--timeout", "60", "--metrics", metrics, "--profile", trace, "--profile-steps", "101:110"] + flags)
    with open(metrics) as f:
        lanes = [e for e in (json.loads(line) for line in f) if e.get("event") == "profile"]
    if not lanes:
        print(f"  streams, {label}: no profile event", flush=True)
        return
    steps = lanes[0]["steps"]
    print(f"  streams, {label}: {steps} steps, {lanes[0]['window_s'] * 1e3 / steps:.3f} ms each", flush=True)
    for lane in lanes:
        top = f"; most: {lane['top'][:60]} {lane['top_s'] * 1e3 / steps:.3f} ms/step" if "top" in lane else ""
        print(f"    {lane['lane']:<24} busy {lane['busy_s'] * 1e3 / steps:8.3f} ms/step, "
              f"{lane['events'] // steps} events/step{top}", flush=True)


def pytorch_single(model, steps, autocast="off"):
    out = run([sys.executable, os.path.join(ROOT, "bench", "pytorch_single.py"), "--model", model, "--steps",
               str(steps), "--threads", "1", "--device", DEVICE[0], "--autocast", autocast])
    return json.loads(out.strip().splitlines()[-1])["samples_per_s"]


def pytorch_ddp(binary, model, steps):
    out = run([binary, "launch", "-n", "2", "--", sys.executable,
               os.path.join(ROOT, "bench", "pytorch_ddp.py"), "--model", model, "--steps", str(steps), "--device", DEVICE[0]])
    for line in out.splitlines():
        if "samples_per_s" in line:
            return json.loads(line.split("] ", 1)[-1])["samples_per_s"]
    raise RuntimeError(out)


def resnet_cohort(binary, steps, autocast="off"):
    out = run([binary, "--steps", str(steps), "--batch", "32", "--autocast", autocast])
    m = re.search(r"([0-9.]+) samples/s", out)
    if not m:
        raise RuntimeError(out[-1500:])
    return float(m.group(1))


def resnet_pytorch(steps, autocast="off"):
    out = run([sys.executable, os.path.join(ROOT, "bench", "resnet_ddp.py"), "--steps", str(steps), "--batch", "32",
               "--device", DEVICE[0], "--autocast", autocast])
    return json.loads(out.strip().splitlines()[-1])["samples_per_s"]


def compare(name, runs, ours_fn, theirs_fn, ours_label, theirs_label):
    ours, theirs = [], []
    for i in range(runs):
        if out_of_time():
            print(f"  {name}: out of time after {i} run(s) of {runs}", flush=True)
            break
        try:
            a = ours_fn()
        except RuntimeError as e:
            print(f"  {name} run {i + 1}: {ours_label} failed: {e}", flush=True)
            return
        try:
            b = theirs_fn()
        except RuntimeError as e:
            print(f"  {name} run {i + 1}: {theirs_label} failed: {e}", flush=True)
            return
        ours.append(a)
        theirs.append(b)
        print(f"  {name} run {i + 1}: {ours_label} {ours[-1]:10.1f}  {theirs_label} {theirs[-1]:10.1f}", flush=True)
    if not ours:
        print(f"{name}: no run finished", flush=True)
        return
    ratios = sorted(a / b for a, b in zip(ours, theirs))
    print(f"{name}: {ours_label} median {median(ours):.1f}, {theirs_label} median {median(theirs):.1f}; ratio of "
          f"medians {median(ours) / median(theirs):.3f}x (per-pair {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"{len(ours)} runs)", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cohort", required=True, help="the cohort binary (or a wrapper that starts it)")
    p.add_argument("--resnet", help="the ResNet example's binary (bench/resnet_ddp), for the resnet section")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--budget", type=float, default=200, help="seconds after which no new run starts")
    p.add_argument("--sections", default="single,resnet,ws1,streams,ddp2")
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--device", default="cuda", help="cuda (the figures); cpu to try the script where there is none")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every run's steps")
    args = p.parse_args()
    DEADLINE[0] = time.time() + args.budget
    DEVICE[0] = args.device
    for k in STEPS:
        STEPS[k] = max(20, int(STEPS[k] * args.scale))
    binary = args.cohort
    models = args.models.split(",")
    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for section in args.sections.split(","):
            if section == "single":
                for m in models:
                    compare(f"single {m} (samples/s)", args.runs,
                            lambda: cohort_train(binary, tmp, m, STEPS[m], [])["samples_per_s"],
                            lambda: pytorch_single(m, STEPS[m]), "cohort", "PyTorch")
            elif section == "autocast":
                for m in models:
                    compare(f"autocast bf16, {m} (samples/s)", args.runs,
                            lambda: cohort_train(binary, tmp, m, STEPS[m], ["--autocast", "bf16"])["samples_per_s"],
                            lambda: pytorch_single(m, STEPS[m], "bf16"), "cohort", "PyTorch")
                if args.resnet:
                    steps = max(20, int(400 * args.scale))
                    compare("autocast bf16, resnet example alone (samples/s)", args.runs,
                            lambda: resnet_cohort(args.resnet, steps, "bf16"), lambda: resnet_pytorch(steps, "bf16"),
                            "cohort", "PyTorch")
            elif section == "resnet":
                if not args.resnet:
                    print("resnet: skipped, no --resnet binary given", flush=True)
                    continue
                steps = max(20, int(400 * args.scale))
                compare("resnet example alone (samples/s)", args.runs, lambda: resnet_cohort(args.resnet, steps),
                        lambda: resnet_pytorch(steps), "cohort", "PyTorch")
            elif section == "ws1":
                peaks = {}

                def with_peak(label, flags):
                    d = cohort_train(binary, tmp, "cnn", STEPS["cnn"], flags)
                    peaks.setdefault(label, []).append(d.get("cuda_peak_bytes", float("nan")))
                    return d["samples_per_s"]

                compare("world size 1, cnn (samples/s)", args.runs,
                        lambda: with_peak("allreduce", ["--strategy", "allreduce"]),
                        lambda: with_peak("local", ["--strategy", "local"]), "allreduce", "local")
                for label, v in peaks.items():
                    print(f"  peak GPU memory, {label}: median {median(v) / 1e6:.2f} MB", flush=True)
            elif section == "streams":
                for label, flags in (("allreduce", ["--strategy", "allreduce"]), ("local", ["--strategy", "local"])):
                    if out_of_time():
                        print(f"  streams, {label}: out of time", flush=True)
                        break
                    try:
                        profiled(binary, tmp, label, flags)
                    except RuntimeError as e:
                        print(f"  streams, {label} failed: {e}", flush=True)
            elif section == "ddp2":
                for m in models:
                    compare(f"2 ranks on cuda:0, {m} (samples/s)", args.runs,
                            lambda: cohort_train(binary, tmp, m, STEPS[m] // 2, ["--strategy", "allreduce"],
                                                 workers=2)["samples_per_s"],
                            lambda: pytorch_ddp(binary, m, STEPS[m] // 2), "cohort", "DDP")
            else:
                raise SystemExit(f"unknown section {section}: expected single, resnet, ws1, streams, ddp2 or autocast")


if __name__ == "__main__":
    main()
