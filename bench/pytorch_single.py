#!/usr/bin/env python3
"""Python PyTorch's single-process training loop, the comparison for cohort's `local` strategy.

The loop does what cohort's does: data preloaded as uint8 tensors, a batch gathered by index and
scaled to [0, 1], forward, cross-entropy, backward, optimizer step, loss.item(). Prints one JSON
line with samples_per_s over the steps after the first 5 (the same steady-state rule as cohort).
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

from common import load_fashion, make_model

WARMUP = 5


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    images, labels = load_fashion("train")
    model = make_model(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(labels), generator=gen)
    per_epoch = len(labels) // args.batch
    timed = 0.0
    samples = 0
    for step in range(args.steps):
        start = time.perf_counter()
        k = step % per_epoch
        idx = perm[k * args.batch:(k + 1) * args.batch]
        x = images.index_select(0, idx).float().div_(255.0)
        y = labels.index_select(0, idx)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
        if step >= WARMUP:
            timed += time.perf_counter() - start
            samples += len(idx)
    print(json.dumps({"samples_per_s": samples / timed, "steps": args.steps, "model": args.model}))


if __name__ == "__main__":
    main()
