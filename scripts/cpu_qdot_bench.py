#!/usr/bin/env python3
"""Time the CPU integer-dot product (quant/kernels/qdot.c `qdot_linear`) at one activation row on
SmolLM2's vocabulary head (49,152 x 576, 8-bit blocks) and a layer's gate/up (3,072 x 576, 4-bit),
with the weights in cache (one copy, reused) and streamed from memory (copies cycled, --mib of them
in all, as a decode step reads every weight once): milliseconds a product and weight bytes a second.

    python scripts/cpu_qdot_bench.py [--threads 2] [--mib 256]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's verispec
from verispec.quant.kernels import cpu_qdot  # noqa: E402

SHAPES = {"head 49,152 x 576, 8-bit": (49152, 576, 8), "gate/up 3,072 x 576, 4-bit": (3072, 576, 4)}


def random_blocks(n: int, k: int, bits: int, gen: torch.Generator) -> torch.Tensor:
    """A packed weight [n, k] of random codes with float16 scale 0.0625 and offset -0.0625 in every block."""
    per = cpu_qdot.BLOCK_BYTES[bits]
    blocks = torch.randint(0, 256, (n, k // 32, per), dtype=torch.uint8, generator=gen)
    blocks[..., 0:2] = torch.tensor([0x00, 0x2C], dtype=torch.uint8)
    blocks[..., 2:4] = torch.tensor([0x00, 0xAC], dtype=torch.uint8)
    return blocks.view(n, -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mib", type=int, default=256, help="MiB of weight copies cycled past the caches (default 256)")
    p.add_argument("--seconds", type=float, default=1.0, help="timing per case (default 1 s)")
    args = p.parse_args()
    if cpu_qdot.failure() is not None:
        raise SystemExit(f"cpu_qdot_bench: no kernel: {cpu_qdot.failure()}")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.threads} threads\n\n| product | in cache | from memory ({args.mib} MiB of copies) |\n|---|---|---|")
    for name, (n, k, bits) in SHAPES.items():
        x = torch.randn(1, k, generator=gen).half()
        cells = []
        size = n * (k // 32) * cpu_qdot.BLOCK_BYTES[bits]
        for copies in (1, -(-args.mib * 2 ** 20 // size)):
            weights = [random_blocks(n, k, bits, gen) for _ in range(copies)]
            for w in weights:
                cpu_qdot.matmul(x, w, bits, n)
            start, reps = time.perf_counter(), 0
            while time.perf_counter() - start < args.seconds:
                cpu_qdot.matmul(x, weights[reps % copies], bits, n)
                reps += 1
            ms = (time.perf_counter() - start) / reps * 1e3
            cells.append(f"{ms:.3f} ms, {weights[0].numel() / ms / 1e6:.1f} GB/s")
        print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
