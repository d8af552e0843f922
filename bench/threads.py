"""The intra-op thread table (issue 30, item 5): one `cohort train` process with --threads 0 (the
default), 1 and 2, for the mlp and the cnn on Fashion-MNIST, with 0, 1 and 2 cores kept busy beside
it by spinning processes (a neighbour: another job, the user's own data loader). Samples/s in steady
state from the done event; the three thread counts alternate within each run, so that noise hits all
three; medians and (lowest-highest) over --runs.

    .venv/bin/python bench/threads.py --cohort build/cohort [--runs 5] [--busy 0,1,2] [--models mlp,cnn]

Prints a Markdown table (docs/BENCHMARKS.md, "Threads"), each cell "median (lowest-highest)", and the
ratio of each count's median to --threads 1's.
"""
import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, median  # noqa: E402

STEPS = {"mlp": 300, "cnn": 60}


def spin(stop):
    while not stop.is_set():
        pass


def run(cohort, model, threads, tmp):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # the default must be cohort's own, not this shell's
    cmd = [cohort, "train", "--model", model, "--data", "fashion-mnist", "--steps", str(STEPS[model]),
           "--eval-every", "0", "--progress", "off", "--metrics", metrics, "--threads", str(threads)]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=600)
    with open(metrics) as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "done":
                return float(event["samples_per_s"])
    raise SystemExit(f"no done event from {' '.join(cmd)}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cohort", default="build/cohort")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--busy", default="0,1,2", help="cores kept busy beside the run, a list")
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--threads", default="0,1,2", help="--threads values to compare (0: cohort's default)")
    args = p.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    print(f"machine: {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for busy in [int(b) for b in args.busy.split(",")]:
                stop = multiprocessing.Event()
                spinners = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
                for s in spinners:
                    s.start()
                try:
                    rates = {t: [] for t in counts}
                    for r in range(args.runs):
                        order = counts[r % len(counts):] + counts[:r % len(counts)]
                        for t in order:
                            rates[t].append(run(args.cohort, model, t, tmp))
                        print(f"  {model}, {busy} busy, run {r + 1}: " +
                              ", ".join(f"--threads {t}: {rates[t][-1]:.0f}" for t in counts), flush=True)
                finally:
                    stop.set()
                    for s in spinners:
                        s.join(timeout=5)
                        if s.is_alive():
                            s.kill()
                rows.append((model, busy, rates))
    one = counts.index(1) if 1 in counts else 0
    print()
    print("| model | busy cores | " + " | ".join(f"--threads {t}" + (" (default)" if t == 0 else "") for t in counts) +
          " | " + " | ".join(f"{t} / 1" for t in counts if t != 1) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in counts) + " | " + " | ".join("---" for t in counts if t != 1) + " |")
    for model, busy, rates in rows:
        cells = [f"{median(rates[t]):.0f} ({min(rates[t]):.0f}-{max(rates[t]):.0f})" for t in counts]
        base = median(rates[counts[one]])
        ratios = [f"{median(rates[t]) / base:.2f}x" for t in counts if t != 1]
        print(f"| {model} | {busy} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
