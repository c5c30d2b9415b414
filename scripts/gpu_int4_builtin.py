"""On the lent GPU: torch's built-in int4 product (tinygemm, verispec/kernels/int4_builtin.py)
against our Triton dequant-matmul and a bf16 F.linear, over one Qwen3-8B decode step's layers
(MLX affine 4-bit, group 64), each timed under a CUDA graph; plus its error against the exact
float64 reference (dequantize_reference), for both nibble orders of the packing (the code uses
the even column in the high nibble: this checks it), and whether row 0 alone equals row 0 of a
wider pass (the row invariance the Triton kernel has by construction).

  python3 scripts/gpu_int4_builtin.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_quant_tiles import LAYERS  # noqa: E402
from gpu_timing import graph_time_us  # noqa: E402
from verispec.quant.kernels import int4_builtin, matmul as qm  # noqa: E402
from verispec.quant import mlx_affine  # noqa: E402
from verispec.quant.packing import unpack_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--group", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, totals = [], {}
    for name, n, k, count in LAYERS:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed, scales, biases = mlx_affine.quantize(weight, mlx_affine.AffineSpec(4, args.group))
        del weight
        q = unpack_rows(packed, 4, k)
        sz = int4_builtin.scales_and_zeros(scales, biases, zero_point=False)
        tg = int4_builtin.pack(q)
        swapped = torch._convert_weight_to_int4pack((q[:, 1::2] << 4) | q[:, ::2], int4_builtin.inner_k_tiles(k))
        dense = qm.dequantize_reference(packed, scales, biases, 4, args.group, False).to(torch.bfloat16)
        row = {"layer": name, "n": n, "k": k}
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = qm.dequant_matmul_reference(x.double(), packed, scales, biases, 4, args.group)
            err = lambda y: float((y.double() - ref).norm() / ref.norm())  # noqa: E731
            y_tg = int4_builtin.matmul(x, tg, args.group, sz)
            row[f"err_builtin_M{m}"] = err(y_tg)
            row[f"err_swapped_M{m}"] = err(int4_builtin.matmul(x, swapped, args.group, sz))
            row[f"err_triton_M{m}"] = err(qm.dequant_matmul(x, packed, scales, biases, 4, args.group))
            row[f"err_bf16_M{m}"] = err(F.linear(x, dense))
            if m > 1:
                row[f"row0_invariant_builtin_M{m}"] = bool(torch.equal(int4_builtin.matmul(x[:1], tg, args.group, sz)[0],
                                                                       y_tg[0]))
            for label, fn in (("builtin", lambda: int4_builtin.matmul(x, tg, args.group, sz)),
                              ("triton", lambda: qm.dequant_matmul(x, packed, scales, biases, 4, args.group)),
                              ("bf16", lambda: F.linear(x, dense))):
                t = graph_time_us(fn, iters=10)
                row[f"us_{label}_M{m}"] = t
                totals[(label, m)] = totals.get((label, m), 0.0) + t * count
        rows.append(row)
        print(json.dumps(row), flush=True)
        del packed, scales, biases, q, sz, tg, swapped, dense
        torch.cuda.empty_cache()
    print("| M | builtin int4 step us | Triton int4 step us | bf16 F.linear step us | builtin vs bf16 | builtin vs Triton |")
    print("|---|---|---|---|---|---|")
    for m in (1, 4, 16):
        b, t, h = totals[("builtin", m)], totals[("triton", m)], totals[("bf16", m)]
        print(f"| {m} | {b:.0f} | {t:.0f} | {h:.0f} | {h / b:.2f}x | {t / b:.2f}x |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "int4_builtin.json").write_text(json.dumps(
            {"rows": rows, "step_us": {f"{label} M={m}": v for (label, m), v in totals.items()}}, indent=2))


if __name__ == "__main__":
    main()
