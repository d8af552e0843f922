"""Shared pieces of the benchmark scripts: Fashion-MNIST loading, the models in PyTorch, stats."""
import gzip
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np
import torch
from torch import nn

FASHION = os.environ.get("COHORT_FASHION_MNIST_DIR") or "/usr/share/datasets/fashion-mnist"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def init_gloo_group():
    """dist.init_process_group("gloo") under any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT. Under `cohort launch` without --port, rank 0 gets MASTER_PORT=0: its store binds a
    port of its choosing, and rank 0 tells the launcher which (a line "port P" on COHORT_LAUNCH_FD);
    the launcher starts the other ranks with that MASTER_PORT only then."""
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    # Every rank makes its store itself and hands it over: with torch 2.11, a chief that passes its
    # own store while the others rendezvous through env:// never meets them (both wait in Gloo's
    # set-up).
    store = dist.TCPStore(host, port, world, is_master=rank == 0, wait_for_workers=False)
    channel = os.environ.get("COHORT_LAUNCH_FD")
    if rank == 0 and port == 0 and channel:
        os.write(int(channel), f"port {store.port}\n".encode())
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_fashion(split="train"):
    prefix = "train" if split == "train" else "t10k"
    images = torch.from_numpy(read_idx(f"{FASHION}/{prefix}-images-idx3-ubyte.gz").copy()).unsqueeze(1)
    labels = torch.from_numpy(read_idx(f"{FASHION}/{prefix}-labels-idx1-ubyte.gz").astype(np.int64))
    return images, labels


def make_model(name):
    """The same networks as cohort's built-ins (src/models/zoo.cpp)."""
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 10))
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(1, 32, 5), nn.MaxPool2d(2), nn.Conv2d(32, 64, 5), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(64 * 4 * 4, 1024), nn.ReLU(), nn.Linear(1024, 10))
    raise ValueError(name)


def median(values):
    return statistics.median(values) if values else float("nan")


def machine():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node()}: {os.cpu_count()} cores, {cpu}, torch {torch.__version__}"


def done_event(metrics_path):
    done = None
    with open(metrics_path) as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "done":
                done = event
    if done is None:
        raise RuntimeError(f"{metrics_path}: no done event")
    return done


def run(cmd, env=None, timeout=1800):
    started = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc, time.time() - started


def wait_all(procs, what, timeout=1800, shared_deadline=False):
    """Waits for every process; raises RuntimeError with their output when any failed. By default
    each process gets `timeout` seconds of its own and only a process past it is killed; with
    shared_deadline=True the timeout is one deadline for them all, and the first process past it
    has every process still running killed (a job whose processes wait on each other)."""
    deadline = time.time() + timeout
    outputs, failed = [], False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()) if shared_deadline else timeout)
        except subprocess.TimeoutExpired:
            for q in (procs if shared_deadline else [p]):
                if q.poll() is None:
                    q.kill()
            out, _ = p.communicate()
            failed = True
        outputs.append(out)
        failed = failed or p.returncode != 0
    if failed:
        raise RuntimeError(f"{what} failed:\n" + "\n".join(outputs))


def single_thread_env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


WARMUP = 5


def train_loop(model, images, labels, indices, batch, steps, world=1, device="cpu", autocast="off"):
    """cohort's loop in Python: gather by index, scale to [0, 1], forward, cross-entropy, backward,
    momentum SGD step, loss.item(). Returns (samples over all workers, seconds) for the steps after
    the first WARMUP, cohort's steady-state rule. On a GPU, as cohort does: the batch is assembled
    in host memory, pinned, and copied without blocking. autocast "bf16": the forward pass and the
    loss under torch.autocast in bfloat16, as cohort's --autocast bf16."""
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    per_epoch = len(indices) // batch
    timed, samples = 0.0, 0
    for step in range(steps):
        start = time.perf_counter()
        k = step % per_epoch
        idx = indices[k * batch:(k + 1) * batch]
        x = images.index_select(0, idx).float().div_(255.0)
        y = labels.index_select(0, idx)
        if device != "cpu":
            x = x.pin_memory().to(device, non_blocking=True)
            y = y.pin_memory().to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast == "bf16"):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
        if step >= WARMUP:
            timed += time.perf_counter() - start
            samples += len(idx) * world
    return samples, timed
