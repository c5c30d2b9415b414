"""On the lent GPU: what a layer's products cost as one persistent kernel with grid-wide barriers
between them, against one launch each (the bound for a persistent-kernel design, docs/gpu.md).

The chain o -> gate_up (SiLU in its epilogue) -> down of Qwen3-8B's shape, 4-bit MLX affine
weights in the fragment order (kernels/quant_frag.py), activations flowing from one product to the
next (no norm between them: only the kernels' cost is measured). `separate`: three `frag_gemv`
launches. `persistent`: one kernel of P programs that runs every o tile (program p takes tiles p,
p + P, ...), waits at a barrier for all programs, runs gate_up's tiles, waits, runs down's; the
tiles' code is the same `quant_frag.frag_tile`. Both under a CUDA graph cycling through copies of
the weights (read from memory). Checked: both give the same bits.

  python3 scripts/gpu_persistent_bound.py [--warps 8] [--rows 1,4]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_l2_prefetch import PREFETCH_L2_PTX  # noqa: E402
from gpu_timing import cycle_time_us  # noqa: E402
from verispec.quant.kernels import frag as qf  # noqa: E402
from verispec.quant.kernels.grid_sync import grid_barrier, resident_per_multiprocessor  # noqa: E402,F401
from verispec.quant.kernels.gemv import gl, gluon  # noqa: E402
from verispec.quant import mlx_affine  # noqa: E402


_PREFETCH_L2 = gl.constexpr(PREFETCH_L2_PTX)


@gluon.jit
def _prefetch_l2(ptr, nbytes):
    # one thread of the program asks the copy engine for nbytes (a multiple of 16) from ptr into L2
    gl.inline_asm_elementwise(_PREFETCH_L2, "=r,l,r", [ptr, nbytes], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_tiles(WQ, T, K: gl.constexpr, RT: gl.constexpr, TILES: gl.constexpr, P: gl.constexpr,
                    GROUP: gl.constexpr, EIGHTHS: gl.constexpr):
    """Program p's tiles of a product (p, p + P, ...): the first EIGHTHS/8 of each one's words and
    all its group terms asked into L2, so that they stream while the program waits at a barrier."""
    pid = gl.program_id(0)
    WORD_BYTES: gl.constexpr = RT * (K // 64) * 512
    PIECE: gl.constexpr = 16384
    PIECES: gl.constexpr = WORD_BYTES * EIGHTHS // 8 // PIECE
    TERM_BYTES: gl.constexpr = RT * (K // GROUP) * 64
    for t in range(pid, TILES, P):
        for piece in gl.static_range(PIECES):
            _prefetch_l2(WQ + t.to(gl.int64) * (WORD_BYTES // 4) + piece * (PIECE // 4), PIECE)
        _prefetch_l2(T + t.to(gl.int64) * (TERM_BYTES // 2), TERM_BYTES)


@gluon.jit
def _phase(X, WQ, T, Y, M, N: gl.constexpr, K: gl.constexpr, Y_COLS: gl.constexpr, TILES: gl.constexpr,
           KB: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, LT: gl.constexpr, D: gl.constexpr, RT: gl.constexpr,
           SILU: gl.constexpr, P: gl.constexpr, GROUP: gl.constexpr, DECODE_ASM: gl.constexpr, words0, terms0):
    """Program p's tiles of one product: p (its first step's weights already loaded), p + P, ..."""
    pid = gl.program_id(0)
    if pid < TILES:
        qf.frag_tile(X, WQ, T, Y, M, N, K, Y_COLS, pid, K, GROUP, False, KB, False, DECODE_ASM, LW, LX, LT, D, SILU,
                     RT, words0, terms0)
    for t in range(pid + P, TILES, P):
        qf.frag_tile(X, WQ, T, Y, M, N, K, Y_COLS, t, K, GROUP, False, KB, False, DECODE_ASM, LW, LX, LT, D, SILU,
                     RT)


@gluon.jit
def _chain_kernel(X, A, H, Y, M, W1, T1, W2, T2, W3, T3, COUNTER,
                  N1: gl.constexpr, K1: gl.constexpr, N2: gl.constexpr, K2: gl.constexpr, N3: gl.constexpr,
                  K3: gl.constexpr, TILES1: gl.constexpr, TILES2: gl.constexpr, TILES3: gl.constexpr,
                  KB1: gl.constexpr, LW1: gl.constexpr, LX1: gl.constexpr, LT1: gl.constexpr, D1: gl.constexpr,
                  RT1: gl.constexpr, KB2: gl.constexpr, LW2: gl.constexpr, LX2: gl.constexpr, LT2: gl.constexpr,
                  D2: gl.constexpr, RT2: gl.constexpr, KB3: gl.constexpr, LW3: gl.constexpr, LX3: gl.constexpr,
                  LT3: gl.constexpr, D3: gl.constexpr, RT3: gl.constexpr, P: gl.constexpr, GROUP: gl.constexpr,
                  DECODE_ASM: gl.constexpr, PREFETCH: gl.constexpr, MLP_ONLY: gl.constexpr,
                  L2_EIGHTHS: gl.constexpr = 0):
    """o -> gate_up -> down (MLP_ONLY: gate_up -> down, from X). Each program loads its next
    product's first weights before the barrier: after its tiles of this product, or (PREFETCH)
    before them, held in registers through them. L2_EIGHTHS: each program also asks for that share
    of its next product's words (and their terms) into L2 before the barrier."""
    pid = gl.program_id(0)
    if not MLP_ONLY:
        w, t = qf.frag_first_weights(W1, T1, gl.minimum(pid, TILES1 - 1), K1, GROUP, KB1, LW1, LT1, RT1)
        if PREFETCH:
            w2, t2 = qf.frag_first_weights(W2, T2, gl.minimum(pid, TILES2 - 1), K2, GROUP, KB2, LW2, LT2, RT2)
        qf.wait_for_previous_grid()
        _phase(X, W1, T1, A, M, N1, K1, N1, TILES1, KB1, LW1, LX1, LT1, D1, RT1, False, P, GROUP, DECODE_ASM, w, t)
        if not PREFETCH:
            w2, t2 = qf.frag_first_weights(W2, T2, gl.minimum(pid, TILES2 - 1), K2, GROUP, KB2, LW2, LT2, RT2)
        if L2_EIGHTHS > 0:
            _prefetch_tiles(W2, T2, K2, RT2, TILES2, P, GROUP, L2_EIGHTHS)
        grid_barrier(COUNTER, P)
        x2 = A
    else:
        w2, t2 = qf.frag_first_weights(W2, T2, gl.minimum(pid, TILES2 - 1), K2, GROUP, KB2, LW2, LT2, RT2)
        qf.wait_for_previous_grid()
        x2 = X
    if PREFETCH:
        w3, t3 = qf.frag_first_weights(W3, T3, gl.minimum(pid, TILES3 - 1), K3, GROUP, KB3, LW3, LT3, RT3)
    _phase(x2, W2, T2, H, M, N2, K2, N2 // 2, TILES2, KB2, LW2, LX2, LT2, D2, RT2, True, P, GROUP, DECODE_ASM, w2, t2)
    if not PREFETCH:
        w3, t3 = qf.frag_first_weights(W3, T3, gl.minimum(pid, TILES3 - 1), K3, GROUP, KB3, LW3, LT3, RT3)
    if L2_EIGHTHS > 0:
        _prefetch_tiles(W3, T3, K3, RT3, TILES3, P, GROUP, L2_EIGHTHS)
    grid_barrier(COUNTER, P)
    _phase(H, W3, T3, Y, M, N3, K3, N3, TILES3, KB3, LW3, LX3, LT3, D3, RT3, False, P, GROUP, DECODE_ASM, w3, t3)


def chain_persistent(x, a, h, y, fws, tiles, counter, programs: int, prefetch: bool = False, mlp_only: bool = False,
                     compile_only: bool = False, l2_eighths: int = 0):
    args = {}
    for i, (fw, t) in enumerate(zip(fws, tiles), 1):
        kb = qf.step_blocks(fw.in_features, t)
        lw, lx, lt = qf._layouts(t.num_warps, kb, t.row_tiles)
        args.update({f"N{i}": fw.out_features, f"K{i}": fw.in_features, f"TILES{i}": fw.words.shape[0] // t.row_tiles,
                     f"KB{i}": kb, f"LW{i}": lw, f"LX{i}": lx, f"LT{i}": lt, f"D{i}": t.depth, f"RT{i}": t.row_tiles})
    launch = _chain_kernel.warmup if compile_only else _chain_kernel[(programs,)]
    extra = {"grid": (programs,)} if compile_only else {}
    return launch(x, a, h, y, x.shape[0], fws[0].words, fws[0].terms, fws[1].words, fws[1].terms,
                  fws[2].words, fws[2].terms, counter, **args, P=programs, GROUP=fws[0].group_size,
                  DECODE_ASM=qf._decode_asm(False), PREFETCH=prefetch, MLP_ONLY=mlp_only,
                  L2_EIGHTHS=l2_eighths, num_warps=tiles[0].num_warps, launch_pdl=True, **extra)


def synchronize_or_exit(seconds: float = 20.0) -> None:
    """A kernel with a grid barrier whose programs cannot all be resident never ends: leave then."""
    timer = threading.Timer(seconds, lambda: (print(f"hang: no result after {seconds} s", flush=True),
                                               os._exit(3)))
    timer.start()
    torch.cuda.synchronize()
    timer.cancel()


def chain_separate(x, fws, tiles, mlp_only: bool = False):
    a = x if mlp_only else qf.frag_gemv(x, fws[0], tiles[0])
    h = qf.frag_gemv(a, fws[1], tiles[1], silu_gate=True)
    return qf.frag_gemv(h, fws[2], tiles[2])


def random_frag(n: int, k: int, group: int = 64) -> qf.FragWeights:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, scales, biases = mlx_affine.quantize(w, mlx_affine.AffineSpec(4, group))
    return qf.repack(packed, scales, biases, group)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--tiles", default="1x4x1x1,1x4x2x4,1x4x2x1;1x4x2x1,1x4x2x4,1x4x2x2",
                        help="per configuration (;-separated): o,gate_up,down tiles, one num_warps")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--l2", default="0", help="eighths of the next product's words each program asks into L2"
                                                  " before a barrier (0: none), comma-separated, at the most programs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    l2_eighths = [int(v) for v in args.l2.split(",")]
    torch.manual_seed(0)
    sets = [(random_frag(4096, 4096), random_frag(24576, 4096), random_frag(4096, 12288)) for _ in range(args.copies)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")  # grid_sync.grid_barrier's
    results = []
    for config in args.tiles.split(";"):
        tiles = [qf.FragTiles(*(int(v) for v in t.split("x"))) for t in config.split(",")]
        assert len({t.num_warps for t in tiles}) == 1, "one num_warps a configuration"
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            a = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)
            h = torch.empty(m, 12288, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)
            row = {"tiles": config, "rows": m}
            defaults = [qf.tiles_for(4096, 4096, m), qf.tiles_for(24576, 4096, m), qf.tiles_for(4096, 12288, m)]
            for mlp_only in (False, True):
                name = "mlp" if mlp_only else "chain"
                row[f"{name}_separate_us"] = round(cycle_time_us(
                    [lambda s=s: chain_separate(x, s, tiles, mlp_only) for s in sets], 10), 2)
                row[f"{name}_separate_default_tiles_us"] = round(cycle_time_us(
                    [lambda s=s: chain_separate(x, s, defaults, mlp_only) for s in sets], 10), 2)
                ref = chain_separate(x, sets[0], tiles, mlp_only)
                for prefetch in (False, True):
                    fitting = []
                    for programs in (sms, 2 * sms, 3 * sms, 4 * sms):
                        # the compiled kernel depends on P: ask the driver how many of that one fit
                        kernel = chain_persistent(x, a, h, y, sets[0], tiles, counter, programs, prefetch, mlp_only,
                                                  compile_only=True)
                        if resident_per_multiprocessor(kernel, tiles[0].num_warps) * sms >= programs:
                            fitting.append(programs)
                    runs = [(p, 0) for p in fitting] + [(fitting[-1], e) for e in l2_eighths if e and fitting]
                    for programs, eighths in runs:
                        if eighths:
                            kernel = chain_persistent(x, a, h, y, sets[0], tiles, counter, programs, prefetch,
                                                      mlp_only, compile_only=True, l2_eighths=eighths)
                            if resident_per_multiprocessor(kernel, tiles[0].num_warps) * sms < programs:
                                continue
                        label = f"{name}_P{programs}{'_early' if prefetch else ''}{f'_l2x{eighths}' if eighths else ''}"
                        counter.zero_()  # the barrier's targets are multiples of P: start from one
                        chain_persistent(x, a, h, y, sets[0], tiles, counter, programs, prefetch, mlp_only,
                                         l2_eighths=eighths)
                        synchronize_or_exit()
                        row[f"{label}_same_bits"] = bool(torch.equal(y, ref))
                        row[f"{label}_us"] = round(cycle_time_us(
                            [lambda s=s: chain_persistent(x, a, h, y, s, tiles, counter, programs, prefetch, mlp_only,
                                                          l2_eighths=eighths) for s in sets], 10), 2)
                print(json.dumps(row), flush=True)
            results.append(row)
    if args.out:
        Path(args.out, "persistent_bound.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
