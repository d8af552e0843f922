#!/usr/bin/env python3
"""The Python twin of examples/library/resnet_ddp.cpp: the same ResNet (stem, three residual
stages with BatchNorm and skip connections, global average pooling), the same loop (batch 32 or
--batch per worker, momentum SGD, lr 0.05, zero_grad / forward / cross-entropy / backward / step),
under PyTorch's DistributedDataParallel (gloo), one thread per worker.

    build/cohort launch -n 2 -- .venv/bin/python bench/resnet_ddp.py --steps 60

Rank 0 prints one JSON line: samples_per_s over all workers, steps after the first 5.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import init_gloo_group, load_fashion  # noqa: E402


class ResidualBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (self.shortcut(x) if self.shortcut is not None else x))


class ResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.stage1 = ResidualBlock(16, 16, 1)
        self.stage2 = ResidualBlock(16, 32, 2)
        self.stage3 = ResidualBlock(32, 64, 2)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.stage3(self.stage2(self.stage1(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (every rank on cuda:0)")
    p.add_argument("--autocast", default="off", choices=["off", "bf16", "fp16"],
                   help="bf16 or fp16 (with torch.amp.GradScaler): the forward pass and the loss under "
                        "torch.autocast (the example's --autocast)")
    args = p.parse_args()
    torch.set_num_threads(1)
    # Under a launcher: DDP (gloo); alone: the plain loop, as the C++ example's single process.
    launched = "WORLD_SIZE" in os.environ
    if launched:
        init_gloo_group()
    rank, world = (dist.get_rank(), dist.get_world_size()) if launched else (0, 1)
    torch.manual_seed(1)
    images, labels = load_fashion("train")
    model = ResNet().to(args.device)
    if launched:
        model = DDP(model, device_ids=None if args.device == "cpu" else [next(model.parameters()).device])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)
    scaler = torch.amp.GradScaler(torch.device(args.device).type) if args.autocast == "fp16" else None
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1))
    mine = perm[rank::world][: len(labels) // world]
    timed, samples = 0.0, 0
    for step in range(args.steps):
        start = time.perf_counter()
        k = step % (len(mine) // args.batch)
        idx = mine[k * args.batch:(k + 1) * args.batch]
        x = images.index_select(0, idx).float().div_(255.0)
        y = labels.index_select(0, idx)
        if args.device != "cpu":
            x = x.pin_memory().to(args.device, non_blocking=True)
            y = y.pin_memory().to(args.device, non_blocking=True)
        opt.zero_grad()
        with torch.autocast(torch.device(args.device).type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        loss.item()
        if step >= 5:
            timed += time.perf_counter() - start
            samples += len(idx) * world
    if rank == 0:
        print(json.dumps({"samples_per_s": samples / timed, "steps": args.steps, "workers": world,
                          "device": args.device, "autocast": args.autocast}), flush=True)
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
