"""On the lent GPU: how fast can a kernel stream a packed 4-bit weight [N, K/8] int32 from memory,
by access pattern, with nothing else to do (each thread folds its words into one value)? Tells
whether the 4-bit products (quant_mma.py) are held back by how they read or by what they compute.

Patterns (a program takes BN rows and walks K; per load instruction a warp reads):
  rows8   - 8 rows x 64 bytes (4 lanes x 16 bytes each), as quant_mma's fragments do
  rows2   - 2 rows x 256 bytes
  row1    - 1 row x 512 bytes (lanes along K)
Each with several warps per program, rows per program and words per thread per step.

  python3 scripts/gpu_stream_pattern.py
"""
from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import cycle_time_us  # noqa: E402
from verispec.quant.kernels.gemv import gl, gluon  # noqa: E402

LANES_ALONG_ROWS = {"rows8": 8, "rows2": 2, "row1": 1}


@gluon.jit
def _stream(W, OUT, N, KW: gl.constexpr, BN: gl.constexpr, BKW: gl.constexpr, L: gl.constexpr, UNROLL: gl.constexpr):
    pid = gl.program_id(0)
    r = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, BKW, layout=gl.SliceLayout(0, L))
    ptr = W + gl.expand_dims(r.to(gl.int64), 1) * KW + gl.expand_dims(c, 0)
    acc = gl.zeros([BN, BKW], gl.int32, layout=L)
    for k0 in range(0, KW, BKW * UNROLL):
        for u in gl.static_range(UNROLL):
            acc ^= gl.load(ptr + k0 + u * BKW)
    gl.store(OUT + gl.expand_dims(pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L)), 1) * BKW
             + gl.expand_dims(c, 0), acc)


def run(n: int, k: int, pattern: str, warps: int, rows: int, vec_words: int, unroll: int, copies):
    lr = LANES_ALONG_ROWS[pattern]
    lk = 32 // lr
    # warps stacked along rows first, then along K
    wr = max(1, min(warps, rows // lr))
    wk = warps // wr
    bkw = vec_words * lk * wk
    kw = k // 8
    if rows % (lr * wr) or kw % (bkw * unroll):
        return None
    layout = gl.BlockedLayout([1, vec_words], [lr, lk], [wr, wk], [1, 0])
    out = torch.empty(n * bkw, dtype=torch.int32, device="cuda")

    def call(w):
        _stream[(n // rows,)](w, out, n, KW=kw, BN=rows, BKW=bkw, L=layout, UNROLL=unroll, num_warps=warps)
    return cycle_time_us([lambda w=w: call(w) for w in copies], iters=10)


def main() -> None:
    results = []
    for name, n, k in (("gate_up", 24576, 4096), ("down", 4096, 12288), ("o", 4096, 4096)):
        nbytes = n * k // 2
        count = max(2, (320 << 20) // nbytes + 1)
        copies = [torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda") for _ in range(count)]
        src = copies[0].view(-1)
        dst = torch.empty_like(src)
        t_copy = cycle_time_us([lambda: dst.copy_(src)], iters=10)
        print(f"{name}: torch copy of the weight {2 * nbytes / t_copy / 1e6:.2f} TB/s (read + write)", flush=True)
        for pattern, warps, rows, vec, unroll in itertools.product(("rows8", "rows2", "row1"), (4, 8), (16, 32),
                                                                   (4,), (1, 2, 4)):
            try:
                t = run(n, k, pattern, warps, rows, vec, unroll, copies)
            except Exception as exc:  # a shape the layout cannot tile
                print(f"  {pattern} w{warps} r{rows} u{unroll}: {type(exc).__name__} {str(exc)[:120]}")
                continue
            if t is None:
                continue
            row = {"layer": name, "pattern": pattern, "warps": warps, "rows": rows, "unroll": unroll,
                   "us": round(t, 2), "TBps": round(nbytes / t / 1e6, 2)}
            results.append(row)
            print(json.dumps(row), flush=True)
        del copies
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "stream_pattern.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
