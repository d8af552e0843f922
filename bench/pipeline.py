#!/usr/bin/env python3
"""Model parallelism: the pipeline's bubble against theory, and pipeline / hybrid / allreduce side by side.

    .venv/bin/python bench/pipeline.py [--build build] [--runs 3] [--sections bubble,compare]
    .venv/bin/python bench/pipeline.py --sections fixed --before DIR [--ms 1,2,4,8] [--auto]
        [--before-partition auto] [--partition auto|split|L1,L2,...]

bubble:  cnn on Fashion-MNIST, --stages 2, batch 64 cut into M = 1, 2, 4, 8, 16 micro-batches,
         both schedules: the measured bubble (each stage's time blocked waiting for an activation
         or a gradient, over its step time, averaged over the stages; steady state) next to the
         theory (S-1)/(M+S-1), and samples/s.
compare: cnn, the same global batch of 128 examples per step on the machine's 2 cores:
         allreduce (2 processes x 64), pipeline (2 stages, M = 4), hybrid (2 stages x 2 replicas x 64,
         M = 4: 4 processes on 2 cores, oversubscribed), and one process with 2 threads: samples/s,
         peak resident memory per process (the high-water mark, VmHWM) and the activations each
         stage holds at its peak (counted by the schedule). Every process has 1 thread.
fixed:   cnn, --stages 2 (1f1b, --partition auto), batch 256 cut into M micro-batches: bubble and
         samples/s of the binary in --build against the one in --before (another build directory,
         e.g. the base commit's), runs alternating between the two; with --auto, also
         --micro-batches auto in --build. Where each stage's step went (compute, idle, sends,
         optimizer) when the binary reports it, and the bubble expected from the stages' measured
         compute (bubble_fraction_expected: unequal stages included). --before-partition and
         --partition set the cut of each side (default auto for both): with --before and --build the
         same directory, the runs compare two cuts (e.g. auto against split) of one binary.
"""
import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, run, single_thread_env  # noqa: E402

STEPS = 80


def cohort_train(args, tmp, processes, flags, batch, threads=1, build=None, steps=STEPS):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cohort = os.path.join(build or args.build, "cohort")
    # /usr/bin/time reports each process's peak resident set (KiB) on stderr.
    cmd = ["/usr/bin/time", "-f", "maxrss_kib=%M", cohort, "train", "--model", "cnn", "--data", "fashion-mnist",
           "--batch", str(batch), "--threads", str(threads), "--optimizer", "momentum", "--lr", "0.01",
           "--progress", "off", "--steps", str(steps), "--metrics", metrics] + flags
    if processes > 1:
        cmd = [cohort, "launch", "-n", str(processes), "--"] + cmd
    proc, _ = run(cmd, env=single_thread_env())
    done = done_event(metrics)
    done["maxrss_mib"] = [int(k) / 1024 for k in re.findall(r"maxrss_kib=(\d+)", proc.stdout + proc.stderr)]
    return done


def section_bubble(args, tmp):
    for schedule in ["1f1b", "gpipe"]:
        for m in [1, 2, 4, 8, 16]:
            measured, rates = [], []
            for _ in range(args.runs):
                d = cohort_train(args, tmp, 2, ["--strategy", "pipeline", "--stages", "2", "--micro-batches", str(m),
                                                "--schedule", schedule, "--partition", "auto"], 64)
                measured.append(d["bubble_fraction"])
                rates.append(d["samples_per_s"])
            theory = 1 / (m + 1)
            print(f"cnn S=2 {schedule:5s} M={m:2d}: bubble measured {median(measured):.3f} (runs "
                  f"{', '.join(f'{x:.3f}' for x in measured)}), theory (S-1)/(M+S-1) {theory:.3f}, "
                  f"measured/theory {median(measured) / theory:.2f}; {median(rates):.1f} samples/s", flush=True)


def section_compare(args, tmp):
    configs = [
        ("allreduce 2 x 64", 2, ["--strategy", "allreduce"], 64, 1),
        ("pipeline 2 stages, M=4", 2, ["--strategy", "pipeline", "--stages", "2", "--micro-batches", "4"], 128, 1),
        ("hybrid 2 stages x 2 replicas, M=4 (4 processes on 2 cores)", 4,
         ["--strategy", "pipeline", "--stages", "2", "--replicas", "2", "--micro-batches", "4"], 64, 1),
        ("local, 1 process, 2 threads", 1, [], 128, 2),
    ]
    results = {name: [] for name, *_ in configs}
    for _ in range(args.runs):
        for name, n, flags, batch, threads in configs:
            results[name].append(cohort_train(args, tmp, n, flags, batch, threads))
    base = median([d["samples_per_s"] for d in results[configs[0][0]]])
    for name, *_ in configs:
        r = results[name]
        rate = median([d["samples_per_s"] for d in r])
        rss = [median([d["maxrss_mib"][i] for d in r]) for i in range(len(r[0]["maxrss_mib"]))]
        line = (f"{name}: {rate:.1f} samples/s ({rate / base:.2f}x allreduce); peak RSS per process "
                f"{', '.join(f'{x:.0f}' for x in rss)} MiB")
        if "stage_peak_activation_bytes" in r[0]:
            line += ("; activations held at the peak per stage " +
                     ", ".join(f"{b / 1e6:.2f} MB" for b in r[0]["stage_peak_activation_bytes"]) +
                     f"; bubble {median([d['bubble_fraction'] for d in r]):.3f}; sent by the chief "
                     f"{median([d['bytes_sent'] for d in r]) / STEPS / 1e6:.2f} MB/step")
        print(line, flush=True)


FIXED_STEPS = 60


def fmt(values, digits=3):
    return ", ".join(f"{x:.{digits}f}" for x in values)


def section_fixed(args, tmp):
    ms = [int(m) for m in args.ms.split(",")]
    configs = []
    for m in ms:
        configs.append((f"before M={m}", args.before, str(m), args.before_partition))
        configs.append((f"after  M={m}", args.build, str(m), args.partition))
    if args.auto:
        configs.append(("after  M=auto", args.build, "auto", args.partition))
    results = {name: [] for name, *_ in configs}
    for _ in range(args.runs):
        for name, build, m, partition in configs:
            flags = ["--strategy", "pipeline", "--stages", "2", "--micro-batches", m, "--schedule", "1f1b",
                     "--partition", partition]
            results[name].append(cohort_train(args, tmp, 2, flags, 256, build=build, steps=FIXED_STEPS))
    for name, *_ in configs:
        r = results[name]
        bubble = [d["bubble_fraction"] for d in r]
        rate = [d["samples_per_s"] for d in r]
        line = (f"cnn S=2 batch 256 {name}: M {', '.join(str(d['micro_batches']) for d in r)}; bubble "
                f"{median(bubble):.3f} (runs {fmt(bubble)}), theory {median([d['bubble_fraction_theory'] for d in r]):.3f}")
        if "bubble_fraction_expected" in r[0]:
            line += f", expected from the stages' compute {median([d['bubble_fraction_expected'] for d in r]):.3f}"
        cuts = sorted(set((tuple(d["cut"]), tuple(d.get("cut_split_channels", []))) for d in r))
        line += f"; {median(rate):.1f} samples/s (runs {fmt(rate, 1)}); cuts (layers, split channels) {cuts}"
        if "stage_compute_fraction" in r[0]:
            for key in ["stage_compute_fraction", "stage_idle_fraction", "stage_send_fraction", "stage_optimizer_fraction"]:
                per_stage = [median([d[key][s] for d in r]) for s in range(2)]
                line += f"; {key[6:]} {fmt(per_stage)}"
        print(line, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--sections", default="bubble,compare")
    p.add_argument("--before", help="fixed: the build directory of the binary to compare against")
    p.add_argument("--ms", default="1,2,4,8", help="fixed: micro-batch counts")
    p.add_argument("--auto", action="store_true", help="fixed: also --micro-batches auto")
    p.add_argument("--before-partition", default="auto", help="fixed: --partition of the --before runs")
    p.add_argument("--partition", default="auto", help="fixed: --partition of the --build runs")
    args = p.parse_args()
    print(f"machine: {machine()}; {STEPS} steps per run ({FIXED_STEPS} in the fixed section), medians of {args.runs} runs")
    sections = {"bubble": section_bubble, "compare": section_compare, "fixed": section_fixed}
    if "fixed" in args.sections.split(",") and not args.before:
        p.error("--sections fixed needs --before DIR (the build directory to compare against)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections.split(","):
            sections[name](args, tmp)


if __name__ == "__main__":
    main()
