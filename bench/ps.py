#!/usr/bin/env python3
"""The parameter server: every update policy against allreduce in the same run.

    .venv/bin/python bench/ps.py [--build build] [--runs 3] [--sections rate,accuracy,bandwidth,staleness]
                                  [--models cnn,mlp] [--shards 1,2]

rate:       cnn and mlp, 2 workers x 1 thread, batch 64, with 1 and 2 shards: samples/s of
            ps sync, sync --backup-workers 1, async (and async with each push as one message:
            --ps-push-chunk-mb 0, or streamed in chunks of at most 1 MB, which the shards apply as
            they arrive), softsync 2, ssp 2 against allreduce, alternating runs (median,
            and every run); where the time went (compute, waiting on the shards, bytes per step).
            A second rate counts the chief's steps only from the first one that has every worker's
            samples: in the asynchronous modes the chief starts before the other worker pushes.
accuracy:   test accuracy after 2 epochs of each mode (1 shard; mlp and cnn): best per epoch, and
            samples/s: best per second.
bandwidth:  push+pull of one shard for a 58.4 MB model (14.6M floats) against raw loopback TCP.
staleness:  async with N = 2, 3, 4 workers (mlp): the staleness histogram and its mean (the seeds
            predict about N-1).
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, run, single_thread_env  # noqa: E402

STEPS = {"mlp": 400, "cnn": 100}
MODES = [("allreduce", ["--strategy", "allreduce"]),
         ("ps sync", ["--strategy", "ps", "--ps-mode", "sync"]),
         ("ps sync backup 1", ["--strategy", "ps", "--ps-mode", "sync", "--backup-workers", "1"]),
         ("ps async", ["--strategy", "ps", "--ps-mode", "async"]),
         # Every push as one message (PushFramed); by default only a push of more than 4 MB to a shard
         # streams, so the cnn's (~2.2 MB per shard with 2 shards) go as one message either way.
         ("ps async one message", ["--strategy", "ps", "--ps-mode", "async", "--ps-push-chunk-mb", "0"]),
         # The cnn's pushes streamed (PushStream) in chunks of at most 1 MB, applied chunk by chunk.
         ("ps async streamed 1 MB", ["--strategy", "ps", "--ps-mode", "async", "--ps-push-chunk-mb", "1"]),
         ("ps softsync 2", ["--strategy", "ps", "--ps-mode", "softsync", "--softsync", "2"]),
         ("ps ssp 2", ["--strategy", "ps", "--ps-mode", "ssp", "--staleness-bound", "2"])]


def train(build, tmp, workers, shards, model, flags, steps=None, epochs=None):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cohort = os.path.join(build, "cohort")
    cmd = [cohort, "train", "--model", model, "--data", "fashion-mnist", "--batch", "64", "--threads", "1",
           "--optimizer", "momentum", "--lr", "0.01", "--progress", "off", "--metrics", metrics] + flags
    cmd += ["--steps", str(steps)] if steps else ["--epochs", str(epochs)]
    ps = shards if "ps" in flags else 0
    cmd = [cohort, "launch", "-n", str(workers)] + (["--ps", str(ps)] if ps else []) + ["--"] + cmd
    run(cmd, env=single_thread_env())
    steps_seen = []
    with open(metrics) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "step" and e["step"] > 5:
                steps_seen.append(e)
    done = done_event(metrics)
    # The rate with every worker running: the chief's steps from the first one that counts every
    # worker's samples (workers x 64). In the asynchronous modes the chief's first steps run alone
    # while the other workers start (their samples are missing there, not late); allreduce's
    # start waits in its warm-up steps, which the trainer's own rate leaves out already.
    full = workers * 64
    first = next((i for i, e in enumerate(steps_seen) if e["samples"] >= full), None)
    running = steps_seen[first:] if first is not None else []
    seconds = sum(e["step_s"] for e in running)
    done["running_samples_per_s"] = sum(e["samples"] for e in running) / seconds if seconds > 0 else 0.0
    done["alone_steps"] = (first if first is not None else len(steps_seen))
    n = max(len(steps_seen), 1)
    done["step_ms"] = 1000 * sum(e["step_s"] for e in steps_seen) / n
    done["compute_ms"] = 1000 * sum(e["compute_s"] for e in steps_seen) / n
    done["wait_ms"] = 1000 * sum(e["comm_wait_s"] for e in steps_seen) / n
    done["mb_per_step"] = sum(e["bytes_sent"] + e["bytes_received"] for e in steps_seen) / n / 1e6
    return done


def section_rate(args, tmp):
    for model in args.models.split(","):
        for shards in [int(m) for m in args.shards.split(",")]:
            modes = [(name, flags) for name, flags in MODES if name == "allreduce" or not args.modes
                     or name in args.modes.split(",")]
            results = {name: [] for name, _ in modes}
            for _ in range(args.runs):
                for name, flags in modes:
                    results[name].append(train(args.build, tmp, 2, shards, model, flags, steps=STEPS[model]))
            base = median([d["samples_per_s"] for d in results["allreduce"]])
            print(f"{model}, 2 workers, {shards} shard(s), {STEPS[model]} steps, median of {args.runs}:", flush=True)
            running_base = median([d["running_samples_per_s"] for d in results["allreduce"]])
            for name, _ in modes:
                r = results[name]
                rate = median([d["samples_per_s"] for d in r])
                running = median([d["running_samples_per_s"] for d in r])
                print(f"  {name:18s} {rate:8.1f} samples/s  {rate / base:5.2f}x allreduce   step "
                      f"{median([d['step_ms'] for d in r]):6.1f} ms = compute {median([d['compute_ms'] for d in r]):6.1f}"
                      f" + waiting {median([d['wait_ms'] for d in r]):6.1f} ms, {median([d['mb_per_step'] for d in r]):.2f}"
                      f" MB/step; runs (samples/s, in order): {', '.join('%.1f' % d['samples_per_s'] for d in r)}",
                      flush=True)
                print(f"  {'':18s} every worker running: {running:8.1f} samples/s  {running / running_base:5.2f}x allreduce"
                      f" (after the chief's first {median([d['alone_steps'] for d in r]):.0f} steps counted without the"
                      f" other worker; runs: {', '.join('%.1f' % d['running_samples_per_s'] for d in r)})", flush=True)


def section_accuracy(args, tmp):
    for model in args.models.split(","):
        print(f"{model}, 2 workers, 1 shard, 2 epochs:", flush=True)
        for name, flags in MODES:
            d = train(args.build, tmp, 2, 1, model, flags, epochs=2)
            extra = ""
            if "staleness_mean" in d:
                extra = (f", staleness mean {d['staleness_mean']:.2f}, applied {d['gradients_applied']},"
                         f" dropped {d['dropped_late'] + d['dropped_stale']}")
            print(f"  {name:18s} test accuracy {d['test_accuracy']:.4f}  {d['samples_per_s']:8.1f} samples/s  "
                  f"wall {d['wall_s']:.0f} s{extra}", flush=True)


def section_bandwidth(args, tmp):
    tcp, grpc = [], []
    for _ in range(max(5, args.runs)):
        proc, _ = run([os.path.join(args.build, "bench", "ps_bandwidth"), "14.6", "10"])
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue  # the shard's "listening on" line
            j = json.loads(line)
            (tcp if j["transport"] == "tcp" else grpc).append(j["gb_per_s"])
    print(f"push+pull of 58.4 MB, one shard: gRPC {median(grpc):.3f} GB/s, raw loopback TCP {median(tcp):.3f} GB/s, "
          f"ratio {median(grpc) / median(tcp):.3f}x (runs: gRPC {grpc}, TCP {tcp})", flush=True)


def section_staleness(args, tmp):
    for n in [2, 3, 4]:
        d = train(args.build, tmp, n, 1, "mlp", ["--strategy", "ps", "--ps-mode", "async"], steps=300)
        print(f"async, {n} workers: staleness mean {d['staleness_mean']:.2f} (seeds: about {n - 1}), max "
              f"{d['staleness_max']}, histogram {d['staleness_histogram']}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--sections", default="rate,accuracy,bandwidth,staleness")
    p.add_argument("--models", default="cnn,mlp", help="rate and accuracy: the models")
    p.add_argument("--shards", default="1,2", help="rate: the shard counts")
    p.add_argument("--modes", default="", help="rate: only these ps modes (names as printed, e.g. 'ps async'), "
                   "comma-separated, beside allreduce; default: all")
    args = p.parse_args()
    print(f"machine: {machine()}")
    sections = {"rate": section_rate, "accuracy": section_accuracy, "bandwidth": section_bandwidth,
                "staleness": section_staleness}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections.split(","):
            sections[name](args, tmp)


if __name__ == "__main__":
    main()
