"""On the lent GPU, under Nsight Compute: one launch of the fragment-order 4-bit product
(kernels/quant_frag.py) per Qwen3-8B layer shape and tile, for the profiler's stall reasons,
occupancy and memory throughput (what bounds the small layers, ~7 us where streaming the same
bytes takes ~4).

  ncu --clock-control none -k regex:_frag_kernel --section SpeedOfLight --section Occupancy \\
      --section WarpStateStats --section SchedulerStats --section LaunchStats --csv \\
      python3 scripts/gpu_frag_ncu.py [--layers o,down] [--tiles 1x8x1x1] [--rows 1] > ncu.csv
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_mma_ncu import SHAPES, layer_operands  # noqa: E402
from verispec.quant.kernels import frag as qf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="o,down,gate_up")
    parser.add_argument("--tiles", default="", help="BLOCKSxWARPSxDEPTHxROWTILES,... (default: tiles_for)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--group", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.layers.split(","):
        n, k = SHAPES[name]
        fw = qf.repack(*layer_operands(name, args.group), args.group)
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        tiles = [qf.FragTiles(*(int(v) for v in t.split("x"))) for t in args.tiles.split(",") if t] or [None]
        for t in tiles:
            qf.frag_gemv(x, fw, t)  # compile outside the profiled launch
            torch.cuda.synchronize()
            qf.frag_gemv(x, fw, t)
            torch.cuda.synchronize()
            print(f"# {name} {t or qf.tiles_for(n, k)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
