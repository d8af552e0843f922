#!/usr/bin/env python3
"""Hostile peers against a running job: the attack table of docs/BENCHMARKS.md.

    .venv/bin/python bench/attack.py [--build build] [--steps 300] [--model cnn] [--schemes allreduce,gossip,ps]

For each scheme the same job runs twice under `cohort launch` (2 workers, cnn on Fashion-MNIST,
fixed seed): once undisturbed, once while a stranger who does not know the job's secret attacks
every TCP port the job's processes listen on (the chief's rendezvous store, the gossip peers'
streams, the shards, and Gloo's pairs as a bystander). The attacks on each port, in turn:

  random      50 connections that send 4 KB of random bytes
  oversized   50 connections that announce a 2 GB body (a length prefix of 0x7ffffff0, for each
              of the framings: 4 bytes little-endian, an HTTP/2 preface and a 16 MB DATA frame)
  wrong       20 connections that answer a challenge with a wrong proof (random 64 bytes, which
              is what a stranger without the secret can send: the store's and the peers' HELLO)
  half-open   100 connections that connect and say nothing, held until the job ends
  flood       500 connections opened and closed as fast as possible

It measures, for each listening process: resident memory (VmRSS) and open descriptors before the
attack, at its peak during it, and after (once the half-open connections are closed and the job
has had 12 s to time out the rest), the same for the undisturbed run sampled at the same point of
its training and after the same window (its twin, so that training's own growth is not counted
as the attack's), and whether the job finished with the undisturbed run's test
accuracy (allreduce is deterministic; gossip and ps async are not, so there the figure is the
difference). A forged store value is not in this table: without the secret it cannot be written
at all (tests/store_test.cpp, Store.AFrameWithAWrongTagIsRefused).
"""
import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, done_event, machine  # noqa: E402


def status_field(pid, field):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def job_processes(launcher_pid):
    """The job's `cohort train` processes under the launcher: pid -> label (rank r / ps k)."""
    parent, cmd = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd[int(entry)] = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue

    def under(pid):
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == launcher_pid:
                return True
        return False

    out = {}
    for pid, argv in cmd.items():
        if b"train" not in argv or not under(pid):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        tf = env.get(b"TF_CONFIG")
        if tf:
            task = json.loads(tf)["task"]
            out[pid] = f"{task['type']} {task['index']}"
        else:
            out[pid] = f"rank {env.get(b'RANK', b'?').decode()}"
    return out


def listening_ports(pid):
    """TCP ports the process listens on (from ss)."""
    ports = set()
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if f"pid={pid}," in line:
            m = re.search(r":(\d+)\s", line.split()[3] + " ")
            if m:
                ports.add(int(m.group(1)))
    return ports


def connect(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


def attack(port, held, stop):
    rng = random.Random(port)
    for _ in range(50):  # random
        s = connect(port)
        if s:
            try:
                s.sendall(bytes(rng.getrandbits(8) for _ in range(4096)))
            except OSError:
                pass
            s.close()
    oversized = [b"\xf0\xff\xff\x7f",
                 b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 1])]
    for i in range(50):  # oversized
        s = connect(port)
        if s:
            try:
                s.sendall(oversized[i % 2] + b"x" * 65536)
            except OSError:
                pass
            s.close()
    for _ in range(20):  # wrong proof
        s = connect(port)
        if s:
            try:
                s.recv(128)
                s.sendall(os.urandom(64))
                s.recv(128)
            except OSError:
                pass
            s.close()
    for _ in range(100):  # half-open, held
        s = connect(port)
        if s:
            held.append(s)
    for _ in range(500):  # flood
        if stop.is_set():
            break
        s = connect(port)
        if s:
            s.close()


def run(build, scheme, steps, hostile, tmp, model, window=None):
    """One job. Both runs sample every process the same way: `before` once the job runs, the
    peak, and `after`. The attacked run attacks in between and waits 12 s; the undisturbed run
    waits `window` seconds (the attacked run's attack plus its 12 s) instead, so that its growth
    over the same stretch of training is the baseline the attack's growth is set against.
    Returns (exit code, done event, rows, log tail, seconds between before and after)."""
    cohort = os.path.join(build, "cohort")
    metrics = os.path.join(tmp, f"{scheme}-{hostile}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    args = [cohort, "launch", "-n", "2"]
    if scheme == "ps":
        args += ["--ps", "1"]
    args += ["--", cohort, "train", "--model", model, "--steps", str(steps), "--batch", "64", "--seed", "7",
             "--threads", "1", "--progress", "off", "--metrics", metrics, "--timeout", "60"]
    args += {"allreduce": ["--strategy", "allreduce"], "gossip": ["--strategy", "gossip"],
             "ps": ["--strategy", "ps", "--ps-mode", "async"]}[scheme]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "COHORT_AUTH_TOKEN"]:
        env.pop(k, None)
    launcher = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    reader = threading.Thread(target=lambda: log.extend(launcher.stdout), daemon=True)
    reader.start()
    rows = []
    # Wait until every process listens (the first steps have run), then measure (and attack).
    deadline = time.time() + 60
    procs, ports = {}, {}
    while time.time() < deadline and launcher.poll() is None:
        procs = job_processes(launcher.pid)
        ports = {pid: listening_ports(pid) for pid in procs}
        # Every process started and the first steps ran (a worker of allreduce may listen on
        # nothing: Gloo's pairs are connected by then).
        if len(procs) >= (3 if scheme == "ps" else 2) and any(ports.values()) and \
                os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            break
        time.sleep(0.2)
    started = time.time()
    before = {pid: (status_field(pid, "VmRSS"), fds(pid)) for pid in procs}
    peak = {pid: list(v) for pid, v in before.items()}
    held, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            for pid in procs:
                r, f = status_field(pid, "VmRSS"), fds(pid)
                if r is not None:
                    peak[pid][0] = max(peak[pid][0] or 0, r)
                if f is not None:
                    peak[pid][1] = max(peak[pid][1] or 0, f)
            time.sleep(0.05)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if hostile:
        attackers = [threading.Thread(target=attack, args=(port, held, stop))
                     for pid in procs for port in sorted(ports[pid])]
        for t in attackers:
            t.start()
        for t in attackers:
            t.join()
        for s in held:
            s.close()
        time.sleep(12)  # the servers' handshake deadlines (10 s) close what is left
    else:
        stop.wait(window)
    after = {pid: (status_field(pid, "VmRSS"), fds(pid)) for pid in procs}
    elapsed = time.time() - started
    stop.set()
    sampler.join()
    for pid, label in sorted(procs.items(), key=lambda kv: kv[1]):
        rows.append({"process": label, "ports": sorted(ports[pid]),
                     "rss_mb": [round((x or 0) / 2**20, 1) for x in (before[pid][0], peak[pid][0], after[pid][0])],
                     "fds": [before[pid][1], peak[pid][1], after[pid][1]],
                     "alive_after": after[pid][0] is not None})
    code = launcher.wait(timeout=900)
    reader.join(timeout=5)
    done = done_event(metrics) if os.path.exists(metrics) else None
    return code, done, rows, "".join(log[-20:]), elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=600, help="long enough that the job outlives the attack")
    ap.add_argument("--model", default="cnn", help="the job's model: long enough a run to attack (cnn: ~1 min)")
    ap.add_argument("--schemes", default="allreduce,gossip,ps")
    a = ap.parse_args()
    print(f"# {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in a.schemes.split(","):
            # Attacked first: its attack's length is the undisturbed run's sampling window.
            code1, done1, rows1, log1, window = run(a.build, scheme, a.steps, True, tmp, a.model)
            code0, done0, rows0, log0, _ = run(a.build, scheme, a.steps, False, tmp, a.model, window)
            acc0 = done0["test_accuracy"] if done0 else None
            acc1 = done1["test_accuracy"] if done1 else None
            # The attack's share of a process's growth: its growth beyond the same process's in
            # the undisturbed run over the same window (processes matched by their label).
            base = {r["process"]: r for r in rows0}
            for r in rows1:
                b = base.get(r["process"])
                if b:
                    r["undisturbed_rss_mb"] = b["rss_mb"]
                    r["undisturbed_fds"] = b["fds"]
                    r["growth_beyond_undisturbed_mb"] = round(
                        (r["rss_mb"][2] - r["rss_mb"][0]) - (b["rss_mb"][2] - b["rss_mb"][0]), 1)
            print(json.dumps({"scheme": scheme, "window_s": round(window, 1),
                              "undisturbed": {"exit": code0, "test_accuracy": acc0},
                              "attacked": {"exit": code1, "test_accuracy": acc1}, "processes": rows1}))
            for code, log in ((code1, log1), (code0, log0)):
                if code != 0:
                    print(log, file=sys.stderr)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
