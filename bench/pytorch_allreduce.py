#!/usr/bin/env python3
"""Raw allreduce bandwidth of torch.distributed (gloo), the comparison for allreduce_bandwidth.cpp.
Run under a launcher that sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; args: sizes in MB."""
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from common import init_gloo_group


def main():
    torch.set_num_threads(1)
    init_gloo_group()
    for arg in sys.argv[1:]:
        mb = float(arg)
        numel = int(mb * 1024 * 1024 / 4)
        reps = 10 if mb > 16 else 30
        t = torch.ones(numel)
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        if dist.get_rank() == 0:
            print(json.dumps({"mb": mb, "median_s": median, "gb_per_s": numel * 4 / median / 1e9}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
