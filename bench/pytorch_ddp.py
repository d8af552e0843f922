#!/usr/bin/env python3
"""PyTorch's DistributedDataParallel (gloo) on the same loop as cohort's allreduce strategy, on the CPU
or on a GPU (--device cuda: the ranks share it, gloo staging the CUDA tensors, as cohort's --device cuda).

Run under any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, e.g.
    build/cohort launch -n 2 -- .venv/bin/python bench/pytorch_ddp.py --model cnn --steps 150
Each rank takes the strided shard of the epoch's permutation (as cohort's sampler does). Rank 0
prints one JSON line: samples_per_s over all workers (steps after the first 5).
"""
import argparse
import json
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common import init_gloo_group, load_fashion, make_model, train_loop


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="cnn")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: every rank on cuda:0 (gloo over CUDA tensors)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    init_gloo_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    images, labels = load_fashion("train")
    model = make_model(args.model).to(args.device)
    model = DDP(model, bucket_cap_mb=args.bucket_mb,
                device_ids=None if args.device == "cpu" else [next(model.parameters()).device])
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1))
    mine = perm[rank::world][: len(labels) // world]
    samples, timed = train_loop(model, images, labels, mine, args.batch, args.steps, world, device=args.device)
    if rank == 0:
        print(json.dumps({"samples_per_s": samples / timed, "steps": args.steps, "model": args.model,
                          "workers": world}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
