#!/usr/bin/env python3
"""Make a TorchScript model that `cohort train --model FILE.pt` trains from C++.

    .venv/bin/python examples/make_torchscript.py model.pt            # an nn.Sequential (pipeline-able)
    .venv/bin/python examples/make_torchscript.py model.pt --custom   # a module with its own forward()

The module takes a [B, 1, 28, 28] float batch and returns [B, 10] logits. A top-level
nn.Sequential becomes one cohort layer per child, so it can later be cut into pipeline stages.
Run it with the torch 2.11 that `make build` installs into .venv (scripts/setup.sh): the same
LibTorch as cohort's, so the file's TorchScript is one cohort reads.
"""
import argparse

import torch
from torch import nn


class SmallNet(nn.Module):
    """A network with its own forward(): trained as one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 14 * 14, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.conv(x)))
        x = nn.functional.max_pool2d(x, 2)
        return self.head(torch.flatten(x, 1))


def sequential() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="where to write the .pt file")
    parser.add_argument("--custom", action="store_true", help="a module with its own forward()")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = SmallNet() if args.custom else sequential()
    torch.jit.script(model).save(args.output)
    count = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.output}: {type(model).__name__}, {count} parameters")


if __name__ == "__main__":
    main()
