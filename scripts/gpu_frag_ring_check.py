"""On the lent GPU: the shared-memory ring form of the fragment-order 4-bit product
(kernels/quant_frag_ring.py) against the register pipeline (quant_frag._frag_kernel), bit for bit,
over shapes, widths, dtypes and offset forms, SiLU-gated or not.

  python3 scripts/gpu_frag_ring_check.py [--stages 2,3,4,8]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_mma_gemv import random_operands  # noqa: E402
from verispec.kernels import quant_frag as qf  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default="2,3,4,8")
    args = parser.parse_args()
    torch.manual_seed(0)
    bad = total = 0
    for dtype in (torch.bfloat16, torch.float16):
        for zero_point in (False, True):
            for n, k, group in ((4096, 4096, 64), (1008, 384, 128), (256, 12288, 64), (48, 4096, 64)):
                _, packed, scales, offsets = random_operands(n, k, group, zero_point, dtype)
                fw = qf.repack(packed, scales, offsets, group, zero_point)
                x8 = torch.randn(8, k, device="cuda", dtype=dtype)
                for base in (qf.FragTiles(1, 8, 1, 1), qf.FragTiles(1, 4, 1, 4), qf.FragTiles(2, 4, 1, 2)):
                    for stages in (int(s) for s in args.stages.split(",")):
                        ring = qf.FragTiles(base.blocks, base.num_warps, 1, base.row_tiles, stages)
                        for m in (1, 4, 8):
                            for gate in (False, True):
                                want = qf.frag_gemv(x8[:m], fw, base, silu_gate=gate)
                                got = qf.frag_gemv(x8[:m], fw, ring, silu_gate=gate)
                                total += 1
                                if not torch.equal(want, got):
                                    bad += 1
                                    print(f"DIFFER {dtype} zp={zero_point} n={n} k={k} g={group} {ring} m={m} "
                                          f"gate={gate}: max {float((want.float() - got.float()).abs().max()):.3g}",
                                          flush=True)
    print(f"## ring == register pipeline: {total - bad}/{total}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
