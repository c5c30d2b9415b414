"""On the lent GPU: the tensor-core 4-bit product (verispec/kernels/quant_mma.py) checked against
the float64 reference for every dtype / layout / group / width it takes (and row 0 alone == row 0
of a wider pass, bitwise), then timed in several tiles over one Qwen3-8B decode step's layers
against the Gluon GEMV (quant_gemv.py) and torch's int4 kernel (tinygemm), as
gpu_gemv_variants.py times them (a CUDA graph cycling through copies of each weight, so it is
read from memory, not L2).

  python3 scripts/gpu_mma_gemv.py [--out DIR] [--budget-s 300] [--tiles 1x2x4n,2x1x4] [--skip-check]

A tile is ROWTILESxBLOCKSxWARPS, with a trailing n for activations loaded in the step that uses
them rather than one step ahead (quant_mma.MmaTiles.prefetch_x=False), then + for programmatic
dependent launch (launch.PDL; without +, the tile is timed with it off).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_gemv_variants import LAYERS, Copies  # noqa: E402
from gpu_timing import cycle_time_us  # noqa: E402
from verispec.kernels import launch  # noqa: E402
from verispec.quant.kernels import int4_builtin, gemv as qg, matmul as qm, mma as quant_mma  # noqa: E402
from verispec.quant.packing import pack_rows  # noqa: E402

MS = (1, 2, 4, 8)


def random_operands(n: int, k: int, group: int, zero_point: bool, dtype: torch.dtype):
    """Random 4-bit values q [n, k] on the GPU, their words, scales and offsets in dtype
    (offsets: zero points, or MLX-like biases near -8 scales)."""
    q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int64)
    packed = pack_rows(q, 4)
    scales = (torch.rand(n, k // group, device="cuda") * 0.01 + 0.001).to(dtype)
    if zero_point:
        offsets = torch.randint(0, 16, (n, k // group), device="cuda").to(dtype)
    else:
        offsets = (-8 * scales.float() + torch.randn(n, k // group, device="cuda") * 1e-3).to(dtype)
    return q, packed, scales, offsets


def check_correctness() -> list[dict]:
    """Every dtype, layout and group against the float64 reference, ragged N, all widths."""
    rows = []
    torch.manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16):
        for zero_point in (False, True):
            for group in (32, 64, 128):
                for n, k in ((200, 512), (4096, 1024), (1000, 384)):
                    _, packed, scales, offsets = random_operands(n, k, group, zero_point, dtype)
                    x8 = torch.randn(8, k, device="cuda", dtype=dtype)
                    ref = qm.dequant_matmul_reference(x8.double(), packed, scales, offsets, 4, group, zero_point)
                    row = {"dtype": str(dtype), "zero_point": zero_point, "group": group, "n": n, "k": k}
                    try:
                        y1 = quant_mma.mma_gemv(x8[:1], packed, scales, offsets, 4, group, zero_point)
                        for m in (1, 3, 4, 8):
                            y = quant_mma.mma_gemv(x8[:m], packed, scales, offsets, 4, group, zero_point)
                            row[f"err_M{m}"] = float((y.double() - ref[:m]).norm() / ref[:m].norm())
                            row[f"row0_M{m}"] = bool(torch.equal(y[0], y1[0]))
                        # a dequantize-then-matmul baseline in the same dtype, for scale
                        wd = qm.dequantize_reference(packed, scales, offsets, 4, group, zero_point).to(dtype)
                        row["err_dequant_matmul"] = float(((x8 @ wd.T).double() - ref).norm() / ref.norm())
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def parse_tiles(text: str) -> list[tuple[quant_mma.MmaTiles, bool]]:
    """(tiles, programmatic dependent launch) per item: ROWTILESxBLOCKSxWARPS, then n (activations
    in-step), then + (programmatic dependent launch, launch.PDL)."""
    out = []
    for item in text.split(","):
        pdl = item.endswith("+")
        item = item.rstrip("+")
        rt, kb, w = (int(v) for v in item.rstrip("n").split("x"))
        out.append((quant_mma.MmaTiles(rt, kb, w, prefetch_x=not item.endswith("n")), pdl))
    return out


def mma_call(tiles: quant_mma.MmaTiles, pdl: bool, group: int):
    def call(x, p, s, b):
        previous, launch.PDL = launch.PDL, pdl  # read at launch (and so at capture)
        try:
            return quant_mma.mma_gemv(x, p, s, b, 4, group, tiles=tiles)
        finally:
            launch.PDL = previous
    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget-s", type=float, default=300)
    parser.add_argument("--tiles", default="2x2x4,1x2x4,2x1x4,1x4x4,2x2x8,4x1x4,1x2x8,4x2x4")
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    deadline = time.time() + args.budget_s
    results = {"check": [] if args.skip_check else check_correctness()}
    torch.manual_seed(0)
    step: dict[str, dict[int, float]] = {}
    for name, n, k, count in LAYERS:
        if time.time() > deadline:
            print("budget spent", flush=True)
            break
        layer = Copies(n, k, 4, args.group)
        x8 = torch.randn(max(MS), k, device="cuda", dtype=torch.bfloat16)
        cands = [(f"mma r{t.row_tiles} b{t.blocks} w{t.num_warps}" + ("" if t.prefetch_x else " xn")
                  + (" pdl" if pdl else ""), mma_call(t, pdl, args.group)) for t, pdl in parse_tiles(args.tiles)]
        cands.append(("gemv", lambda x, p, s, b: qg.gemv(x, p, s, b, 4, args.group)))
        cands.append(("tinygemm", None))
        for label, fn in cands:
            row = {"layer": name, "variant": label}
            try:
                for m in MS:
                    x = x8[:m].contiguous()
                    if label == "tinygemm":
                        calls = [lambda t=t, sz=sz: int4_builtin.matmul(x, t, args.group, sz)
                                 for t, sz in layer.tinygemm_copies()]
                    else:
                        calls = [lambda st=st: fn(x, *st) for st in layer.sets]
                    t = cycle_time_us(calls, iters=10)
                    row[f"us_M{m}"] = round(t, 2)
                    row[f"TBps_M{m}"] = round(layer.bytes / t / 1e6, 2)
                    step.setdefault(label, {}).setdefault(m, 0.0)
                    step[label][m] += t * count
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                step.pop(label, None)
            print(json.dumps(row), flush=True)
            results.setdefault("layers", []).append(row)
        layer.free()
    print(f"## 4-bit, group {args.group}: one Qwen3-8B step's linears (us, count-weighted sums)")
    for label, ms in sorted(step.items(), key=lambda kv: kv[1].get(1, 1e18)):
        if len(ms) == len(MS):
            print(f"  {label:24s} " + "  ".join(f"M{m} {ms[m]:6.0f}" for m in MS) + f"  (M4/M1 {ms[4] / ms[1]:.2f})")
    results["step_us"] = step
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "mma_gemv.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
