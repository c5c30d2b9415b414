#!/usr/bin/env python3
"""On the lent GPU: one Qwen3-8B decode step's 8-bit layers (MLX affine, group 64: merged qkv, o,
merged gate_up, down x 36, lm_head x 1), each timed under a CUDA graph, with the 8-bit GEMV
kernel (kernels/int8_gemv.py), the tensor-core dequant-matmul (kernels/quant_matmul.py) and a
bf16 F.linear of the same shapes, at 1, 4 and 8 rows; the error of each against the float64
reference, and whether row 0 alone equals row 0 of M rows (bitwise).

  python3 scripts/gpu_int8_gemv.py [--group 64] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_quant_tiles import LAYERS  # noqa: E402
from gpu_timing import graph_time_us  # noqa: E402
from verispec.kernels import int8_gemv  # noqa: E402
from verispec.kernels import quant_matmul as qm  # noqa: E402
from verispec.quant import mlx_affine  # noqa: E402

WIDTHS = (1, 4, 8)


def sweep(group: int) -> None:
    """M = 1 step time over the layer shapes for a few output-tile widths and warp counts."""
    layers = []
    for _, n, k, count in LAYERS:
        packed, scales, biases = mlx_affine.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,
                                                     mlx_affine.AffineSpec(8, group))
        layers.append((packed, scales, biases, torch.randn(1, k, device="cuda", dtype=torch.bfloat16), count))
    print("| block_n | warps | M=1 step us |\n|---|---|---|")
    for block_n in (16, 32, 64):
        for warps in (2, 4, 8):
            total = sum(count * graph_time_us(lambda p=p, s=s, b=b, x=x: int8_gemv.gemv(x, p, s, b, group, block_n=block_n,
                                                                                        num_warps=warps), iters=5)
                        for p, s, b, x, count in layers)
            print(f"| {block_n} | {warps} | {total:.0f} |", flush=True)
    del layers
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--group", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, totals = [], {}
    for name, n, k, count in LAYERS:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed, scales, biases = mlx_affine.quantize(weight, mlx_affine.AffineSpec(8, args.group))
        del weight
        dense = qm.dequantize_reference(packed, scales, biases, 8, args.group, False).to(torch.bfloat16)
        row = {"layer": name, "n": n, "k": k, "bytes": packed.numel() * 4 + scales.numel() * 4}
        x_all = torch.randn(max(WIDTHS), k, device="cuda", dtype=torch.bfloat16)
        alone = int8_gemv.gemv(x_all[:1], packed, scales, biases, args.group)
        for m in WIDTHS:
            x = x_all[:m]
            ref = qm.dequant_matmul_reference(x.double(), packed, scales, biases, 8, args.group)
            err = lambda y: float((y.double() - ref).norm() / ref.norm())  # noqa: E731
            y = int8_gemv.gemv(x, packed, scales, biases, args.group)
            row[f"err_gemv_M{m}"] = err(y)
            row[f"err_triton_M{m}"] = err(qm.dequant_matmul(x, packed, scales, biases, 8, args.group))
            row[f"err_bf16_M{m}"] = err(F.linear(x, dense))
            row[f"row0_invariant_M{m}"] = bool(torch.equal(y[:1], alone))
            for label, fn in (("gemv", lambda: int8_gemv.gemv(x, packed, scales, biases, args.group)),
                              ("triton", lambda: qm.dequant_matmul(x, packed, scales, biases, 8, args.group)),
                              ("bf16", lambda: F.linear(x, dense))):
                t = graph_time_us(fn, iters=10)
                row[f"us_{label}_M{m}"] = t
                totals[(label, m)] = totals.get((label, m), 0.0) + t * count
        row["gemv_GBps_M1"] = row["bytes"] / row["us_gemv_M1"] / 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
        del packed, scales, biases, dense
        torch.cuda.empty_cache()
    sweep(args.group)
    print("| M | 8-bit GEMV step us | tensor-core kernel step us | bf16 F.linear step us | GEMV vs bf16 | GEMV vs tensor-core |")
    print("|---|---|---|---|---|---|")
    for m in WIDTHS:
        g, t, h = totals[("gemv", m)], totals[("triton", m)], totals[("bf16", m)]
        print(f"| {m} | {g:.0f} | {t:.0f} | {h:.0f} | {h / g:.2f}x | {t / g:.2f}x |", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "int8_gemv.json").write_text(json.dumps(
            {"rows": rows, "step_us": {f"{label} M={m}": v for (label, m), v in totals.items()}}, indent=2))


if __name__ == "__main__":
    main()
