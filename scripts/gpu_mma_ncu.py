"""On the lent GPU, under Nsight Compute: one launch of each 4-bit product variant per Qwen3-8B
layer shape, for the profiler's stall reasons, occupancy and throughput (the products are
latency-bound where they should be bound by memory: this says on what).

  ncu --clock-control none -k regex:mma --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section LaunchStats --csv \
      python3 scripts/gpu_mma_ncu.py [--tiles 1x2x4n,2x1x4] > ncu.csv
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_mma_gemv import mma_call, parse_tiles  # noqa: E402
from verispec.quant.packing import pack_rows  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def layer_operands(name: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random 4-bit operands of a Qwen3-8B layer shape: packed words [N, K/8], scales and offsets
    [N, K/group] (bf16), on the GPU."""
    n, k = SHAPES[name]
    packed = pack_rows(torch.randint(0, 16, (n, k), device="cuda"), 4)
    scales = (torch.rand(n, k // group, device="cuda") * 0.01).bfloat16()
    offsets = (torch.randn(n, k // group, device="cuda") * 0.01).bfloat16()
    return packed, scales, offsets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiles", default="1x2x4n,1x4x4n,2x1x4")
    parser.add_argument("--layers", default="o,down,gate_up")
    parser.add_argument("--group", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.layers.split(","):
        packed, scales, offsets = layer_operands(name, args.group)
        x = torch.randn(1, SHAPES[name][1], device="cuda", dtype=torch.bfloat16)
        for item, (tiles, pdl) in zip(args.tiles.split(","), parse_tiles(args.tiles)):
            call = mma_call(tiles, pdl, args.group)
            call(x, packed, scales, offsets)  # compile outside the profiled launch
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{name} {item}")
            call(x, packed, scales, offsets)
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(f"# {name} {item}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
