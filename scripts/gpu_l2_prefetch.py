"""On the lent GPU: how much a 4-bit product (kernels/quant_frag.py, its chosen tiles) gains when its
weights were prefetched into L2 while the kernels before it ran (which leave the memory idle:
RMSNorm, q/k preparation, attention and its combine take ~0.5 ms of a 2.2 ms step).

Per Qwen3-8B layer, one CUDA graph cycling through copies of the weight (so they come from memory):
- `dram`: the product alone; `l2`: the same weight every call (L2-hot, the bound);
- `gap D, prefetch F`: a kernel that waits D us (the small kernels' stand-in) and meanwhile asks
  for the first F of every row tile's bytes with `cp.async.bulk.prefetch.L2`, then the product;
  printed as the pair's time less the same wait without prefetch (so: the product's time).

  python3 scripts/gpu_l2_prefetch.py [--gaps 0,2,5,9] [--fractions 0,0.5,1] [--programs 132]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_gemv_variants import LAYERS, Copies  # noqa: E402
from gpu_timing import cycle_time_us, graph_time_us  # noqa: E402
from verispec.quant.kernels import frag as qf  # noqa: E402


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


# one thread of the program asks the copy engine for $2 bytes (a multiple of 16) from $1 into L2
# (also used by gpu_persistent_bound.py's Gluon kernel)
PREFETCH_L2_PTX = ("{\n.reg .pred p;\n.reg .b32 t;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
                   "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}")
_PREFETCH_L2 = tl.constexpr(PREFETCH_L2_PTX)


@triton.jit
def _prefetch(ptr, nbytes):
    tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_and_prefetch(W, T, tiles, w_tile_bytes, w_bytes, t_tile_bytes, t_bytes, wait_ns,
                       PIECE: tl.constexpr, PROGRAMS: tl.constexpr):
    start = _now()
    for tile in range(tl.program_id(0), tiles, PROGRAMS):
        for offset in range(0, w_bytes, PIECE):
            _prefetch(W + tile.to(tl.int64) * w_tile_bytes + offset, tl.minimum(PIECE, w_bytes - offset))
        if t_bytes > 0:
            _prefetch(T + tile.to(tl.int64) * t_tile_bytes, t_bytes)
    while _now() - start < wait_ns:
        pass


def wait_and_prefetch(fw: qf.FragWeights, wait_us: float, fraction: float, programs: int) -> None:
    words = fw.words.view(torch.uint8)  # [tiles, NB * 512]
    terms = fw.terms.view(fw.terms.shape[0], -1).view(torch.uint8)
    tiles = words.shape[0]
    w_tile, t_tile = fw.words[0].numel() * 4, terms.shape[1]
    w_bytes = int(w_tile * fraction) // 16 * 16
    t_bytes = t_tile if fraction > 0 else 0
    _wait_and_prefetch[(programs,)](words, terms, tiles, w_tile, w_bytes, t_tile, t_bytes, int(wait_us * 1000),
                                    PIECE=16384, PROGRAMS=programs, num_warps=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gaps", default="0,2,5,9")
    parser.add_argument("--fractions", default="0.25,0.5,1")
    parser.add_argument("--programs", type=int, default=132)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gaps = [float(g) for g in args.gaps.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    torch.manual_seed(0)
    rows = []
    for name, n, k, _count in LAYERS[:4]:
        layer = Copies(n, k, 4, 64)
        frags = [qf.repack(p, s, b, 64) for p, s, b in layer.sets]
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        row = {"layer": name, "MB": round(layer.bytes / 1e6, 1), "copies": len(frags)}
        row["dram"] = round(cycle_time_us([lambda fw=fw: qf.frag_gemv(x, fw) for fw in frags]), 2)
        row["l2"] = round(graph_time_us(lambda: qf.frag_gemv(x, frags[0])), 2)
        for gap in gaps:
            alone = cycle_time_us([lambda fw=fw: wait_and_prefetch(fw, gap, 0.0, args.programs) for fw in frags])
            row[f"wait{gap:g}"] = round(alone, 2)
            for fraction in [0.0] + fractions:
                def pair(fw, gap=gap, fraction=fraction):
                    wait_and_prefetch(fw, gap, fraction, args.programs)
                    qf.frag_gemv(x, fw)
                t = cycle_time_us([lambda fw=fw: pair(fw) for fw in frags])
                row[f"gap{gap:g}_f{fraction:g}"] = round(t - alone, 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del frags
        layer.free()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "l2_prefetch.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
