#!/usr/bin/env python3
"""Synchronous data parallelism: cohort's allreduce and average against PyTorch DDP, side by side.

    .venv/bin/python bench/dataparallel.py [--build build] [--runs 5] [--sections ddp,overlap,average,bandwidth]

ddp:       cohort --strategy allreduce vs PyTorch DDP (gloo), 2 workers x 1 thread, batch 64 per
           worker, mlp and cnn, alternating runs; plus cohort's 1-worker 1-thread rate, whose
           double is the linear limit.
overlap:   cnn, allreduce with overlap on and off and a bucket-size sweep: samples/s and the time
           each step waits on communication.
average:   mlp, 2 epochs: average --period 1, 4, 16 against allreduce: samples/s, test accuracy.
bandwidth: raw allreduce of 4 MB and 64 MB: cohort's Communicator vs torch.distributed (gloo).
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, run, single_thread_env  # noqa: E402

STEPS = {"mlp": 400, "cnn": 120}


def cohort_train(build, tmp, workers, model, steps, flags):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [os.path.join(build, "cohort"), "train", "--model", model, "--data", "fashion-mnist", "--batch", "64",
           "--threads", "1", "--optimizer", "momentum", "--lr", "0.01", "--progress", "off", "--metrics", metrics]
    cmd += ["--steps", str(steps)] if steps else []
    cmd += flags
    if workers > 1:
        cmd = [os.path.join(build, "cohort"), "launch", "-n", str(workers), "--"] + cmd
    run(cmd, env=single_thread_env())
    steps_waits = []
    with open(metrics) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "step" and e["step"] > 5:
                steps_waits.append((e["step_s"], e["comm_wait_s"], e["bytes_sent"]))
    done = done_event(metrics)
    n = max(len(steps_waits), 1)
    done["mean_step_ms"] = 1000 * sum(s for s, _, _ in steps_waits) / n
    done["mean_wait_ms"] = 1000 * sum(w for _, w, _ in steps_waits) / n
    done["bytes_per_step"] = sum(b for _, _, b in steps_waits) / n
    return done


def ddp_rate(build, model, steps):
    proc, _ = run([os.path.join(build, "cohort"), "launch", "-n", "2", "--", sys.executable,
                   os.path.join(ROOT, "bench", "pytorch_ddp.py"), "--model", model, "--steps", str(steps)],
                  env=single_thread_env())
    for line in proc.stdout.splitlines():
        if "samples_per_s" in line:
            return json.loads(line.split("] ", 1)[-1])["samples_per_s"]
    raise RuntimeError(proc.stdout)


def section_ddp(args, tmp):
    for model in ["mlp", "cnn"]:
        steps = STEPS[model]
        ours, ddp, single = [], [], []
        for i in range(args.runs):
            ours.append(cohort_train(args.build, tmp, 2, model, steps, ["--strategy", "allreduce"])["samples_per_s"])
            ddp.append(ddp_rate(args.build, model, steps))
            single.append(cohort_train(args.build, tmp, 1, model, steps, [])["samples_per_s"])
            print(f"  {model} run {i + 1}: cohort allreduce {ours[-1]:8.1f}  DDP {ddp[-1]:8.1f}  "
                  f"cohort 1 worker {single[-1]:8.1f} samples/s", flush=True)
        print(f"{model}: cohort allreduce {median(ours):.1f}, DDP {median(ddp):.1f}, 1 worker {median(single):.1f} "
              f"samples/s; cohort/DDP {median(ours) / median(ddp):.3f}x; of the linear limit (2x 1 worker) "
              f"{median(ours) / (2 * median(single)):.3f}", flush=True)


def section_overlap(args, tmp):
    configs = [("overlap, 25 MB buckets", ["--bucket-mb", "25"]),
               ("no overlap, 25 MB buckets", ["--bucket-mb", "25", "--no-overlap"]),
               ("overlap, 0.25 MB buckets", ["--bucket-mb", "0.25", "--first-bucket-mb", "0.25"]),
               ("overlap, 1 MB buckets", ["--bucket-mb", "1"]),
               ("overlap, 4 MB buckets", ["--bucket-mb", "4"])]
    results = {name: [] for name, _ in configs}
    for i in range(args.runs):
        for name, flags in configs:
            results[name].append(cohort_train(args.build, tmp, 2, "cnn", STEPS["cnn"], ["--strategy", "allreduce"] + flags))
    for name, _ in configs:
        r = results[name]
        print(f"cnn {name}: {median([d['samples_per_s'] for d in r]):.1f} samples/s, step "
              f"{median([d['mean_step_ms'] for d in r]):.1f} ms, waiting on communication "
              f"{median([d['mean_wait_ms'] for d in r]):.2f} ms/step, {median([d['bytes_per_step'] for d in r]) / 1e6:.2f} "
              f"MB sent/step", flush=True)


def section_average(args, tmp):
    configs = [("allreduce", ["--strategy", "allreduce"])] + [
        (f"average --period {k}", ["--strategy", "average", "--period", str(k)]) for k in (1, 4, 16)]
    for name, flags in configs:
        rates, accs, sent = [], [], []
        for _ in range(max(1, args.runs // 2)):
            d = cohort_train(args.build, tmp, 2, "mlp", 0, ["--epochs", "2"] + flags)
            rates.append(d["samples_per_s"])
            accs.append(d["test_accuracy"])
            sent.append(d["bytes_sent"])
        print(f"mlp 2 epochs, {name}: {median(rates):.1f} samples/s, test accuracy {median(accs):.4f}, "
              f"{median(sent) / 1e6:.1f} MB sent by the chief", flush=True)


def section_bandwidth(args, tmp):
    sizes = ["4", "64"]
    ours = {s: [] for s in sizes}
    theirs = {s: [] for s in sizes}
    launch = [os.path.join(args.build, "cohort"), "launch", "-n", "2", "--"]
    for _ in range(args.runs):
        proc, _ = run(launch + [os.path.join(args.build, "bench", "allreduce_bandwidth")] + sizes, env=single_thread_env())
        for line in proc.stdout.splitlines():
            if "gb_per_s" in line:
                j = json.loads(line.split("] ", 1)[-1])
                ours[f"{j['mb']:g}"].append(j["gb_per_s"])
        proc, _ = run(launch + [sys.executable, os.path.join(ROOT, "bench", "pytorch_allreduce.py")] + sizes,
                      env=single_thread_env())
        for line in proc.stdout.splitlines():
            if "gb_per_s" in line:
                j = json.loads(line.split("] ", 1)[-1])
                theirs[f"{j['mb']:g}"].append(j["gb_per_s"])
    for s in sizes:
        print(f"allreduce {s} MB, 2 ranks: cohort {median(ours[s]):.3f} GB/s, torch.distributed "
              f"{median(theirs[s]):.3f} GB/s, ratio {median(ours[s]) / median(theirs[s]):.3f}x", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--sections", default="ddp,overlap,average,bandwidth")
    args = p.parse_args()
    print(f"machine: {machine()}")
    sections = {"ddp": section_ddp, "overlap": section_overlap, "average": section_average,
                "bandwidth": section_bandwidth}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections.split(","):
            sections[name](args, tmp)


if __name__ == "__main__":
    main()
