#!/usr/bin/env python3
"""The fault table: each fault under each scheme, run through `cohort launch`.

    flock -x /tmp/cohort-machine.lock .venv/bin/python bench/fault_table.py [--build build] [--steps 300]
        [--schemes allreduce,ps-sync,ps-async,ps-ssp,gossip,average,pipeline,ps-softsync,ps-sync-backup,tensor] [--faults none,worker,chief,shard,ckpt,disk]
        [--log-dir DIR] [--json FILE]
    .venv/bin/python bench/fault_table.py --merge run1.json,run2.json,run3.json   # medians and ranges of several runs

3 workers (2 under pipeline: --stages 2, one process per stage; 2 under tensor: --ways 2; and 1 shard under ps) x 1 thread, the mlp on Fashion-MNIST, batch 64, momentum SGD
lr 0.01, --steps S, checkpoints every 50 steps, --timeout 10, under
`cohort launch --max-restarts 1 --grace 5` (0 restarts for the fault "worker"). For each scheme an undisturbed run, then one run per
fault: once the chief's metrics reach step S/3 the victim is sent SIGKILL by this script
(worker, worker+restart: rank 2; chief: rank 0; shard: ps 0; ckpt: the checkpoint writer (the chief, or the shard
under ps) at the moment a temporary checkpoint file appears, i.e. inside a write; disk: the
checkpoint directory is a 1 MiB tmpfs, too small for one checkpoint, so every write fails with
ENOSPC). Recorded: how long until the launcher named the dead process (its stderr line, read as it
comes), what the job did (its exit status, the launcher's decision, restarts, lost workers), the
wall time, and the final test accuracy next to the undisturbed run's. The fault "evaluator" runs
the job with `cohort launch --evaluator` (allreduce only: the schemes whose chief writes whole-model
checkpoints) and kills the evaluator task; its undisturbed baseline is the scheme's own.
"""
import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine():
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{platform.node()}: {os.cpu_count()} cores, {cpu}"

WORKERS = 3
SCHEMES = {
    "allreduce": (["--strategy", "allreduce"], 0),
    "ps-sync": (["--strategy", "ps", "--ps-mode", "sync"], 1),
    "ps-async": (["--strategy", "ps", "--ps-mode", "async"], 1),
    "ps-ssp": (["--strategy", "ps", "--ps-mode", "ssp", "--staleness-bound", "2"], 1),
    "gossip": (["--strategy", "gossip"], 0),
    "average": (["--strategy", "average", "--period", "4"], 0),
    # 2 stages of one pipeline: 2 processes (rank 1 is the last stage, the "worker" victim).
    "pipeline": (["--strategy", "pipeline", "--stages", "2", "--micro-batches", "4"], 0, 2),
    "ps-softsync": (["--strategy", "ps", "--ps-mode", "softsync", "--softsync", "2"], 1),
    "ps-sync-backup": (["--strategy", "ps", "--ps-mode", "sync", "--backup-workers", "1"], 1),
    # Géron's vertical split over 2 processes, each writing its own half's checkpoints (way-0, way-1).
    "tensor": (["--strategy", "tensor", "--ways", "2"], 0, 2),
}
FAULTS = ["none", "worker", "worker+restart", "chief", "shard", "ckpt", "disk", "evaluator"]
EVALUATOR_SCHEMES = {"allreduce"}


def children(pid):
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def role_of(pid):
    """'rank i' or 'ps k' from the process's environment, as the launcher labels it."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    except OSError:
        return None
    if b"RANK" in env:
        return f"rank {env[b'RANK'].decode()}"
    config = json.loads(env.get(b"TF_CONFIG", b"{}"))
    task = config.get("task", {})
    if task.get("type") == "evaluator":
        return "evaluator"
    return f"ps {task.get('index')}" if task.get("type") == "ps" else None


def victim_pid(launcher, label, deadline):
    while time.monotonic() < deadline:
        for pid in children(launcher):
            if role_of(pid) == label:
                return pid
        time.sleep(0.01)
    return None


def last_step(metrics):
    try:
        with open(metrics) as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "step":
            return event["step"]
    return 0


def done_event(metrics):
    done = None
    try:
        with open(metrics) as f:
            for line in f:
                event = json.loads(line)
                if event.get("event") == "done":
                    done = event
    except (OSError, ValueError):
        pass
    return done


def run_one(args, scheme, fault, work):
    flags, shards, *rest = SCHEMES[scheme]
    workers = rest[0] if rest else WORKERS
    if (fault == "shard" and shards == 0) or (fault == "evaluator" and scheme not in EVALUATOR_SCHEMES):
        return None  # no such process in this scheme
    ckpt = os.path.join(work, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    mounted = False
    if fault == "disk":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", ckpt], check=True)
        mounted = True
    metrics = os.path.join(work, "m.jsonl")
    cohort = os.path.join(args.build, "cohort")
    restarts = "0" if fault == "worker" else "1"
    evaluator = ["--evaluator"] if fault == "evaluator" else []
    cmd = [cohort, "launch", "-n", str(workers), "--ps", str(shards)] + evaluator + [
           "--max-restarts", restarts, "--grace", "5", "--",
           cohort, "train", "--model", "mlp", "--data", "fashion-mnist", "--batch", "64", "--threads", "1",
           "--optimizer", "momentum", "--lr", "0.01", "--steps", str(args.steps), "--progress", "off",
           "--checkpoint-dir", ckpt, "--checkpoint-every", "50", "--timeout", "10", "--metrics", metrics] + flags
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    launcher_lines = []  # (time, line) of the launcher's own lines
    failed_checkpoints = [0]
    restored = []  # a restarted shard's "restored from PATH at version V"
    resumed = []  # the chief's "resumed from PATH (step N, ..." or "... from the parameter servers at step N"
    resumed_re = re.compile(r"\[rank 0\] cohort: resumed from (?:\S+ \(step |the parameter servers at step )(\d+)")

    log = open(os.path.join(args.log_dir, f"{scheme}-{fault}.log"), "w") if args.log_dir else None

    log_lock = threading.Lock()

    def log_line(line):
        with log_lock:
            if log:
                log.write(f"{time.monotonic() - started:8.3f} {line}")

    def read_err():
        for line in proc.stderr:
            log_line(line)
            if line.startswith("cohort launch:"):
                launcher_lines.append((time.monotonic(), line.strip()))
            elif "checkpoint failed" in line:
                failed_checkpoints[0] += 1
            m = re.search(r"restored from \S+ at version (\d+)", line)
            if m:
                restored.append(int(m.group(1)))
            m = resumed_re.search(line)
            if m:
                resumed.append(int(m.group(1)))
    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    def read_out():
        # stdout too: a shard's "listening on" line says when a restarted one can be reached.
        for line in proc.stdout:
            log_line(line)
            m = resumed_re.search(line)
            if m:
                resumed.append(int(m.group(1)))
    out_thread = threading.Thread(target=read_out, daemon=True)
    out_thread.start()

    victim = {"worker": f"rank {workers - 1}", "worker+restart": f"rank {workers - 1}", "chief": "rank 0",
              "shard": "ps 0", "evaluator": "evaluator",
              "ckpt": "ps 0" if shards else "rank 0"}.get(fault)
    killed_at = None
    caught_in_write = None
    deadline = started + 600
    if victim is not None:
        while last_step(metrics) < args.steps // 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = victim_pid(proc.pid, victim, deadline)
        if pid is not None and fault == "ckpt":
            # Kill the writer inside a write: when a temporary checkpoint file exists.
            pattern = re.compile(r".*\.ckpt\.tmp\.\d+$")
            until = time.monotonic() + 60
            caught_in_write = False
            while time.monotonic() < until and proc.poll() is None:
                names = []
                for root, _, files in os.walk(ckpt):
                    names += files
                if any(pattern.match(n) for n in names):
                    caught_in_write = True
                    break
                time.sleep(0.0005)
        if pid is not None and proc.poll() is None:
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            if log:
                with log_lock:
                    log.write(f"{killed_at - started:8.3f} fault_table.py: SIGKILL to {victim} (pid {pid})\n")
    try:
        code = proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "hang"
    reader.join(timeout=5)
    out_thread.join(timeout=5)
    if log:
        with log_lock:
            log.close()
            log = None
    wall = time.monotonic() - started
    if mounted:
        subprocess.run(["umount", ckpt], check=False)
    detected = None
    if killed_at is not None:
        for t, line in launcher_lines:
            if victim in line and t >= killed_at:
                detected = t - killed_at
                break
    done = done_event(metrics)
    return {
        "scheme": scheme, "fault": fault, "exit": code, "wall_s": round(wall, 1),
        "detected_s": None if detected is None else round(detected, 3),
        "in_write": caught_in_write,
        "failed_checkpoints": failed_checkpoints[0],
        "launcher": [line for _, line in launcher_lines],
        "steps": done["steps"] if done else None,
        "accuracy": done["test_accuracy"] if done else None,
        "restarts": done.get("restarts") if done else None,
        "lost": done.get("workers_lost") if done else None,
        # ps: updates applied in the end (a restored shard counts those of its checkpoint), and
        # the version a restarted shard restored: with every push applied, S x workers - applied
        # updates were lost with the shard's state since its last checkpoint.
        "applied": done.get("gradients_applied") if done else None,
        "restored_version": restored[0] if restored else None,
        # The step the restarted chief resumed at (None: it started from scratch, or no restart).
        "resumed_step": resumed[-1] if resumed else None,
    }


def what_it_did(r):
    said = " ".join(r["launcher"])
    if "it had finished its run" in said:
        action = (f"{r['failed_checkpoints']} periodic checkpoint writes failed (ENOSPC), training went on; the final "
                  "one failed after the done event, not restarted")
    elif "restarting every process" in said:
        if r.get("resumed_step"):
            action = f"group restarted, resumed at step {r['resumed_step']}"
        elif "resumed_step" in r:
            action = "group restarted from scratch"
        else:  # a --json file from before the resumed step was recorded
            action = "group restarted from its checkpoint"
    elif "starting it again alone" in said:
        action = "restarted alone, rejoined"
    elif "go on without it" in said:
        action = "went on without it"
    elif "the workers go on" in said:
        action = "the workers went on without it"
    elif r["fault"] == "disk" and r["failed_checkpoints"]:
        action = f"{r['failed_checkpoints']} checkpoint writes failed (ENOSPC), training went on"
    else:
        action = "-"
    if r.get("lost") and "go on without it" not in said.split("starting it again alone")[0]:
        # lost as well, after the fault (a restarted shard's workers that did not get back in time)
        action += "; workers " + ", ".join(str(w) for w in r["lost"]) + " lost"
    if r["exit"] != 0:
        action += f"; ended with status {r['exit']}"
    return action


def median(values):
    values = sorted(values)
    n = len(values)
    return None if n == 0 else values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def spread(values, scale=1.0, fmt="{:.0f}"):
    """'median (min-max)' of the values present; '-' when there are none."""
    values = [v * scale for v in values if v is not None]
    if not values:
        return "-"
    text = fmt.format(median(values))
    return text if len(values) == 1 else f"{text} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def merge(paths):
    """The table from several runs' --json files: per row, the median and range of the detection
    time and the wall time, and every run's outcome when they differ."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    rows = {}
    for run in runs:
        for r in run:
            rows.setdefault((r["scheme"], r["fault"]), []).append(r)
    print(f"runs: {len(runs)} ({', '.join(paths)})\n")
    print("| scheme | fault | detected after, ms | what the job did | accuracy | wall s |")
    print("|---|---|---|---|---|---|")
    for (scheme, fault), rs in rows.items():
        actions = []
        for r in rs:
            a = what_it_did(r)
            if a not in actions:
                actions.append(a)
        in_write = [r["in_write"] for r in rs if r["in_write"] is not None]
        label = fault + (f" (inside a write {sum(in_write)}/{len(in_write)})" if in_write else "")
        print(f"| {scheme} | {label} | {spread([r['detected_s'] for r in rs], 1000)} | {' / '.join(actions)}"
              f" ({len(rs)} runs) | {spread([r['accuracy'] for r in rs], fmt='{:.4f}')} |"
              f" {spread([r['wall_s'] for r in rs], fmt='{:.1f}')} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--json", default="")
    parser.add_argument("--log-dir", default="", help="write each row's output (every process's stderr and stdout) to DIR/SCHEME-FAULT.log, each line after the seconds since the start, and the kill")
    parser.add_argument("--merge", default="",
                        help="A.json,B.json,...: print the table of several runs' --json files (medians and ranges); runs nothing")
    args = parser.parse_args()
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    if args.merge:
        merge(args.merge.split(","))
        return
    results = []
    for scheme in args.schemes.split(","):
        for fault in args.faults.split(","):
            with tempfile.TemporaryDirectory(prefix="cohort-fault-") as work:
                r = run_one(args, scheme, fault, work)
            if r is None:
                continue
            results.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    print(f"machine: {machine()}")
    print(f"command: {' '.join(sys.argv)}\n")
    print("| scheme | fault | detected after | what the job did | steps | accuracy | undisturbed | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    baseline = {r["scheme"]: r for r in results if r["fault"] == "none"}
    for r in results:
        base = baseline.get(r["scheme"])
        fault = r["fault"] + (" (inside a write)" if r["in_write"] else " (after a write)" if r["in_write"] is False else "")
        detected = "-" if r["detected_s"] is None else f"{r['detected_s'] * 1000:.0f} ms"
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.4f}"
        base_acc = "-" if not base or base["accuracy"] is None else f"{base['accuracy']:.4f}"
        print(f"| {r['scheme']} | {fault} | {detected} | {what_it_did(r)} | {r['steps'] or '-'} | {acc} | {base_acc} |"
              f" {r['wall_s']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
