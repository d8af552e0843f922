#!/usr/bin/env python3
"""Sparse models: the embed model (1M x 32 table, sum pooling, MLP 64) on synthetic bags of 20-50
power-law ids, its gradients as rows against the same model forced dense (embed:sparse=0).

    flock -x /tmp/cohort-machine.lock .venv/bin/python bench/sparse.py [--build build] [--runs 3]
                                                            [--sections bytes,rate,accuracy]

bytes:     payload bytes per step of the chief (sent + received, from its step events), 2 workers,
           batch 64: ps sync (2 shards), allreduce, average and gossip, sparse against dense; the
           largest step, and ps's whole-model pulls outside the steps (the done event).
rate:      samples/s, 2 workers x 1 thread, 2 shards, batch 64: sparse ps (sync, async) against
           dense ps and against allreduce with the sparse allgather; alternating runs, medians.
accuracy:  test accuracy of every scheme after the same examples (2 epochs of 60000), against the
           synthetic set's attainable optimum (the hidden model's expected test accuracy);
           --accuracy-rows average,gossip runs only the rows whose name starts so.
gossipcodec: (not in the default) gossip's row bytes under --codec fp16 and bf16 against float32
           (none): 2 peers, 300 steps of batch 64, alternating runs; the chief's rows and the bytes
           their ids and values took (the done event's rows_sent_to_peer, row_bytes_sent_to_peer),
           and everything it sent to the other peer (bytes_sent_to_peer).
simulate:  (not in the default) `cohort simulate`'s speed-up to 500 workers of this model, with the
           density of rows and the ms per example measured here, against a dense model of the same
           parameter count; with this machine's calibration and the seeds' 2016 network.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine, median, run, single_thread_env  # noqa: E402

SPARSE = "embed"
DENSE = "embed:sparse=0"


def train(build, tmp, workers, model, flags, steps=None, epochs=None, shards=2, optimizer="adam", lr="0.01",
          batch=64):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cohort = os.path.join(build, "cohort")
    cmd = [cohort, "train", "--model", model, "--data", "synthetic-bags", "--batch", str(batch), "--threads", "1",
           "--optimizer", optimizer, "--lr", lr, "--progress", "off", "--metrics", metrics] + flags
    cmd += ["--steps", str(steps)] if steps else ["--epochs", str(epochs)]
    if workers > 1 or "ps" in flags:
        ps = shards if "ps" in flags else 0
        cmd = [cohort, "launch", "-n", str(workers)] + (["--ps", str(ps)] if ps else []) + ["--"] + cmd
    run(cmd, env=single_thread_env())
    steps_seen = []
    with open(metrics) as f:
        for line in f:
            e = json.loads(line)
            if e.get("event") == "step":
                steps_seen.append(e)
    done = done_event(metrics)
    n = max(len(steps_seen), 1)
    done["bytes_per_step"] = sum(e["bytes_sent"] + e["bytes_received"] for e in steps_seen) / n
    done["largest_step"] = max((e["bytes_sent"] + e["bytes_received"] for e in steps_seen), default=0)
    done["step_ms"] = 1000 * sum(e["step_s"] for e in steps_seen[5:]) / max(len(steps_seen) - 5, 1)
    done["wait_ms"] = 1000 * sum(e["comm_wait_s"] for e in steps_seen[5:]) / max(len(steps_seen) - 5, 1)
    return done


def section_bytes(args, tmp):
    print("\n## bytes per step (chief, sent + received), 2 workers, batch 64, 1M x 32 table\n")
    print("| scheme | sparse | largest sparse step | dense (embed:sparse=0) | dense / sparse |"
          " sparse: whole-model pulls outside the steps |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, flags in [("ps sync, 2 shards", ["--strategy", "ps", "--ps-mode", "sync"]),
                        ("allreduce", ["--strategy", "allreduce"]),
                        ("average (every step)", ["--strategy", "average"]),
                        ("gossip (all peers)", ["--strategy", "gossip"])]:
        sparse = train(args.build, tmp, 2, SPARSE, flags, steps=12)
        dense = train(args.build, tmp, 2, DENSE, flags, steps=12)
        s, d = sparse["bytes_per_step"], dense["bytes_per_step"]
        whole = sparse.get("whole_model_pull_bytes")
        whole = f"{whole / 1e6:.1f} MB" if whole is not None else "none"
        print(f"| {name} | {s / 1e3:.1f} kB | {sparse['largest_step'] / 1e3:.1f} kB | {d / 1e6:.1f} MB | "
              f"{d / s:.0f}x | {whole} |", flush=True)


def section_rate(args, tmp):
    print(f"\n## samples/s, 2 workers x 1 thread, 2 shards, batch 64 ({args.runs} alternating runs, median)\n")
    configs = [("ps sync, sparse", SPARSE, ["--strategy", "ps", "--ps-mode", "sync"], 150),
               ("ps async, sparse", SPARSE, ["--strategy", "ps", "--ps-mode", "async"], 150),
               ("ps sync, dense", DENSE, ["--strategy", "ps", "--ps-mode", "sync"], 15),
               ("allreduce, sparse allgather", SPARSE, ["--strategy", "allreduce"], 150),
               ("allreduce, dense", DENSE, ["--strategy", "allreduce"], 15)]
    results = {c[0]: [] for c in configs}
    extra = {c[0]: [] for c in configs}
    for _ in range(args.runs):
        for name, model, flags, steps in configs:
            d = train(args.build, tmp, 2, model, flags, steps=steps)
            results[name].append(d["samples_per_s"])
            extra[name].append((d["bytes_per_step"], d["step_ms"], d["wait_ms"]))
    base = median(results["ps sync, sparse"])
    print("| scheme | samples/s (median) | runs | vs ps sync sparse | step ms | comm wait ms | bytes/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, *_ in configs:
        r = results[name]
        b = median([e[0] for e in extra[name]])
        print(f"| {name} | {median(r):.0f} | {', '.join(f'{x:.0f}' for x in r)} | {median(r) / base:.2f}x | "
              f"{median([e[1] for e in extra[name]]):.1f} | {median([e[2] for e in extra[name]]):.1f} | "
              f"{b / 1e6:.2f} MB |", flush=True)


def section_accuracy(args, tmp):
    print("\n## test accuracy after 2 epochs of synthetic-bags (120000 examples), adam lr 0.01\n")
    configs = [("local, 1 process, batch 128", 1, []),
               ("allreduce, 2 workers", 2, ["--strategy", "allreduce"]),
               ("average, 2 workers, every step", 2, ["--strategy", "average"]),
               ("ps sync, 2 workers, 2 shards", 2, ["--strategy", "ps", "--ps-mode", "sync"]),
               ("ps async, 2 workers, 2 shards", 2, ["--strategy", "ps", "--ps-mode", "async"]),
               ("gossip, 2 workers", 2, ["--strategy", "gossip"]),
               ("gossip fp16, 2 workers", 2, ["--strategy", "gossip", "--codec", "fp16"])]
    if args.accuracy_rows:
        wanted = args.accuracy_rows.split(",")
        configs = [c for c in configs if any(c[0].startswith(w) for w in wanted)]
    print("| scheme | test accuracy | attainable optimum | gap | samples/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, workers, flags in configs:
        d = train(args.build, tmp, workers, SPARSE, flags, epochs=2, batch=128 if workers == 1 else 64)
        opt = d["attainable_accuracy"]
        print(f"| {name} | {d['test_accuracy']:.4f} | {opt:.4f} | {opt - d['test_accuracy']:.4f} | "
              f"{d['samples_per_s']:.0f} |", flush=True)


def section_gossipcodec(args, tmp):
    print(f"\n## gossip row bytes by codec, 2 peers, 300 steps, batch 64 ({args.runs} alternating runs, median)\n")
    codecs = ["none", "fp16", "bf16"]
    results = {c: [] for c in codecs}
    for _ in range(args.runs):
        for codec in codecs:
            d = train(args.build, tmp, 2, SPARSE, ["--strategy", "gossip", "--codec", codec], steps=300)
            rows, row_bytes = d["rows_sent_to_peer"][1], d["row_bytes_sent_to_peer"][1]
            # The chief's step events against its totals: what its peer threads moved after the
            # last step (finish(): the last sends, DONE, the other peer's updates still arriving).
            total = d["peer_bytes_sent"][0] + d["peer_bytes_received"][0]
            steps_share = (d["bytes_sent"] + d["bytes_received"]) / total
            results[codec].append((row_bytes, rows, d["bytes_sent_to_peer"][1], d["test_accuracy"], steps_share,
                                   d["bytes_sent_after_steps"], d["bytes_received_after_steps"]))
    base = median([r[0] for r in results["none"]])
    print("| codec | chief's row bytes to its peer (median) | runs | rows sent (median) | bytes per row |"
          " vs none | all bytes to its peer (median) | test accuracy (median) | step events' share of the chief's"
          " sent + received | sent, received after the last step (median) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for codec in codecs:
        r = results[codec]
        rb = median([x[0] for x in r])
        rows = median([x[1] for x in r])
        per_row = sorted({x[0] / x[1] for x in r if x[1]})
        print(f"| {codec} | {rb / 1e6:.2f} MB | {', '.join(f'{x[0] / 1e6:.2f}' for x in r)} | {rows:.0f} | "
              f"{', '.join(f'{p:.0f}' for p in per_row)} | {rb / base:.3f}x | "
              f"{median([x[2] for x in r]) / 1e6:.2f} MB | {median([x[3] for x in r]):.4f} | "
              f"{', '.join(f'{x[4]:.2f}' for x in r)} | {median([x[5] for x in r]) / 1e6:.2f} MB, "
              f"{median([x[6] for x in r]) / 1e6:.2f} MB |", flush=True)


# The embed model's parameters: the 1M x 32 table and the MLP 32-64-2.
EMBED_PARAMS = 1_000_000 * 32 + 32 * 64 + 64 + 64 * 2 + 2
# Q1 2016 (the seeds' date), as bench/simulate_tables.py: 10 Gbit/s, 100 us per message.
NETWORK = ["--bandwidth", "10gbit", "--latency-us", "100"]


def section_simulate(args, tmp):
    """The speed-up curve to 500 workers of the embed model with its measured density of rows, against
    a dense model of the same parameter count, by `cohort simulate` (this machine's calibration)."""
    local = train(args.build, tmp, 1, SPARSE, [], steps=200)
    example_ms = 1000.0 / local["samples_per_s"]
    ar = train(args.build, tmp, 2, SPARSE, ["--strategy", "allreduce"], steps=12)
    # allreduce: each rank sends its rows (8-byte id + 32 floats) to the other and receives the
    # other's; the MLP's 2242 floats go round a 2-rank ring (half sent, half received, twice).
    dense_part = 2 * 2 * (EMBED_PARAMS - 32_000_000) * 4 / 2
    rows = (ar["bytes_per_step"] - dense_part) / (2 * (8 + 32 * 4))
    density = rows / 1_000_000
    print(f"\n## cohort simulate: the embed model ({EMBED_PARAMS} parameters, {rows:.0f} rows of 1M touched per "
          f"worker step: density {density:.5f}; {example_ms:.4f} ms per example measured, 1 process) against "
          f"a dense model of the same size; {' '.join(NETWORK)}, batch 64\n")
    counts = [2, 8, 50, 100, 200, 500]
    print("| model | ms/example | scheme | " + " | ".join(f"{c} workers" for c in counts) + " | stops paying at |")
    print("| --- | --- | --- | " + " | ".join("---:" for _ in counts) + " | ---: |")
    schemes = [("ps async, 16 shards", ["--strategy", "ps", "--ps-mode", "async", "--shards", "16"]),
               ("ps async, 64 shards", ["--strategy", "ps", "--ps-mode", "async", "--shards", "64"]),
               ("allreduce", ["--strategy", "allreduce"])]
    for ms in (example_ms, 5.0):
        for model, dens in (("embed, sparse rows", density), ("dense, same size", 0)):
            for name, flags in schemes:
                cmd = [os.path.join(args.build, "cohort"), "simulate", "--calibration", args.calibration, "--json",
                       "--params", str(EMBED_PARAMS), "--example-ms", f"{ms:.6f}", "--batch", "64",
                       "--workers", ",".join(map(str, [1] + counts))] + NETWORK + flags
                if dens:
                    cmd += ["--density", f"{dens:.6f}"]
                proc, _ = run(cmd)
                out = [json.loads(line) for line in proc.stdout.splitlines()]
                by = {r["workers"]: r for r in out if "event" not in r}
                knee = [r for r in out if "event" in r][0]["stops_paying_workers"]
                print(f"| {model} | {ms:.4g} | {name} | " + " | ".join(f"{by[c]['speedup']:.1f}x" for c in counts) +
                      f" | {knee or 'beyond 500'} |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sections", default="bytes,rate,accuracy")
    parser.add_argument("--calibration", default=os.path.join(ROOT, "tests", "data", "calibration_cnn.json"))
    parser.add_argument("--accuracy-rows", default="", help="e.g. average,gossip: only these accuracy rows")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        for section in args.sections.split(","):
            {"bytes": section_bytes, "rate": section_rate, "accuracy": section_accuracy,
             "gossipcodec": section_gossipcodec, "simulate": section_simulate}[section](args, tmp)


if __name__ == "__main__":
    main()
