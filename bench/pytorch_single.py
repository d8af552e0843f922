#!/usr/bin/env python3
"""Python PyTorch's single-process training loop, the comparison for cohort's `local` strategy.

The loop does what cohort's does: data preloaded as uint8 tensors, a batch gathered by index and
scaled to [0, 1], forward, cross-entropy, backward, optimizer step, loss.item(). Prints one JSON
line with samples_per_s over the steps after the first 5 (the same steady-state rule as cohort).
"""
import argparse
import json
import torch

from common import load_fashion, make_model, train_loop


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--autocast", default="off", choices=["off", "bf16"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    images, labels = load_fashion("train")
    model = make_model(args.model).to(args.device)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(args.seed))
    samples, timed = train_loop(model, images, labels, perm, args.batch, args.steps, device=args.device,
                                autocast=args.autocast)
    print(json.dumps({"samples_per_s": samples / timed, "steps": args.steps, "model": args.model,
                      "device": args.device, "autocast": args.autocast}))


if __name__ == "__main__":
    main()
