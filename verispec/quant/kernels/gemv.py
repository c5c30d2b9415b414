"""Bandwidth-first product for group-quantized weights at decode and verify widths:
y[M, N] = x[M, K] @ dequant(W)[N, K]^T for M <= MAX_ROWS, read straight from the checkpoint's
layout (packed little-endian words [N, K*bits/32] int32, scales / offsets [N, K/group]): no second
copy of the weight, no conversion at load.

Written in Gluon (Triton's explicit-layout dialect, `triton.experimental.gluon`) because its
speed comes from where each value lives: a thread holds MB activation rows x R weight rows x
CHUNK consecutive words, so the words arrive as 16-byte loads, each activation value loaded is
reused for R weight rows, and every reduction but the last stays inside the thread. Plain Triton
chose layouts that spread one word's values over threads and went through shared memory for each
(two Triton forms measured 0.2-1.0 TB/s; this one 2.1-3.9 TB/s, docs/benchmarks.md).

Arithmetic, per value: one LOP3 ors the value's bits, left where they are in the word's 16-bit
half (bit b*j), into the mantissa of 2**(23 - b*j), whose last place there is worth 1 (a float
equal to 2**(23 - b*j) + q, exact); one subtraction leaves q, and one FMA adds q * x. No shift,
no conversion instruction, no scaling of x. A word's values share a group, so its scale and offset
apply once per chunk of words: y = sum_chunks s * sum q x + o * sum x (zero point: s * (sum q x -
z * sum x)), all in float32.

Exactness: every activation row runs the same instructions on its own registers, and the kernel
is built without floating-point contraction (explicit FMAs only, `enable_fp_fusion=False`), so a
row's result does not depend on M or on the other rows: row 0 of a verify pass equals row 0 decoded
alone, bit for bit (checked on the H200 by tests/quant/kernels/test_gemv.py). The tile
configuration depends on the bit width only.

`matmul.dequant_matmul_reference` is the plain-torch definition it is tested against.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

# gl, gluon and triton are None without Gluon
from verispec.kernels.launch import gl, gluon, pdl_enabled, platform_reason, triton

if gluon is not None:
    from verispec.kernels.launch import wait_for_previous_grid

MAX_ROWS = 8  # widest pass it takes; wider ones use matmul.py (flat in M) or a dequantized GEMM
SUPPORTED_BITS = (2, 4, 8)  # a value never straddles a word or a 16-bit half
ROWS_PER_PROGRAM = 4  # activation rows per program (MB); more spill registers


@dataclasses.dataclass(frozen=True)
class GemvTiles:
    """A thread holds R weight rows x CHUNK words; TR threads of a warp go along rows, 32/TR along
    words; all warps go along words."""
    r: int
    tr: int
    num_warps: int = 4


# measured on the H200 over one Qwen3-8B step's layers (docs/benchmarks.md)
TILES = {8: GemvTiles(r=8, tr=2), 4: GemvTiles(r=4, tr=4), 2: GemvTiles(r=4, tr=4)}


def _chunk(bits: int, group_size: int) -> int:
    """Words per thread along K: up to 4 (a 16-byte load), never across a group."""
    words_per_group = group_size // (32 // bits)
    return 4 if words_per_group % 4 == 0 else 2 if words_per_group % 2 == 0 else 1


def _step(bits: int, group_size: int, tiles: GemvTiles) -> int:
    """Words per row per iteration."""
    return (32 // tiles.tr) * tiles.num_warps * _chunk(bits, group_size)


def unsupported_reason(device: torch.device, dtype: torch.dtype, bits: int, group_size: int) -> str | None:
    """Why a layer cannot take this kernel (None: it can)."""
    if reason := platform_reason(device):
        return reason
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations in {str(dtype).removeprefix('torch.')}"
    if bits not in SUPPORTED_BITS:
        return f"{bits}-bit weights (the GEMV takes {', '.join(map(str, SUPPORTED_BITS))})"
    if group_size % (32 // bits):
        return f"group size {group_size} (not a whole number of {32 // bits}-value words)"
    step, words_per_group = _step(bits, group_size, TILES[bits]), group_size // (32 // bits)
    if step % words_per_group and words_per_group % step:
        return f"group size {group_size} ({words_per_group} words: neither a divisor nor a multiple of {step})"
    return None


if gluon is not None:

    @gluon.jit
    def _and_or(a, mask, magic):
        # (a & mask) | magic in one LOP3 (ptxas splits the two-constant form into two)
        return gl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r", [a, mask, magic],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _gemv_kernel(X, WQ, S, O, Y, IDX, M, N, stride_xm, stride_wn, stride_sn, stride_ym, stride_we, stride_se,
                     K: gl.constexpr, BITS: gl.constexpr, GROUP: gl.constexpr, ZERO_POINT: gl.constexpr,
                     MB: gl.constexpr, R: gl.constexpr, TR: gl.constexpr, CHUNK: gl.constexpr,
                     EVEN_N: gl.constexpr, EVEN_K: gl.constexpr, EXPERTS: gl.constexpr, ROWS_PER_X: gl.constexpr,
                     GRID_WAIT: gl.constexpr):
        # EXPERTS: program (n tile, pair p) multiplies expert IDX[p]'s matrix (WQ/S/O [E, N, ...]) by
        # x row p // ROWS_PER_X into y row p (MB = 1; M counts pairs)
        TC: gl.constexpr = 32 // TR
        WC: gl.constexpr = gl.num_warps()
        BN: gl.constexpr = R * TR
        BC: gl.constexpr = TC * WC
        L4: gl.constexpr = gl.BlockedLayout([MB, R, 1, CHUNK], [1, TR, TC, 1], [1, 1, WC, 1], [3, 2, 1, 0])
        LW: gl.constexpr = gl.SliceLayout(0, L4)  # words [BN, BC, CHUNK]
        LX: gl.constexpr = gl.SliceLayout(1, L4)  # activations [MB, BC, CHUNK]
        LA: gl.constexpr = gl.SliceLayout(3, L4)  # per-chunk sums [MB, BN, BC]
        LS: gl.constexpr = gl.SliceLayout(0, LA)  # scales and offsets [BN, BC]
        PER_WORD: gl.constexpr = 32 // BITS
        WORDS: gl.constexpr = K // PER_WORD
        WPG: gl.constexpr = GROUP // PER_WORD  # words per group
        STEP: gl.constexpr = BC * CHUNK  # words per row per iteration
        HALF: gl.constexpr = PER_WORD // 2  # values per 16-bit half of a word
        MASK: gl.constexpr = (1 << BITS) - 1
        pid_n = gl.program_id(0)
        if EXPERTS:
            if GRID_WAIT:
                wait_for_previous_grid()  # the expert ids are the previous kernels' output
            pair = gl.program_id(1)
            expert = gl.load(IDX + pair).to(gl.int64)
            WQ = WQ + expert * stride_we
            S = S + expert * stride_se
            O = O + expert * stride_se
            m0 = pair // ROWS_PER_X  # the x row
            y0 = pair
            x_rows = (M - 1) // ROWS_PER_X + 1
        else:
            m0 = gl.program_id(1) * MB
            y0 = m0
            x_rows = M

        nw = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW)))
        cw = gl.arange(0, BC, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
        jw = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
        word_w = gl.expand_dims(gl.expand_dims(cw, 0), 2) * CHUNK + gl.expand_dims(gl.expand_dims(jw, 0), 1)
        row_w = gl.expand_dims(gl.expand_dims(nw, 1), 2)
        w_ptr = WQ + row_w.to(gl.int64) * stride_wn + word_w

        ns = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LS))
        cs = gl.arange(0, BC, layout=gl.SliceLayout(0, LS))
        group_s = (gl.expand_dims(cs, 0) * CHUNK) // WPG
        s_off = gl.expand_dims(ns, 1).to(gl.int64) * stride_sn + group_s

        mx = m0 + gl.arange(0, MB, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))
        cx = gl.arange(0, BC, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))
        jx = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))
        word_x = gl.expand_dims(gl.expand_dims(cx, 0), 2) * CHUNK + gl.expand_dims(gl.expand_dims(jx, 0), 1)
        row_x = gl.expand_dims(gl.expand_dims(mx, 1), 2)
        x_ptr = X + row_x * stride_xm + word_x * PER_WORD

        acc = gl.zeros([MB, BN, BC], gl.float32, layout=LA)
        w_mask = (row_w < N) & (word_w < WORDS)
        if EVEN_N and EVEN_K:
            words = gl.load(w_ptr)
        else:
            words = gl.load(w_ptr, mask=w_mask, other=0)
        if GRID_WAIT and not EXPERTS:
            wait_for_previous_grid()  # only the first words (immutable weights) were read above
        for w0 in range(0, WORDS, STEP):
            # the next tile's words are requested before this one is used, so a load is always in flight
            if EVEN_N and EVEN_K:
                nxt = gl.load(w_ptr + (w0 + STEP), mask=(w0 + STEP) < WORDS)
            else:
                nxt = gl.load(w_ptr + (w0 + STEP), mask=(row_w < N) & (word_w + (w0 + STEP) < WORDS), other=0)
            if EVEN_N and EVEN_K:
                s = gl.load(S + s_off + w0 // WPG).to(gl.float32)
                o = gl.load(O + s_off + w0 // WPG).to(gl.float32)
            else:
                s_mask = (gl.expand_dims(ns, 1) < N) & ((gl.expand_dims(cs, 0) * CHUNK + w0) < WORDS)
                s = gl.load(S + s_off + w0 // WPG, mask=s_mask, other=0.0).to(gl.float32)
                o = gl.load(O + s_off + w0 // WPG, mask=s_mask, other=0.0).to(gl.float32)
            s = gl.expand_dims(s, 0)
            o = gl.expand_dims(o, 0)
            x_mask = (row_x < x_rows) & (word_x + w0 < WORDS)
            hi = words >> 16
            part = gl.zeros([MB, BN, BC, CHUNK], gl.float32, layout=L4)
            xs = gl.zeros([MB, BC, CHUNK], gl.float32, layout=LX)
            for i in gl.static_range(PER_WORD):
                x_i = gl.load(x_ptr + w0 * PER_WORD + i, mask=x_mask, other=0.0).to(gl.float32)
                xs += x_i
                # the value's bits stay where they are (bit BITS*j of its 16-bit half, j = i % HALF)
                # and are or-ed into the mantissa of 2**(23 - BITS*j), whose last place there is 1:
                # the float reads 2**(23 - BITS*j) + q, and subtracting the power of two leaves q
                src = words if i < HALF else hi
                bits = _and_or(src, gl.full(src.shape, MASK << (BITS * (i % HALF)), gl.int32, LW),
                               gl.full(src.shape, (150 - BITS * (i % HALF)) << 23, gl.int32, LW))  # 2**(23-BITS*j)
                q = bits.to(gl.float32, bitcast=True) - (1 << (23 - BITS * (i % HALF))) * 1.0  # exact
                part = gl.fma(gl.expand_dims(q, 0), gl.expand_dims(x_i, 1), part)
            part_c = gl.sum(part, axis=3)  # [MB, BN, BC]
            xs_c = gl.expand_dims(gl.convert_layout(gl.sum(xs, axis=2), gl.SliceLayout(1, LA)), 1)  # [MB, 1, BC]
            if ZERO_POINT:
                acc = gl.fma(s, gl.fma(-o, xs_c, part_c), acc)
            else:
                acc = gl.fma(s, part_c, gl.fma(o, xs_c, acc))
            words = nxt
        y = gl.sum(acc, axis=2)  # [MB, BN]
        my = y0 + gl.arange(0, MB, layout=gl.SliceLayout(1, gl.SliceLayout(2, LA)))
        ny = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, LA)))
        y_ptr = Y + gl.expand_dims(my, 1) * stride_ym + gl.expand_dims(ny, 0)
        gl.store(y_ptr, y.to(Y.dtype.element_ty), mask=(gl.expand_dims(my, 1) < M) & (gl.expand_dims(ny, 0) < N))


@functools.cache
def _launch_shape(bits: int, group_size: int, n: int, k: int, tiles: GemvTiles) -> tuple[int, int, bool, bool]:
    """(rows per program BN, chunk words, N divides, K divides) for a weight [n, k]."""
    bn = tiles.r * tiles.tr
    return bn, _chunk(bits, group_size), n % bn == 0, (k // (32 // bits)) % _step(bits, group_size, tiles) == 0


def _check(x: torch.Tensor, bits: int, group_size: int, what: str) -> None:
    reason = unsupported_reason(x.device, x.dtype, bits, group_size)
    if reason or x.shape[-1] % group_size:
        raise ValueError(f"{what}: {reason or f'K={x.shape[-1]} is not a multiple of the group size {group_size}'}")


def _contiguous(x, packed, scales, offsets):
    """The operands as the kernel reads them: contiguous, the words as int32."""
    packed = packed.view(torch.int32) if packed.dtype != torch.int32 else packed
    return x.contiguous(), packed.contiguous(), scales.contiguous(), offsets.contiguous()


def gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
         group_size: int, zero_point: bool = False, tiles: GemvTiles | None = None,
         rows_per_program: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS); packed [N, K*bits/32] int32; scales, offsets [N, K/group_size]
    -> y [M, N] in x's dtype, accumulated in float32."""
    m, k = x.shape
    n = packed.shape[0]
    _check(x, bits, group_size, "gemv.gemv")
    x, packed, scales, offsets = _contiguous(x, packed, scales, offsets)
    tiles = tiles or TILES[bits]
    bn, chunk, even_n, even_k = _launch_shape(bits, group_size, n, k, tiles)
    mb = rows_per_program or min(triton.next_power_of_2(m), ROWS_PER_PROGRAM)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, mb))
    pdl = pdl_enabled(x.device)
    _gemv_kernel[grid](x, packed, scales, offsets, y, y, m, n, x.stride(0), packed.stride(0), scales.stride(0),
                       y.stride(0), 0, 0, K=k, BITS=bits, GROUP=group_size, ZERO_POINT=zero_point, MB=mb,
                       R=tiles.r, TR=tiles.tr, CHUNK=chunk, EVEN_N=even_n, EVEN_K=even_k, EXPERTS=False,
                       ROWS_PER_X=1, GRID_WAIT=pdl, num_warps=tiles.num_warps, enable_fp_fusion=False,
                       launch_pdl=pdl)
    return y


def expert_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                experts: torch.Tensor, bits: int, group_size: int, rows_per_x: int = 1,
                zero_point: bool = False) -> torch.Tensor:
    """Routed experts' products read in place: y[p] = x[p // rows_per_x] @ dequant(W[experts[p]])^T.
    x [T, K]; packed [E, N, K*bits/32] int32; scales, offsets [E, N, K/group]; experts [P] (device
    ids: no host sync, capturable) -> y [P, N] in x's dtype. Each pair is its own program, so a
    pair's result does not depend on the others."""
    t, k = x.shape
    e, n, _ = packed.shape
    p = experts.numel()
    _check(x, bits, group_size, "gemv.expert_gemv")
    if p > t * rows_per_x:
        raise ValueError(f"gemv.expert_gemv: {p} pairs for {t} rows of {rows_per_x} pairs")
    x, packed, scales, offsets = _contiguous(x, packed, scales, offsets)
    tiles = TILES[bits]
    bn, chunk, even_n, even_k = _launch_shape(bits, group_size, n, k, tiles)
    y = torch.empty(p, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, bn), p)
    pdl = pdl_enabled(x.device)
    _gemv_kernel[grid](x, packed, scales, offsets, y, experts.to(torch.int32).contiguous(), p, n, x.stride(0),
                       packed.stride(1), scales.stride(1), y.stride(0), packed.stride(0), scales.stride(0),
                       K=k, BITS=bits, GROUP=group_size, ZERO_POINT=zero_point, MB=1, R=tiles.r, TR=tiles.tr,
                       CHUNK=chunk, EVEN_N=even_n, EVEN_K=even_k, EXPERTS=True, ROWS_PER_X=rows_per_x,
                       GRID_WAIT=pdl, num_warps=tiles.num_warps, enable_fp_fusion=False, launch_pdl=pdl)
    return y
