"""Tensor-core product for 4-bit group-quantized weights over words repacked in the mma's
fragment order, with the groups' scales applied to the mma's sums (decode and verify widths):
y[M, N] = x[M, K] @ dequant(W)[N, K]^T for M <= MAX_ROWS, written in Gluon.

Why another form than mma.py: that kernel decodes every weight to its dequantized value
(w = s*q + o, two packed float instructions per pair of values) and pairs the activations' halves
into the B operand (three PRMTs a word); with ~24 instructions per word of 8 weights it runs out
of issue slots at about half the memory's speed. Here:
- the words are repacked once, at load time (`repack`), so that the 16 bytes a thread loads hold
  exactly its A fragments for the 4 mma k-steps of one 64-value block, and the physical order of
  a thread's 16 activations is the B fragments' order: no register moves for either operand;
- a weight is decoded by one LOP3 per pair into 128 + q (bfloat16; 1024 + q in float16), exactly,
  with nothing else: the mma sums D = sum_k (128 + q_k) x_k over a block, and the block's
  contribution is s*D + c*X in float32, with X = sum_k x_k (an mma with an all-ones A over the
  same B) and c = o - 128*s (MLX affine: w = s*q + o) or c = -(z + 128)*s (zero point: w =
  (q - z)*s). That is sum_k (s*q_k + o) x_k without rounding the weights: ~16 instructions a
  word in the compiled loop (docs/benchmarks.md).

Precision: D carries the 128*X term, so ~7 of float32's 24 bits go to cancellation (10 in
float16): still far below the activations' rounding. Row independence (speculative verify ==
plain decode): every output element is its own mma column and its own chain of float32 adds in
a fixed order, whatever M is.

Repacked layout (`repack`), per 16-row tile and 64-value block, 128 words: lane (g, t) = (lane //
4, lane % 4) holds words c = 0..3, word c = the A fragment of k-step c: nibble i + 4h (i = 0..3,
h = 0..1) is the value at row g + 8*(i % 2) and block position 16t + 4c + 2*(i // 2) + h, which
the mma sees at k = 16c + 8*(i // 2) + 2t + h. Scales and offsets: `FragWeights.terms`.
Programs take 1, 2 or 4 tiles of 16 rows (`FragTiles.row_tiles`): one activation load serves
them all, which keeps a verify pass's activation traffic below the weights' on wide layers.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

# gl, gluon and triton are None without Gluon
from verispec.kernels import launch
from verispec.kernels.launch import gl, gluon, triton
from verispec.quant.kernels import mma
from verispec.quant.packing import unpack_rows

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from verispec.kernels.launch import wait_for_previous_grid

MAX_ROWS = 8  # the mma's N side
TILE_ROWS = 16  # weight rows a program takes (the mma's M side)
GATE_CHUNK = 8  # gate rows (then as many up rows) a tile of a SiLU-gated product holds: rows g and g + 8 of a thread
BLOCK = 64  # values a thread group of 4 lanes covers per row and k-step group: 4 lanes x 16
WORDS_PER_BLOCK = TILE_ROWS * BLOCK // 8  # 128: 32 lanes x 4 words
MAX_ROW_TILES = 4  # the repacked tiles are padded to a multiple of this: a program never reads past them


@dataclasses.dataclass(frozen=True)
class FragTiles:
    """A program takes 16*row_tiles rows (one activation load serves them all); its num_warps warps
    split K, each `blocks` 64-value blocks a step, with `depth` steps' loads in flight."""
    blocks: int = 2
    num_warps: int = 4
    depth: int = 1
    row_tiles: int = 1


@dataclasses.dataclass
class FragWeights:
    """4-bit weights in the fragment order (`repack`): words [N16/16, K/64, 128] int32; terms
    [N16/16, K/group, 8, 4] in the activations' dtype: (scale of row g, of row g + 8, offset of
    row g, of row g + 8) of each 16-row tile (offsets: unsigned zero points when zero_point);
    N16 = N rounded up to 16*MAX_ROW_TILES (the extra rows are zeros)."""
    words: torch.Tensor
    terms: torch.Tensor
    out_features: int
    in_features: int
    group_size: int
    zero_point: bool


def unsupported_reason(device: torch.device, dtype: torch.dtype, bits: int, group_size: int,
                       in_features: int) -> str | None:
    """Why a layer cannot take this kernel (None: it can)."""
    if reason := mma.tensor_core_reason(device, dtype, bits):
        return reason
    if group_size % BLOCK:
        return f"group size {group_size} (a block of {BLOCK} values must share one scale)"
    if in_features % BLOCK:
        return f"{in_features} input features (not a multiple of {BLOCK})"
    return mma.gpu_reason(device)


@functools.cache
def fragment_positions() -> tuple[torch.Tensor, torch.Tensor]:
    """(row in tile, position in block) of nibble j of word c of lane (g, t): two [8, 4, 4, 8]
    int64 tensors over (g, t, c, j)."""
    g = torch.arange(8).view(8, 1, 1, 1)
    t = torch.arange(4).view(1, 4, 1, 1)
    c = torch.arange(4).view(1, 1, 4, 1)
    j = torch.arange(8).view(1, 1, 1, 8)
    i, h = j % 4, j // 4
    row = g + 8 * (i % 2) + 0 * (t + c)
    position = 16 * t + 4 * c + 2 * (i // 2) + h + 0 * g
    return row, position


def repack(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
           zero_point: bool = False, dtype: torch.dtype | None = None) -> FragWeights:
    """Checkpoint words (packed [N, K/8] int32, value k at bits 4*(k % 8) of word k // 8) and
    their scales / offsets [N, K/group] -> the fragment order. Plain torch, on packed's device."""
    n, k = packed.shape[0], packed.shape[1] * 8
    if k % BLOCK or group_size % BLOCK:
        raise ValueError(f"frag.repack: K {k} and group size {group_size} must be multiples of {BLOCK}")
    n16 = -(-n // (TILE_ROWS * MAX_ROW_TILES)) * TILE_ROWS * MAX_ROW_TILES
    tiles, blocks = n16 // TILE_ROWS, k // BLOCK
    row, position = (p.to(packed.device) for p in fragment_positions())
    shifts = 4 * torch.arange(8, device=packed.device)
    words = torch.zeros(tiles, blocks, 8, 4, 4, dtype=torch.int32, device=packed.device)
    chunk = max(1, (1 << 22) // (TILE_ROWS * k))  # tiles at a time: ~4M values of int64 temporaries
    for first in range(0, -(-n // TILE_ROWS), chunk):
        rows = packed[first * TILE_ROWS:(first + chunk) * TILE_ROWS].view(torch.int32)
        q = unpack_rows(rows, 4, k).to(torch.int64)  # [rows, K]
        count = -(-q.shape[0] // TILE_ROWS)
        if q.shape[0] != count * TILE_ROWS:  # the last tile's missing rows are zeros
            q = torch.cat([q, q.new_zeros(count * TILE_ROWS - q.shape[0], k)])
        q = q.view(count, TILE_ROWS, blocks, BLOCK).transpose(1, 2)  # [T, B, 16 rows, 64]
        packed_words = (q[:, :, row, position] << shifts).sum(-1)  # [T, B, g, t, c] in [0, 2**32)
        words[first:first + count] = torch.where(packed_words >= 2**31, packed_words - 2**32, packed_words)
    dtype = dtype or scales.dtype

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # [N, K/group] -> [T, K/group, 2 (row g / g + 8), 8 (g)]
        t = t.to(dtype)
        if n16 != n:
            t = torch.cat([t, t.new_zeros(n16 - n, t.shape[1])])
        return t.view(tiles, 2, 8, -1).permute(0, 3, 1, 2)

    terms = torch.stack([per_tile(scales), per_tile(offsets)], 2)  # [T, K/group, 2 (s, o), 2, 8]
    terms = terms.reshape(tiles, -1, 4, 8).transpose(2, 3).contiguous()  # [T, K/group, 8 (g), 4]
    return FragWeights(words.reshape(tiles, blocks, WORDS_PER_BLOCK).contiguous(), terms, n, k, group_size,
                       zero_point)


def _powers(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


@functools.cache
def _layouts(num_warps: int, blocks: int, row_tiles: int):
    """Linear layouts of what a step loads: words [WS*KB, RT, 8 (g), 4 (t), 4 (c)], activation pairs
    [WS*KB, 8 (row), 4 (t), 8] (int32: 2 values each) and group terms [WS*KB, RT, 8 (g), 2] (int32:
    2 values each). Batch entry (block) b is on warp b % WS, as the batched mma layout tiles it;
    lane = 4g + t (the terms are the same for a row's 4 lanes); a program's row tiles in registers."""
    kb = [[num_warps * b, 0, 0, 0, 0] for b in _powers(blocks)]
    rt = [[0, b, 0, 0, 0] for b in _powers(row_tiles)]
    warps = [[b, 0, 0, 0, 0] for b in _powers(num_warps)]
    lanes = [[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 0, 4, 0, 0]]
    words = gl.DistributedLinearLayout([[0, 0, 0, 0, 1], [0, 0, 0, 0, 2]] + rt + kb, lanes, warps, [],
                                       [num_warps * blocks, row_tiles, 8, 4, 4])
    acts = gl.DistributedLinearLayout([[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]] + [[b[0], 0, 0, 0] for b in kb],
                                      [[0] + lane[2:] for lane in lanes], [[b[0], 0, 0, 0] for b in warps], [],
                                      [num_warps * blocks, 8, 4, 8])
    terms = gl.DistributedLinearLayout([[0, 0, 0, 1]] + [b[:4] for b in rt + kb],
                                       [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
                                       [b[:4] for b in warps], [], [num_warps * blocks, row_tiles, 8, 2])
    return words, acts, terms


@functools.cache
def _decode_asm(half: bool) -> str:
    """PTX: outputs $0..$7 (nibble j -> magic + q in $j), input $8 the word."""
    return mma.nibble_pairs_asm("0x64006400" if half else "0x43004300")


@functools.cache
def decode_pairs_asm(half: bool) -> str:
    """PTX for `_decode_pairs` (`block_sums(..., PACKED=True)`): outputs $0..$3 the 32-bit pairs
    (nibble i, nibble i + 4) as magic + q (one LOP3 each: bits 4i and 16 + 4i masked into the
    magic pair), input $4 the word ($5..$11 are the same word: one input a packed value)."""
    body = f"{{\n.reg .b32 m, t;\nmov.b32 m, {'0x64006400' if half else '0x43004300'};\n"
    body += "lop3.b32 $0, $4, 0x000F000F, m, 0xEA;\n"
    for i in range(1, 4):
        body += f"shr.b32 t, $4, {4 * i};\nlop3.b32 ${i}, t, 0x000F000F, m, 0xEA;\n"
    return body + "}"


# two 16-bit floats in a 32-bit word -> each as float32: (bf16: the bits shifted up; f16: cvt)
_WIDEN_BF16 = "shl.b32 $0, $2, 16;\nand.b32 $1, $2, 0xFFFF0000;"
_WIDEN_F16 = "{\n.reg .b16 l, h;\nmov.b32 {l, h}, $2;\ncvt.f32.f16 $0, l;\ncvt.f32.f16 $1, h;\n}"


if gluon is not None:
    _MAX_ROWS = gl.constexpr(MAX_ROWS)

    @gluon.jit
    def _decode_word(word, ASM: gl.constexpr, OUT: gl.constexpr):
        """word -> its 8 nibbles as magic + q in OUT (value j in result j)."""
        return gl.inline_asm_elementwise(ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [word], dtype=(OUT.value,) * 8,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _decode_pairs(words, ASM: gl.constexpr, OUT: gl.constexpr):
        """words [...] -> their nibbles as magic + q in OUT, [..., 2 (i1), 2 (i0), 2 (h)]: nibble
        i + 4h, i = i0 + 2 i1. One asm a word takes its 8 values as 4 packed 32-bit registers, the
        pair (h = 0, 1) in each: the mma's A registers as they are. ptxas then writes the LOP3s
        straight into the mma's operand registers where the 16-bit outputs of `_decode_word` cost
        a move a pair (offline SASS: 1,448 -> 1,240 instructions and 168 -> 134 registers for
        gate_up), but the launched products did not get faster (docs/benchmarks.md): `block_sums`
        takes it with PACKED, the persistent kernel of stream_chain.py does."""
        eight = gl.join(words, words)  # the word once an output value: the asm reads the first
        eight = gl.join(eight, eight)
        eight = gl.join(eight, eight)
        return gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [eight], dtype=OUT.value, is_pure=True,
                                         pack=8)

    @gluon.jit
    def _halves(word, OUT: gl.constexpr):
        """A 32-bit word -> its low and high 16-bit values in OUT."""
        return gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [word], dtype=(OUT.value,) * 2,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _widen(word, HALF: gl.constexpr):
        """A 32-bit word of two 16-bit floats -> (low, high) as float32."""
        if HALF:
            return gl.inline_asm_elementwise(_WIDEN_F16_ASM, "=r,=r,r", [word], dtype=(gl.float32, gl.float32),
                                             is_pure=True, pack=1)
        else:
            return gl.inline_asm_elementwise(_WIDEN_BF16_ASM, "=r,=r,r", [word], dtype=(gl.float32, gl.float32),
                                             is_pure=True, pack=1)

    _WIDEN_F16_ASM = gl.constexpr(_WIDEN_F16)
    _WIDEN_BF16_ASM = gl.constexpr(_WIDEN_BF16)

    @gluon.jit
    def _load_step(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block, b0, NB: gl.constexpr, GROUP: gl.constexpr,
                   MASKED: gl.constexpr):
        """The words, activation pairs and group terms of the BT blocks from block b0 on."""
        if MASKED:
            words = gl.load(w_ptr + b0 * 128, mask=w_block + b0 < NB, other=0)
            xi = gl.load(x_ptr + b0 * 32, mask=x_block + b0 < NB, other=0)
            terms = gl.load(t_ptr + ((t_block + b0) * 64 // GROUP) * 16, mask=t_block + b0 < NB, other=0)
        else:
            words = gl.load(w_ptr + b0 * 128)
            xi = gl.load(x_ptr + b0 * 32)
            terms = gl.load(t_ptr + ((t_block + b0) * 64 // GROUP) * 16)
        return words, xi, terms

    @gluon.jit
    def _load_at(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block, step, STEPS: gl.constexpr, BT: gl.constexpr,
                 NB: gl.constexpr, GROUP: gl.constexpr, EVEN: gl.constexpr):
        """Step `step`'s loads; past the last step: the last step again (EVEN) or nothing (masked)."""
        if EVEN:
            return _load_step(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block, gl.minimum(step, STEPS - 1) * BT,
                              NB, GROUP, False)
        else:
            return _load_step(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block, step * BT, NB, GROUP, True)

    @gluon.jit
    def _accumulate(acc, words, xi, terms, ones, zero, ZERO_POINT: gl.constexpr, DECODE_ASM: gl.constexpr,
                    DT: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, LS: gl.constexpr):
        """acc [BT, 16*RT, 8] += each block's s*D + c*X (see the module's docstring)."""
        return block_sums(acc, words, terms, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS, xi=xi, ones=ones)

    @gluon.jit
    def activation_operand(xi, DT: gl.constexpr, LB: gl.constexpr):
        """Activation pairs xi [BT, 8 rows, 4 (t), 8] (int32) -> the mma's B operand [BT, 64, 8] (LB)."""
        BT: gl.constexpr = xi.shape[0]
        MT: gl.constexpr = xi.shape[1]
        # pair p of lane t = positions 16t + 2p, 16t + 2p + 1; p = 2c + h -> k 16c + 8h + 2t + j
        lo, hi = _halves(xi, DT)
        b = gl.reshape(gl.join(lo, hi), [BT, MT, 4, 4, 2, 2])  # [BT, m, t, c, h, j]
        b = gl.reshape(gl.permute(b, (0, 3, 4, 2, 5, 1)), [BT, 64, MT])
        return gl.convert_layout(b, LB, assert_trivial=True)

    @gluon.jit
    def block_sums(acc, words, terms, zero, ZERO_POINT: gl.constexpr, DECODE_ASM: gl.constexpr, DT: gl.constexpr,
                   LA: gl.constexpr, LB: gl.constexpr, LS: gl.constexpr, xi=None, ones=None, b=None, xs=None,
                   PACKED: gl.constexpr = False):
        """acc [BT, 16*RT, 8] + each batch entry's s*D + c*X for its words [BT, RT, 8, 4, 4] against
        the activations: pairs xi (with `ones`, the all-ones A that sums them), or the B operand b
        [BT, 64 (mma k), 8] (LB) and its sums over k, xs (see the module's docstring)."""
        BT: gl.constexpr = words.shape[0]
        RT: gl.constexpr = words.shape[1]
        HALF: gl.constexpr = DT == gl.float16
        MAGIC: gl.constexpr = 1024.0 if HALF else 128.0
        # [BT, rt, g, t, c, i1, i0, h] (nibble i + 4h, i = i0 + 2 i1): row 16 rt + 8 i0 + g, k 16c +
        # 8 i1 + 2t + h. A join's new dimension is a thread's fastest register: the last one is h,
        # so that the pair (h = 0, 1) is one LOP3's result and one 32-bit register of the A operand
        if PACKED:  # DECODE_ASM from decode_pairs_asm
            a = _decode_pairs(words, DECODE_ASM, DT)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = _decode_word(words, DECODE_ASM, DT)
            a = gl.join(gl.join(gl.join(v0, v2), gl.join(v1, v3)), gl.join(gl.join(v4, v6), gl.join(v5, v7)))
        a = gl.reshape(gl.permute(a, (0, 1, 6, 2, 4, 5, 3, 7)), [BT, 16 * RT, 64])
        a = gl.convert_layout(a, LA, assert_trivial=True)
        if xi is not None:
            b = activation_operand(xi, DT, LB)
        d = mma_v2(a, b, zero)  # sum_k (magic + q_k) x_k per block
        if xi is not None:
            xs = mma_v2(ones, b, zero)  # sum_k x_k per block (every row the same)
        st, ot = gl.split(terms)  # [BT, RT, 8]: (s_g, s_g+8) and (o_g, o_g+8) words
        s_lo, s_hi = _widen(st, HALF)
        o_lo, o_hi = _widen(ot, HALF)
        s = gl.convert_layout(gl.reshape(gl.permute(gl.join(s_lo, s_hi), (0, 1, 3, 2)), [BT, 16 * RT]), LS,
                              assert_trivial=True)
        o = gl.convert_layout(gl.reshape(gl.permute(gl.join(o_lo, o_hi), (0, 1, 3, 2)), [BT, 16 * RT]), LS,
                              assert_trivial=True)
        if ZERO_POINT:
            c = -(o + MAGIC) * s  # w = (q - z) s = s (magic + q) - (magic + z) s
        else:
            c = o - MAGIC * s  # w = s q + o = s (magic + q) + (o - magic s)
        return acc + d * gl.expand_dims(s, 2) + xs * gl.expand_dims(c, 2)

    @gluon.jit
    def _frag_kernel(X, WQ, T, Y, M, N, stride_xm, stride_ym,
                     K: gl.constexpr, GROUP: gl.constexpr, ZERO_POINT: gl.constexpr, KB: gl.constexpr,
                     GRID_WAIT: gl.constexpr, DECODE_ASM: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr,
                     LT: gl.constexpr, DEPTH: gl.constexpr, SILU_GATE: gl.constexpr, RT: gl.constexpr):
        frag_tile(X, WQ, T, Y, M, N, stride_xm, stride_ym, gl.program_id(0), K, GROUP, ZERO_POINT, KB, GRID_WAIT,
                  DECODE_ASM, LW, LX, LT, DEPTH, SILU_GATE, RT)

    @gluon.jit
    def _weight_pointers(WQ, T, tile, K: gl.constexpr, GROUP: gl.constexpr, LW: gl.constexpr, LT: gl.constexpr,
                         BT: gl.constexpr, RT: gl.constexpr):
        """A program's first-step pointers (and block indices) into the words and the group terms."""
        NB: gl.constexpr = K // 64
        # words: [BT, RT, 8, 4, 4] -> word c of lane 4g + t of the step's block b of row tile rt
        wb = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LW)))))
        wr = gl.arange(0, RT, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LW)))))
        wg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, LW)))))
        wt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, LW)))))
        wc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LW)))))
        w_block = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wb, 1), 2), 3), 4)
        w_tile = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wr, 0), 2), 3), 4)
        w_lane = (gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wg, 0), 1), 3), 4) * 16
                  + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wt, 0), 1), 2), 4) * 4
                  + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wc, 0), 1), 2), 3))
        w_ptr = WQ + (tile.to(gl.int64) * RT + w_tile) * (NB * 128) + w_block * 128 + w_lane

        # group terms (T as int32): [BT, RT, 8 (g), 2] -> the words (s_g, s_g+8), (o_g, o_g+8)
        tb = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LT))))
        tr = gl.arange(0, RT, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LT))))
        tg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LT))))
        tw = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LT))))
        t_block = gl.expand_dims(gl.expand_dims(gl.expand_dims(tb, 1), 2), 3)
        t_tile = gl.expand_dims(gl.expand_dims(gl.expand_dims(tr, 0), 2), 3)
        t_ptr = (T.to(gl.pointer_type(gl.int32), bitcast=True) + (tile.to(gl.int64) * RT + t_tile) * (K // GROUP * 16)
                 + gl.expand_dims(gl.expand_dims(gl.expand_dims(tg, 0), 1), 3) * 2
                 + gl.expand_dims(gl.expand_dims(gl.expand_dims(tw, 0), 1), 2))
        return w_ptr, w_block, t_ptr, t_block

    @gluon.jit
    def frag_first_weights(WQ, T, tile, K: gl.constexpr, GROUP: gl.constexpr, KB: gl.constexpr, LW: gl.constexpr,
                           LT: gl.constexpr, RT: gl.constexpr):
        """The words and group terms of `tile`'s first step, as `frag_tile` would load them first: a
        kernel running several products loads the next product's before a barrier (they do not
        depend on its activations) and hands them to `frag_tile`."""
        BT: gl.constexpr = gl.num_warps() * KB
        w_ptr, w_block, t_ptr, t_block = _weight_pointers(WQ, T, tile, K, GROUP, LW, LT, BT, RT)
        return _load_first_weights(w_ptr, w_block, t_ptr, t_block, K // 64, GROUP)

    @gluon.jit
    def _load_first_weights(w_ptr, w_block, t_ptr, t_block, NB: gl.constexpr, GROUP: gl.constexpr):
        """The first step's words and group terms (blocks past the row's NB read nothing)."""
        words = gl.load(w_ptr, mask=w_block < NB, other=0)
        terms = gl.load(t_ptr + (t_block * 64 // GROUP) * 16, mask=t_block < NB, other=0)
        return words, terms

    @gluon.jit
    def frag_tile(X, WQ, T, Y, M, N, stride_xm, stride_ym, tile,
                  K: gl.constexpr, GROUP: gl.constexpr, ZERO_POINT: gl.constexpr, KB: gl.constexpr,
                  GRID_WAIT: gl.constexpr, DECODE_ASM: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr,
                  LT: gl.constexpr, DEPTH: gl.constexpr, SILU_GATE: gl.constexpr, RT: gl.constexpr,
                  words0=None, terms0=None):
        """One program's 16*RT rows of y (`tile`: which), the whole K loop and the store: the body
        of `_frag_kernel`, and of kernels that run several products' tiles in turn (`words0`,
        `terms0`: the first step's, from `frag_first_weights`, already loaded)."""
        y = frag_sums(X, WQ, T, M, stride_xm, tile, K, GROUP, ZERO_POINT, KB, GRID_WAIT, DECODE_ASM, LW, LX, LT,
                      DEPTH, RT, words0, terms0)
        MT: gl.constexpr = _MAX_ROWS
        if SILU_GATE:
            out = silu_gated(y, RT, Y.dtype.element_ty)
            ry = tile * 8 * RT + gl.arange(0, 8 * RT, layout=gl.SliceLayout(1, out.type.layout))
            my = gl.arange(0, MT, layout=gl.SliceLayout(0, out.type.layout))
            y_ptr = Y + gl.expand_dims(my, 0) * stride_ym + gl.expand_dims(ry, 1)
            gl.store(y_ptr, out.to(Y.dtype.element_ty),
                     mask=(gl.expand_dims(my, 0) < M) & (gl.expand_dims(ry, 1) < N // 2))
        else:
            ry = tile * 16 * RT + gl.arange(0, 16 * RT, layout=gl.SliceLayout(1, y.type.layout))
            my = gl.arange(0, MT, layout=gl.SliceLayout(0, y.type.layout))
            y_ptr = Y + gl.expand_dims(my, 0) * stride_ym + gl.expand_dims(ry, 1)
            gl.store(y_ptr, y.to(Y.dtype.element_ty), mask=(gl.expand_dims(my, 0) < M) & (gl.expand_dims(ry, 1) < N))

    @gluon.jit
    def silu_gated(y, RT: gl.constexpr, OUT_DT: gl.constexpr):
        """y [16*RT, 8] of a SiLU-gated product's tiles (each tile's rows 0-7 are 8 gate rows, 8-15
        the matching up rows: a thread holds rows g and g + 8) -> SiLU(gate) * up [8*RT, 8] in
        float32, gate and up each rounded to OUT_DT first, as the unfused path stores them."""
        MT: gl.constexpr = y.shape[1]
        gate, up = gl.split(gl.permute(gl.reshape(y, [RT, 2, 8, MT]), (0, 2, 3, 1)))
        gate = gate.to(OUT_DT).to(gl.float32)
        up = up.to(OUT_DT).to(gl.float32)
        return gl.reshape(gate / (1.0 + gl.exp(-gate)) * up, [8 * RT, MT])

    @gluon.jit
    def activation_pointers(X, M, stride_xm, BT: gl.constexpr, LX: gl.constexpr):
        """Pointers to the activation pairs of a step's BT blocks (X as int32): [BT, 8 rows, 4 (t), 8]
        in LX, pair p of x[row, block*64 + 16t ..]; rows past M read row M-1 again (their columns are
        never stored); and each entry's block index [BT, 1, 1, 1]."""
        MT: gl.constexpr = _MAX_ROWS
        xb = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LX))))
        xm = gl.arange(0, MT, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LX))))
        xt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LX))))
        xp = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LX))))
        x_block = gl.expand_dims(gl.expand_dims(gl.expand_dims(xb, 1), 2), 3)
        x_row = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.minimum(xm, M - 1), 0), 2), 3)
        x_off = (x_block * 32 + gl.expand_dims(gl.expand_dims(gl.expand_dims(xt, 0), 1), 3) * 8
                 + gl.expand_dims(gl.expand_dims(gl.expand_dims(xp, 0), 1), 2))
        return X.to(gl.pointer_type(gl.int32), bitcast=True) + x_row * (stride_xm // 2) + x_off, x_block

    @gluon.jit
    def frag_sums(X, WQ, T, M, stride_xm, tile, K: gl.constexpr, GROUP: gl.constexpr, ZERO_POINT: gl.constexpr,
                  KB: gl.constexpr, GRID_WAIT: gl.constexpr, DECODE_ASM: gl.constexpr, LW: gl.constexpr,
                  LX: gl.constexpr, LT: gl.constexpr, DEPTH: gl.constexpr, RT: gl.constexpr,
                  words0=None, terms0=None):
        """y [16*RT, 8] in float32 (the mma's layout, summed over warps): the K loop of `frag_tile`."""
        WS: gl.constexpr = gl.num_warps()
        BT: gl.constexpr = WS * KB  # batch entries: (warp, block)
        NB: gl.constexpr = K // 64  # blocks in a row
        STEPS: gl.constexpr = (NB + BT - 1) // BT
        EVEN: gl.constexpr = NB % BT == 0
        MT: gl.constexpr = _MAX_ROWS
        DT: gl.constexpr = X.dtype.element_ty
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
        LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        LS: gl.constexpr = gl.SliceLayout(2, MMA)  # [BT, 16]: a thread's rows g and g + 8

        w_ptr, w_block, t_ptr, t_block = _weight_pointers(WQ, T, tile, K, GROUP, LW, LT, BT, RT)

        x_ptr, x_block = activation_pointers(X, M, stride_xm, BT, LX)

        # the activations' block sums come from an mma with an all-ones A of the same rows
        ones = gl.full([BT, 16 * RT, 64], 1.0, DT, layout=LA)
        zero = gl.zeros([BT, 16 * RT, MT], gl.float32, layout=MMA)
        acc = gl.zeros([BT, 16 * RT, MT], gl.float32, layout=MMA)

        # software pipeline: the next step's loads are issued before this step's values are used.
        # With programmatic launch the first weights load while the previous kernel finishes
        if words0 is not None:
            words = words0
            terms = terms0
            xi = gl.load(x_ptr, mask=x_block < NB, other=0)
        elif GRID_WAIT:
            words, terms = _load_first_weights(w_ptr, w_block, t_ptr, t_block, NB, GROUP)
            wait_for_previous_grid()
            xi = gl.load(x_ptr, mask=x_block < NB, other=0)
        else:
            words, xi, terms = _load_step(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block, 0, NB, GROUP, True)
        if DEPTH == 1:
            # unrolled by two so that the buffers trade roles instead of being copied at the loop's end
            for pair in range((STEPS - 1) // 2):
                words_b, xi_b, terms_b = _load_step(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block,
                                                    (2 * pair + 1) * BT, NB, GROUP, not EVEN)
                acc = _accumulate(acc, words, xi, terms, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
                words, xi, terms = _load_step(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block, (2 * pair + 2) * BT,
                                              NB, GROUP, not EVEN)
                acc = _accumulate(acc, words_b, xi_b, terms_b, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
            if (STEPS - 1) % 2:
                words_b, xi_b, terms_b = _load_step(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block,
                                                    (STEPS - 1) * BT, NB, GROUP, not EVEN)
                acc = _accumulate(acc, words, xi, terms, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
                acc = _accumulate(acc, words_b, xi_b, terms_b, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
            else:
                acc = _accumulate(acc, words, xi, terms, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
        else:
            # two steps in flight: three buffers in turn, unrolled by three; loads past the last step
            # re-read it (EVEN) or are masked off, and are never accumulated
            words_b, xi_b, terms_b = _load_at(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block, 1, STEPS, BT, NB,
                                              GROUP, EVEN)
            for tri in range(STEPS // 3):
                words_c, xi_c, terms_c = _load_at(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block, 3 * tri + 2, STEPS,
                                                  BT, NB, GROUP, EVEN)
                acc = _accumulate(acc, words, xi, terms, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
                words, xi, terms = _load_at(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block, 3 * tri + 3, STEPS,
                                            BT, NB, GROUP, EVEN)
                acc = _accumulate(acc, words_b, xi_b, terms_b, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
                words_b, xi_b, terms_b = _load_at(w_ptr, x_ptr, t_ptr, w_block, x_block, t_block, 3 * tri + 4,
                                                  STEPS, BT, NB, GROUP, EVEN)
                acc = _accumulate(acc, words_c, xi_c, terms_c, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
            if STEPS % 3 >= 1:
                acc = _accumulate(acc, words, xi, terms, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)
            if STEPS % 3 == 2:
                acc = _accumulate(acc, words_b, xi_b, terms_b, ones, zero, ZERO_POINT, DECODE_ASM, DT, LA, LB, LS)

        return gl.sum(acc, axis=0)  # [16*RT, MT]: the (warp, block) shares, added in a fixed order


def tiles_for(n: int, k: int, m: int = 1) -> FragTiles:
    """The tiles for a weight [n, k] at m rows, measured on the H200 over one Qwen3-8B step's layers
    at 1, 2, 4 and 8 rows (docs/benchmarks.md): wide layers in 64-row
    programs (one activation load for 4 tiles: at 4 rows the activations' traffic would otherwise
    rival the weights') with two steps in flight, the vocabulary with two warps and two steps in
    flight, long ones (down) with eight warps and two steps in flight, the rest with eight warps
    and two steps in flight from two rows on. Only the pipeline's depth depends on m: the warps and
    blocks a step (the order a row's sums are added in) do not, so a row's bits do not either."""
    if n >= 65536:
        return FragTiles(blocks=1, num_warps=2, depth=2, row_tiles=4)
    if n >= 16384:
        return FragTiles(blocks=1, num_warps=4, depth=2, row_tiles=4)
    return FragTiles(blocks=1, num_warps=8, depth=2 if k >= 8192 or m > 1 else 1)


def step_blocks(k: int, tiles: FragTiles) -> int:
    """Blocks a warp takes a step: the tiles' own, halved until the steps divide K's blocks."""
    blocks = tiles.blocks
    while (k // BLOCK) % (blocks * tiles.num_warps) and blocks > 1:
        blocks //= 2
    return blocks


def launch_constexprs(k: int, group_size: int, zero_point: bool, tiles: FragTiles, half: bool, silu_gate: bool,
                      pdl: bool) -> dict:
    """`_frag_kernel`'s compile-time arguments as `frag_gemv` launches it (and as tools/sass/offline_sass.py
    compiles it for CI): K [in features], the tiles' layouts and depth, PDL's wait. The product
    releases its dependents at its end (as launched plainly): earlier release measured slower on
    the H200, its dependents, once resident, cost it more than their launch saves."""
    blocks = step_blocks(k, tiles)
    words_layout, acts_layout, terms_layout = _layouts(tiles.num_warps, blocks, tiles.row_tiles)
    return dict(K=k, GROUP=group_size, ZERO_POINT=zero_point, KB=blocks, GRID_WAIT=pdl, DECODE_ASM=_decode_asm(half),
                LW=words_layout, LX=acts_layout, LT=terms_layout, DEPTH=tiles.depth, SILU_GATE=silu_gate,
                RT=tiles.row_tiles)


def frag_gemv(x: torch.Tensor, fw: FragWeights, tiles: FragTiles | None = None,
              silu_gate: bool = False) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, bfloat16 / float16) -> y [M, N] in x's dtype (float32 sums). With
    `silu_gate` each 16-row tile is 8 gate rows and their 8 up rows, and y [M, N/2] is SiLU(gate) * up."""
    m, k = x.shape
    n = fw.out_features
    reason = unsupported_reason(x.device, x.dtype, 4, fw.group_size, k)
    if not reason and m > MAX_ROWS:
        reason = f"{m} rows (at most {MAX_ROWS})"
    if not reason and k != fw.in_features:
        reason = f"{k} input features for a weight of {fw.in_features}"
    if not reason and fw.terms.dtype != x.dtype:
        reason = f"activations in {x.dtype} for terms in {fw.terms.dtype}"
    if not reason and silu_gate and n % TILE_ROWS:
        reason = f"{n} gate/up rows (SiLU in the epilogue takes multiples of {TILE_ROWS})"
    if reason:
        raise ValueError(f"frag.frag_gemv: {reason}")
    tiles = tiles or tiles_for(n, k, m)
    if tiles.row_tiles not in (1, 2, 4):
        raise ValueError(f"frag.frag_gemv: {tiles.row_tiles} row tiles a program (1, 2 or 4)")
    x = x.contiguous()
    y = torch.empty(m, n // 2 if silu_gate else n, dtype=x.dtype, device=x.device)
    pdl = launch.PDL
    _frag_kernel[(fw.words.shape[0] // tiles.row_tiles,)](
        x, fw.words, fw.terms, y, m, n, x.stride(0), y.stride(0),
        **launch_constexprs(k, fw.group_size, fw.zero_point, tiles, x.dtype == torch.float16, silu_gate, pdl),
        num_warps=tiles.num_warps, launch_pdl=pdl)
    return y
