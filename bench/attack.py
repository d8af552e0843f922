#!/usr/bin/env python3
"""Hostile peers against a running job, and with --files hostile files: the attack tables of docs/BENCHMARKS.md.

    .venv/bin/python bench/attack.py [--build build] [--steps 300] [--model cnn] [--schemes allreduce,gossip,ps]
    .venv/bin/python bench/attack.py --files [--build build] [--cap-gb 8] [--timeout 120] [--cases NAME,...]

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

Then, on the shards only, an insider: a 512 MB push with the job's secret (read from the shard's
environment, as a buggy worker of the job holds it; build/bench/ps_oversized_push), four ways:
declaring its size (framed, streamed), declaring none (protobuf, as a tool that is not cohort's),
and declaring 4 KB (framed: read whole, then refused). Each must be refused alone (the shard's
answer is in the output) while the job trains on to the undisturbed run's accuracy.

It measures, for each listening process: resident memory (VmRSS) and open descriptors before the
attack, at its peak during it, and after (once the half-open connections are closed and the job
has had 12 s to time out the rest), the same for the undisturbed run sampled at the same point of
its training and after the same window (its twin, so that training's own growth is not counted
as the attack's), and whether the job finished with the undisturbed run's test
accuracy (allreduce is deterministic; gossip and ps async are not, so there the figure is the
difference). A forged store value is not in this table: without the secret it cannot be written
at all (tests/store_test.cpp, Store.AFrameWithAWrongTagIsRefused).

With --files, hostile files and command lines instead (issue 30, item 3; the table "Hostile files"
of docs/BENCHMARKS.md). For each case it writes the file in a temporary directory and runs the real
`cohort` command that reads it, under an address-space cap (RLIMIT_AS, --cap-gb) and a timeout:

  sparse checkpoint  a real checkpoint's header claiming 20 GB, in a sparse file of 20 GB (--resume)
  gzip bomb          train-images-idx3-ubyte.gz of 14 MB: an IDX header promising 60 images, then
                     about 14 GB of zeros (--data mnist:DIR)
  libsvm             a line with feature id 10,000,000; with label 1e7; with label 2e9
  calibration        parameter_bytes 1e308 (cohort simulate --calibration)
  stray checkpoint   ckpt-99999999999999999999.ckpt beside a good checkpoint (--resume: a warning,
                     and the run resumes from the good one, exit 0)
  corrupt data       a checkpoint whose archive is damaged under a valid checksum (--resume)
  model archive      a torch archive without cohort's keys (cohort ensemble)
  TOML config        `batch =`; a value of 10 MB (--config)
  command lines      --steps 1e23, --outer-lr inf, simulate --workers 2147483647, simulate --strategy
                     pipeline --codec fp16, --batch larger than the data set, --seed -1, --save-model ""
  paths and zeros    a directory as --config, --profile and simulate --plot; --config twice; quantize
                     --out the model itself; --steps 0, compare --steps 0; ps --tls-cert with no
                     certificate (the twentieth session's, "before" on b142c08)

and a good 1-step run as the control (what loading libtorch costs). It records the exit status, the
wall seconds, the command's peak RSS (GNU time's %M) and the first line of stderr, and prints a
Markdown table with the issue's figures (e707c9a) as "before", quoted, not measured. A case is "ok"
when it exits as the fix promises (1 or 2; 0 for the stray file) with a first line naming the file
and the field (the flag), one line of at most 1 KB on stderr, a peak RSS under --max-rss-mb and a
run under --max-seconds; the script exits 1 when a case is not.
"""
import argparse
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import torch

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


def environment(pid):
    """The process's environment (bytes to bytes); empty when it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


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
        env = environment(pid)
        if not env:
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


# (declare, method) of the insider's oversized pushes, in the order they are sent.
OVERSIZED = [("honest", "framed"), ("honest", "stream"), ("none", "protobuf"), ("lie", "framed")]


def oversized_pushes(build, port, token, mb=512):
    """The insider's oversized pushes to a shard's port, one after the other; the shard's answers."""
    tool = os.path.join(build, "bench", "ps_oversized_push")
    answers = []
    for declare, method in OVERSIZED:
        r = subprocess.run([tool, f"127.0.0.1:{port}", "--mb", str(mb), "--declare", declare, "--method", method],
                           env=dict(os.environ, COHORT_AUTH_TOKEN=token), capture_output=True, text=True,
                           timeout=300)
        if r.returncode == 0 and r.stdout.strip():
            answers.append(json.loads(r.stdout))
        else:
            answers.append({"declare": declare, "method": method, "error": (r.stderr or r.stdout).strip()[-300:]})
    return answers


def run(build, scheme, steps, hostile, tmp, model, window=None):
    """One job. Both runs sample every process the same way: `before` once the job runs, the
    peak, and `after`. The attacked run attacks in between and waits 12 s; the undisturbed run
    waits `window` seconds (the attacked run's attack plus its 12 s) instead, so that its growth
    over the same stretch of training is the baseline the attack's growth is set against.
    Returns (exit code, done event, rows, log tail, seconds between before and after, the shards'
    answers to the insider's oversized pushes)."""
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
    oversized = []

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
        for pid, label in procs.items():
            token = environment(pid).get(b"COHORT_AUTH_TOKEN", b"").decode()
            if label.startswith("ps") and token:
                for port in sorted(ports[pid]):
                    oversized += [dict(a, process=label) for a in oversized_pushes(build, port, token)]
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
    return code, done, rows, "".join(log[-20:]), elapsed, oversized


# --- Hostile files (--files) -----------------------------------------------------------------------

# What issue 30 (item 3) reported for each case on e707c9a (2026-11-27): quoted, not re-measured.
BAD_ALLOC = "`std::bad_alloc` after 15-22 s and 2-3 GB, naming no file"
ACCEPTED = "silently accepted"
NO_FILE = "an error naming no file"

# A quick run: a flag that is wrongly accepted ends in "done" rather than in a timeout.
QUICK = ["train", "--model", "mlp", "--data", "synthetic:60", "--batch", "8", "--steps", "1", "--progress", "off",
         "--threads", "1"]


def quick(**changes):
    """QUICK with the values of some of its flags changed (steps=10) and flags added (extra=[...])."""
    args = list(QUICK)
    for flag, value in changes.items():
        if flag == "extra":
            continue
        args[args.index("--" + flag) + 1] = value
    return args + changes.get("extra", [])


def gzip_bomb(path, header, size):
    """A gzip file of about `size` bytes whose data is `header` followed by zeros, about 1000 times
    `size` of them: one 1 MiB block of zeros deflated once after a full flush (so that it needs
    nothing before it) and repeated; the trailer's CRC and length are those of the whole."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(header) + c.flush(zlib.Z_FULL_FLUSH)
    zeros = bytes(1 << 20)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    assert block == c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    tail = c.flush(zlib.Z_FINISH)
    count = max(1, (size - len(head)) // len(block))
    crc = zlib.crc32(header)
    with open(path, "wb") as f:
        f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + head)
        for _ in range(count):
            f.write(block)
            crc = zlib.crc32(zeros, crc)
        f.write(tail + struct.pack("<II", crc, (len(header) + count * len(zeros)) & 0xffffffff))
    return len(header) + count * len(zeros)


def idx_file(dims, data=True):
    """An IDX file of unsigned bytes: magic, big-endian dimensions, then (data=True) zeros."""
    count = 1
    for d in dims:
        count *= d
    header = bytes([0, 0, 0x08, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims)
    return header + bytes(count) if data else header


def checkpoint(payload):
    """A checkpoint file as CheckpointStore::save writes it (src/base/checkpoint.cpp): "COHORTCK",
    format version 1, the payload's length and CRC-32 (little-endian), the payload."""
    return b"COHORTCK" + struct.pack("<IQI", 1, len(payload), zlib.crc32(payload)) + payload


def file_cases(tmp, good):
    """The hostile files and command lines of issue 30, item 3: one dict per case, with what it
    runs (`args`, after `cohort`), the exit status the fix promises, what the first line of stderr
    must hold (the file and the field), what stderr must hold elsewhere, and the issue's figure."""
    cases = []

    def add(name, args, exit_code, first, before, also=()):
        cases.append({"case": name, "args": args, "exit": exit_code, "first": list(first), "also": list(also),
                      "before": before})

    def fresh(name):
        d = os.path.join(tmp, name)
        os.makedirs(d)
        return d

    good_ckpt = os.path.join(good, "ckpt-0000000005.ckpt")
    with open(good_ckpt, "rb") as f:
        good_bytes = f.read()
    resume = quick(steps="10", extra=["--resume", "--checkpoint-dir"])

    add("control: a good 1-step run", quick(), 0, [], "")

    # A checkpoint's valid header (a real one's) claiming 20 GB, in a sparse file of that size.
    d = fresh("sparse")
    path = os.path.join(d, "ckpt-0000000005.ckpt")
    claimed = 20_000_000_000
    with open(path, "wb") as f:
        f.write(good_bytes[:12] + struct.pack("<Q", claimed) + good_bytes[20:24])
    os.truncate(path, 24 + claimed)
    add("sparse checkpoint, header claims 20 GB", resume + [d], 1,
        [path, "payload length is 20000000000 bytes"], BAD_ALLOC)

    # An IDX directory whose training images are a gzip bomb: a header promising 60 images of
    # 28x28, then about 14 GB of zeros in 14 MB.
    d = fresh("bomb")
    bomb = os.path.join(d, "train-images-idx3-ubyte.gz")
    unpacked = gzip_bomb(bomb, idx_file([60, 28, 28], data=False), 14_000_000)
    for name, data in [("train-labels-idx1-ubyte", idx_file([60])),
                       ("t10k-images-idx3-ubyte", idx_file([10, 28, 28])),
                       ("t10k-labels-idx1-ubyte", idx_file([10]))]:
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    add(f"gzip bomb as IDX images ({os.path.getsize(bomb) / 1e6:.0f} MB, unpacks to {unpacked / 1e9:.0f} GB)",
        quick(data="mnist:" + d), 1, [bomb, "goes on past the 47040 bytes"], BAD_ALLOC)

    # libsvm files: four good lines, then the hostile one.
    good_lines = "1 2 7\n0 3\n1 4 9 11\n0 5\n"
    for label, line, needle in [("feature id 10,000,000", "0 5 10000000\n", "feature id 10000000"),
                                ("label 1e7", "10000000 3\n", "label 10000000"),
                                ("label 2e9", "2000000000 3\n", "label 2000000000")]:
        path = os.path.join(tmp, "libsvm-" + needle.replace(" ", "-") + ".txt")
        with open(path, "w") as f:
            f.write(good_lines + line)
        add(f"libsvm line with {label}", quick(model="embed", batch="2", data="libsvm:" + path), 1,
            [path + ":5:", needle], BAD_ALLOC)

    # A calibration file (the one the tests use) with parameter_bytes 1e308.
    with open(os.path.join(ROOT, "tests", "data", "calibration_cnn.json")) as f:
        calibration = json.load(f)
    good_cal = os.path.join(tmp, "calibration.json")
    with open(good_cal, "w") as f:
        json.dump(calibration, f)
    calibration["parameter_bytes"] = 1e308
    path = os.path.join(tmp, "calibration-1e308.json")
    with open(path, "w") as f:
        json.dump(calibration, f)
    add("calibration with parameter_bytes 1e308", ["simulate", "--calibration", path, "--workers", "1,2"], 2,
        [path, "parameter_bytes"], BAD_ALLOC)

    # A stray file beside a good checkpoint: a warning, and the run resumes from the good one.
    d = fresh("stray")
    shutil.copy(good_ckpt, d)
    stray = os.path.join(d, "ckpt-99999999999999999999.ckpt")
    with open(stray, "w") as f:
        f.write("stray")
    add("stray ckpt-99999999999999999999.ckpt beside a good one, --resume", resume + [d], 0,
        ["warning", stray], '"cohort: error: stoll", the run stopped',
        also=["resumed from " + os.path.join(d, "ckpt-0000000005.ckpt")])

    # A checkpoint whose archive was damaged before its checksum was made (the archive's code
    # indented wrongly, as tests/trainer_test.cpp does), newer than the good one.
    d = fresh("corrupt")
    shutil.copy(good_ckpt, d)
    payload = bytearray(good_bytes[24:])
    at = payload.find(b"\n  __buffers__")
    assert at >= 0, "the checkpoint's archive has no code to damage"
    payload[at + 2] = ord("u")
    path = os.path.join(d, "ckpt-0000000006.ckpt")
    with open(path, "wb") as f:
        f.write(checkpoint(bytes(payload)))
    add("checkpoint data corrupt under a valid checksum", resume + [d], 1,
        [path, "checkpoint payload is unreadable"], NO_FILE)

    # A torch archive of a model without cohort's keys (cohort_model, cohort_shape).
    path = os.path.join(tmp, "plain.pt")
    torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 3))).save(path)
    add("model archive without cohort's keys", ["ensemble", "--data", "synthetic:60", "--threads", "1", path], 1,
        [path, "without cohort's model description"], NO_FILE)

    # TOML configs: a key without a value, a value of 10 MB.
    path = os.path.join(tmp, "no-value.toml")
    with open(path, "w") as f:
        f.write('model = "mlp"\nbatch =\n')
    add("TOML config with `batch =`", ["train", "--config", path], 2, [path, "key 'batch' has no value"], NO_FILE)
    path = os.path.join(tmp, "ten-mb.toml")
    with open(path, "w") as f:
        f.write('steps = 1\ndata = "' + "A" * 10_000_000 + '"\n')
    add("TOML config with a 10 MB value", ["train", "--config", path], 2,
        [path, "key 'data' has a value of 10000000 bytes"], NO_FILE + " (the issue: echo at most a prefix)")

    # Command lines.
    add("`--steps 1e23`", quick(steps="1e23"), 2, ["--steps", "1e23"], ACCEPTED)
    add("`--outer-lr inf`", quick(extra=["--outer-lr", "inf"]), 2, ["--outer-lr", "inf"], ACCEPTED)
    add("`simulate --workers 2147483647`", ["simulate", "--calibration", good_cal, "--workers", "2147483647"], 2,
        ["--workers", "2147483647"], ACCEPTED + ", ran for minutes")
    add("`simulate --strategy pipeline --codec fp16`",
        ["simulate", "--calibration", good_cal, "--workers", "1,2", "--strategy", "pipeline", "--codec", "fp16"], 2,
        ["--codec fp16", "pipeline"], ACCEPTED + " (train refuses it)")
    add("`--batch 100` on 60 examples", quick(batch="100"), 2, ["--batch 100", "60 training examples"], ACCEPTED)
    add("`--seed -1`", quick(extra=["--seed", "-1"]), 2, ["--seed", "-1"], ACCEPTED)
    add('`--save-model ""`', quick(extra=["--save-model", ""]), 2, ["--save-model"], ACCEPTED)

    # Paths where a file goes, and budgets of 0 (found in the twentieth session, on b142c08).
    d = fresh("a-directory")
    cfg = os.path.join(tmp, "steps.toml")
    with open(cfg, "w") as f:
        f.write("steps = 1\n")
    add("`--config` a directory", ["train", "--config", d], 2, ["--config", d, "is a directory, not a file"],
        "b142c08: trained a whole epoch on the defaults")
    add("`--config` twice", quick(extra=["--config", cfg, "--config", cfg]), 2, ["--config is given twice"],
        "b142c08: the second silently ignored")
    add("`--profile` a directory", quick(extra=["--profile", d]), 2, ["--profile", d, "is a directory"],
        "b142c08: \"written to\" it, exit 0, a .tmp file left beside it")
    model = os.path.join(tmp, "model.pt")
    add("`quantize --out` the model itself", ["quantize", model, "--out", model, "--data", "synthetic:60"], 2,
        ["--out", "the model to quantize"], "b142c08: the float model replaced by the 8-bit one")
    add("`--steps 0`", quick(steps="0"), 2, ["--steps", "Value 0"], "b142c08: trained the default epoch")
    add("`compare --steps 0`", ["compare", "--steps", "0", "--model", "mlp", "--data", "synthetic:60", "--out",
                                os.path.join(tmp, "compare-out")], 2, ["--steps must be positive"],
        "b142c08: every configuration ran the default epoch")
    add("`simulate --plot` a directory", ["simulate", "--calibration", good_cal, "--plot", d], 2, ["--plot", d],
        "b142c08: simulated, then failed to write")
    junk = os.path.join(tmp, "junk.pem")
    with open(junk, "w") as f:
        f.write("not a certificate\n")
    add("`ps --tls-cert` with no certificate", ["ps", "--host", "127.0.0.1", "--tls-cert", junk, "--tls-key", junk], 2,
        ["--tls-cert", junk, "holds no PEM certificate"], "b142c08: started; every handshake failed later")

    # Files that never end, and sweep and compare files that are not files (twenty-first session, on aeef050).
    add("`--config /dev/zero`", ["train", "--config", "/dev/zero"], 2, ["--config /dev/zero", "larger than 64 MiB"],
        "aeef050: read until memory ran out, then \"terminate called\" (a crash)")
    add("`compare --hostfile /dev/zero`", ["compare", "--hostfile", "/dev/zero"], 2,
        ["--hostfile /dev/zero", "larger than 64 MiB"], "aeef050: read until memory ran out (std::bad_alloc)")
    add("`sweep` a directory", ["sweep", d, "--out", os.path.join(tmp, "sweep-out")], 2,
        ["the sweep file", d, "is a directory"], "aeef050: ran a trial of the defaults")
    empty = os.path.join(tmp, "empty.toml")
    open(empty, "w").close()
    add("`sweep` an empty file", ["sweep", empty, "--out", os.path.join(tmp, "sweep-out")], 2,
        ["the sweep file", empty, "is empty"], "aeef050: ran a trial of the defaults")
    add("`compare` a directory", ["compare", d, "--out", os.path.join(tmp, "compare-out")], 2,
        ["the compare file", d, "is a directory"], "aeef050: \"no [[configuration]] tables\"")
    return cases


def run_capped(argv, cap, timeout, env):
    """Runs argv with its address space capped at `cap` bytes (RLIMIT_AS, as the issue's reporter
    did) and a timeout. Returns its exit status (-N: killed by signal N; None: timed out), wall
    seconds, peak RSS in bytes and its stderr. The peak is /usr/bin/time's: a child forked from
    this process (torch loaded: about 500 MB) would report this process's RSS as its own floor."""
    def limit():
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))

    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as timed:
        start = time.monotonic()
        child = subprocess.Popen(["/usr/bin/time", "-o", timed.name, "-f", "%M %x"] + argv, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=err, preexec_fn=limit, env=env,
                                 start_new_session=True)
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # its own session: time and the command
            child.wait()
        wall = time.monotonic() - start
        err.seek(0)
        stderr = err.read().decode(errors="replace")
        report = timed.read().split("\n")
    m = re.search(r"Command terminated by signal (\d+)", report[0])
    fields = [line for line in report if re.fullmatch(r"\d+ -?\d+", line)]
    if not fields or child.returncode == -signal.SIGKILL:
        return None, wall, 0, stderr
    rss_kb, code = map(int, fields[-1].split())
    return (-int(m.group(1)) if m else code), wall, rss_kb * 1024, stderr


def verdict(case, code, wall, rss, stderr, limits):
    """What differs from the fix's promise, or "ok"."""
    problems = []
    lines = stderr.splitlines()
    first = lines[0] if lines else ""
    if code is None:
        problems.append(f"killed after the timeout, expected exit {case['exit']}")
    elif code != case["exit"]:
        problems.append(f"exit {code}, expected {case['exit']}")
    missing = [n for n in case["first"] if n not in first]
    if missing:
        problems.append("first line lacks " + ", ".join(f"'{n}'" for n in missing))
    missing = [n for n in case["also"] if n not in stderr]
    if missing:
        problems.append("stderr lacks " + ", ".join(f"'{n}'" for n in missing))
    if case["exit"] != 0 and len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr")
    if len(stderr) > limits["stderr_bytes"]:
        problems.append(f"{len(stderr)} bytes on stderr")
    if rss > limits["rss"]:
        problems.append(f"peak RSS {rss / 2**20:.0f} MB")
    if wall > limits["seconds"]:
        problems.append(f"{wall:.1f} s")
    return "; ".join(problems) or "ok"


def files(a):
    """--files: each hostile file (and command line) of issue 30, item 3, against `cohort`."""
    cohort = os.path.join(a.build, "cohort")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "COHORT_AUTH_TOKEN"]:
        env.pop(k, None)
    if not os.access("/usr/bin/time", os.X_OK):
        sys.exit("--files needs GNU time as /usr/bin/time (apt-get install time) for the peak RSS")
    cap = int(a.cap_gb * 2**30)
    limits = {"rss": a.max_rss_mb * 2**20, "seconds": a.max_seconds, "stderr_bytes": 1024}
    print(f"# {machine()}")
    print(f"# {cohort}, RLIMIT_AS {a.cap_gb:g} GiB, timeout {a.timeout:g} s; "
          f"ok: the exit status and first line the fix promises, one line of stderr (at most 1 KB) for a "
          f"refusal, peak RSS under {a.max_rss_mb} MB, under {a.max_seconds:g} s")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cohort-files-") as tmp:
        good = os.path.join(tmp, "good")
        code, _, _, stderr = run_capped(
            [cohort] + quick(steps="5", extra=["--checkpoint-dir", good, "--save-model", os.path.join(tmp, "model.pt")]),
            cap, a.timeout, env)
        if code != 0:
            sys.exit(f"the run that writes the good checkpoint failed ({code}): {stderr}")
        cases = file_cases(tmp, good)
        if a.cases:
            cases = [c for c in cases if any(w in c["case"] for w in a.cases.split(","))]
        rows = []

        def shown(text):
            return text.replace(tmp, "$T").replace(cohort, "cohort")

        for case in cases:
            code, wall, rss, stderr = run_capped([cohort] + case["args"], cap, a.timeout, env)
            first = stderr.splitlines()[0] if stderr else ""
            if len(first) > 300:
                first = first[:300] + f"... ({len(first)} bytes)"
            command = " ".join(["cohort"] + [x if x else "''" for x in case["args"]])
            row = {"case": case["case"], "command": shown(command), "before": case["before"], "exit": code,
                   "wall_s": round(wall, 2), "peak_rss_mb": round(rss / 2**20),
                   "stderr_lines": len(stderr.splitlines()), "stderr_bytes": len(stderr),
                   "first_line": shown(first), "verdict": verdict(case, code, wall, rss, stderr, limits)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print()
    print("| case | command | before (issue 30: e707c9a; later ones as named) | exit | wall s | peak RSS MB | "
          "first line of stderr "
          "| verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        exit_code = "timeout" if r["exit"] is None else str(r["exit"])
        cells = [r["case"], f"`{r['command']}`", r["before"], exit_code, f"{r['wall_s']:.2f}", str(r["peak_rss_mb"]),
                 f"`{r['first_line']}`" if r["first_line"] else "", r["verdict"]]
        print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    print(f"\n{len(rows)} cases in {time.monotonic() - started:.0f} s ($T: the temporary directory)")
    bad = [r["case"] for r in rows if r["verdict"] != "ok"]
    if bad:
        print(f"\n{len(bad)} case(s) not as the fix promises: " + "; ".join(bad))
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=600, help="long enough that the job outlives the attack")
    ap.add_argument("--model", default="cnn", help="the job's model: long enough a run to attack (cnn: ~1 min)")
    ap.add_argument("--schemes", default="allreduce,gossip,ps")
    ap.add_argument("--files", action="store_true", help="hostile files and command lines instead of ports")
    ap.add_argument("--cap-gb", type=float, default=8, help="--files: each command's address space (RLIMIT_AS)")
    ap.add_argument("--timeout", type=float, default=120, help="--files: seconds before a command is killed")
    ap.add_argument("--max-rss-mb", type=int, default=1024, help="--files: a peak RSS above this is not ok")
    ap.add_argument("--max-seconds", type=float, default=10, help="--files: a run longer than this is not ok")
    ap.add_argument("--cases", help="--files: only the cases whose name holds one of these (comma list)")
    a = ap.parse_args()
    if a.files:
        sys.exit(files(a))
    print(f"# {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in a.schemes.split(","):
            # Attacked first: its attack's length is the undisturbed run's sampling window.
            code1, done1, rows1, log1, window, oversized = run(a.build, scheme, a.steps, True, tmp, a.model)
            code0, done0, rows0, log0, _, _ = run(a.build, scheme, a.steps, False, tmp, a.model, window)
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
                              "attacked": {"exit": code1, "test_accuracy": acc1}, "processes": rows1,
                              "oversized_pushes": oversized}))
            for code, log in ((code1, log1), (code0, log0)):
                if code != 0:
                    print(log, file=sys.stderr)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
