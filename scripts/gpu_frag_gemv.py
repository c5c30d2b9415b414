"""On the lent GPU: the fragment-order 4-bit product (verispec/kernels/quant_frag.py) checked
against the float64 reference for every dtype / offset form / group / width it takes (and row 0
alone == row 0 of a wider pass, bitwise), then timed over one Qwen3-8B decode step's layers next
to the first tensor-core kernel (quant_mma.py, its own tiles), as gpu_mma_gemv.py times
them (a CUDA graph cycling through copies of each weight, so it is read from memory, not L2).

  python3 scripts/gpu_frag_gemv.py [--out DIR] [--tiles 1x8x1x1,1x4x1x4] [--skip-check] [--budget-s 400]

A tile here is BLOCKSxWARPS[xDEPTH[xROWTILES]] (quant_frag.FragTiles); programmatic dependent launch as
launch.PDL. The check compiles every tiling for every shape (~200 s on a fresh machine).
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
from gpu_mma_gemv import random_operands  # noqa: E402
from gpu_timing import cycle_time_us  # noqa: E402
from verispec.quant.kernels import frag_dequantize, frag as qf, matmul as qm, mma as quant_mma  # noqa: E402

MS = (1, 2, 4, 8)


def check_correctness() -> list[dict]:
    rows = []
    torch.manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16):
        for zero_point in (False, True):
            for group in (64, 128):
                for n, k in ((200, 512), (4096, 1024), (1000, 384), (48, 4096)):
                    if k % group:
                        continue
                    q, packed, scales, offsets = random_operands(n, k, group, zero_point, dtype)
                    x8 = torch.randn(8, k, device="cuda", dtype=dtype)
                    ref = qm.dequant_matmul_reference(x8.double(), packed, scales, offsets, 4, group, zero_point)
                    row = {"dtype": str(dtype), "zero_point": zero_point, "group": group, "n": n, "k": k}
                    try:
                        fw = qf.repack(packed, scales, offsets, group, zero_point)
                        row["unpack_equal"] = bool(torch.equal(frag_dequantize.unpack_fragments(fw).long(), q))
                        for tiles in (qf.FragTiles(), qf.FragTiles(1, 4), qf.FragTiles(4, 4), qf.FragTiles(2, 8),
                                      qf.FragTiles(1, 8, 2), qf.FragTiles(2, 4, 2), qf.FragTiles(1, 4, 1, 2),
                                      qf.FragTiles(1, 2, 2, 4)):
                            y1 = qf.frag_gemv(x8[:1], fw, tiles)
                            for m in (1, 3, 4, 8):
                                y = qf.frag_gemv(x8[:m], fw, tiles)
                                err = float((y.double() - ref[:m]).norm() / ref[:m].norm())
                                row[f"err_M{m}"] = max(row.get(f"err_M{m}", 0.0), err)
                                row["row0_same"] = row.get("row0_same", True) and bool(torch.equal(y[0], y1[0]))
                        wd = qm.dequantize_reference(packed, scales, offsets, 4, group, zero_point).to(dtype)
                        row["err_dequant_matmul"] = float(((x8 @ wd.T).double() - ref).norm() / ref.norm())
                        worst = max(row[f"err_M{m}"] for m in (1, 3, 4, 8))
                        row["ok"] = (row["unpack_equal"] and row["row0_same"]
                                     and worst <= 2 * row["err_dequant_matmul"] + 1e-5)
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                        row["ok"] = False
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiles", default="1x4x1x1,1x8x1x1,1x2x2x1,1x8x2x1,1x4x1x2,1x8x1x2,1x2x2x2,1x4x2x2,"
                                           "1x4x1x4,1x2x2x4,1x8x2x2")
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--budget-s", type=float, default=200)
    parser.add_argument("--shapes", default=None,
                        help="NAME=NxK,... instead of the Qwen3-8B step's layers (e.g. a layer's K split in"
                             " two as 2N x K/2: the bound on a split-K form's gain, before its reduction)")
    parser.add_argument("--rows", default="1,2,4,8", help="widths M to time")
    args = parser.parse_args()
    ms = tuple(int(m) for m in args.rows.split(","))
    layers = LAYERS
    if args.shapes:
        layers = [(name, *(int(v) for v in nk.split("x")), 1)
                  for name, nk in (item.split("=") for item in args.shapes.split(","))]
    deadline = time.time() + args.budget_s
    results = {"check": [] if args.skip_check else check_correctness()}
    if results["check"]:
        bad = [r for r in results["check"] if not r["ok"]]
        print(f"## correctness: {len(results['check']) - len(bad)}/{len(results['check'])} ok", flush=True)
    torch.manual_seed(0)
    step: dict[str, dict[int, float]] = {}
    # BLOCKSxWARPS[xDEPTH[xROWTILES]]
    tiles = [qf.FragTiles(*(int(v) for v in t.split("x"))) for t in args.tiles.split(",")]
    for name, n, k, count in layers:
        if time.time() > deadline:
            print("budget spent", flush=True)
            break
        layer = Copies(n, k, 4, args.group)
        frags = [qf.repack(p, s, b, args.group) for p, s, b in layer.sets]
        x8 = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
        cands = [] if args.shapes else [("mma (tiles_for)", [lambda x, st=st: quant_mma.mma_gemv(x, *st, 4, args.group)
                                                              for st in layer.sets])]
        for t in tiles:
            cands.append((f"frag b{t.blocks} w{t.num_warps} d{t.depth} r{t.row_tiles}",
                          [lambda x, fw=fw, t=t: qf.frag_gemv(x, fw, t) for fw in frags]))
        for label, fns in cands:
            row = {"layer": name, "variant": label}
            try:
                for m in ms:
                    x = x8[:m].contiguous()
                    t_us = cycle_time_us([lambda f=f: f(x) for f in fns], iters=10)
                    row[f"us_M{m}"] = round(t_us, 2)
                    row[f"TBps_M{m}"] = round(layer.bytes / t_us / 1e6, 2)
                    step.setdefault(label, {}).setdefault(m, 0.0)
                    step[label][m] += t_us * count
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                step.pop(label, None)
            print(json.dumps(row), flush=True)
            results.setdefault("layers", []).append(row)
        del frags
        layer.free()
    print(f"## 4-bit, group {args.group}: one Qwen3-8B step's linears (us, count-weighted sums)")
    for label, ms in sorted(step.items(), key=lambda kv: kv[1].get(1, 1e18)):
        if len(ms) == len(MS):
            print(f"  {label:24s} " + "  ".join(f"M{m} {ms[m]:6.0f}" for m in MS) + f"  (M4/M1 {ms[4] / ms[1]:.2f})")
    results["step_us"] = step
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "frag_gemv.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
