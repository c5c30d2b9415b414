"""Tensor-core product for 4-bit group-quantized weights at decode and verify widths:
y[M, N] = x[M, K] @ dequant(W)[N, K]^T for M <= MAX_ROWS, read straight from the checkpoint's
words (packed little-endian [N, K/8] int32, scales / offsets [N, K/group]), written in Gluon.

Why tensor cores for a product that is bound by memory: the GEMV (gemv.py) spends three
instructions per weight value and per activation row (decode the value, subtract, multiply-add),
so at 4 bits it runs out of issue slots before it runs out of bandwidth, and a verify pass of 4
rows costs 2.4x one row. Here each 16x16 tile of decoded weights goes into one mma.m16n8k16 with
up to 8 activation rows as its N side ("swap AB": the weights are the A operand, the tokens the
B), so the multiply-adds cost nothing per value and a pass of 8 rows costs what one row does.
What is left per value is the decoding, in packed pairs of 16-bit floats:
- LOP3 ors two 4-bit values (bits 4i and 16 + 4i of the word, after one shift) into the
  mantissas of a pair of 128.0 (bfloat16; 1024.0 for float16), whose last mantissa place is 1:
  the pair reads (128 + q_a, 128 + q_b), exactly;
- affine (MLX): subtract 128, then fma with the group's (scale, offset) pair: w = s*q + o rounded
  once to the activations' dtype, as exact as dequantizing in float32 and rounding;
- zero point (compressed-tensors): subtract (128 + z), then multiply by the scale: w = (q - z)*s.

Operand layout. A thread of an mma owns, per 16x16 tile, values at k = 2t, 2t+1, 2t+8, 2t+9 (t =
lane % 4) of rows g and g+8 (g = lane / 4). The order of k inside the product is free as long as
the weights and the activations follow the same one, so the kernel gives each thread whole words:
thread t of a row reads 4 consecutive words (a 16-byte load, values 32t..32t+31 of a 128-value
block), and the mma's k order is a permutation of the block (the kernel's reshape / permute of
[.., t, word, value] into [.., word, value bits, t, pair]) under which those values are exactly
what the thread's fragments hold. The activations are loaded in the physical order (64 bytes per
thread per row) and permuted the same way; `convert_layout(..., assert_trivial=True)` makes the
compiler prove that neither operand moves between threads (`_layouts` gives the load layouts).
The warps of a program split K (the mma's batch dimension) and are summed once, in a fixed order,
at the end; the tiles are chosen by the weight's shape (`tiles_for`).

Exactness: every output element is its own mma column, decoded the same way whatever M is, so a
row's result does not depend on the other rows (speculative verify == plain decode, row by row).

`matmul.dequant_matmul_reference` is the plain-torch definition it is tested against.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

# gl, gluon and triton are None without Gluon
from verispec.kernels import launch
from verispec.kernels.launch import gl, gluon, is_sm90, platform_reason, triton

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from verispec.kernels.launch import wait_for_previous_grid

MAX_ROWS = 8  # the mma's N side
GATE_CHUNK = 16  # gate rows (then as many up rows) a program of a SiLU-gated product holds: one mma tile
BLOCK = 128  # values per thread group of 4 lanes and row: 4 lanes x 4 words x 8 values


@dataclasses.dataclass(frozen=True)
class MmaTiles:
    """A program computes 16*row_tiles rows; its num_warps warps split K between them (each warp
    `blocks` 128-value blocks per iteration) and their sums are added once at the end."""
    row_tiles: int = 1
    blocks: int = 2
    num_warps: int = 4
    prefetch_x: bool = True  # the activations too are loaded a step ahead (more registers)


# measured on the H200 over one Qwen3-8B step's layers (docs/benchmarks.md):
# wide layers (gate_up, lm_head) read best with 32-row programs, long ones (down) with 4 blocks
HEAD_TILES = MmaTiles(row_tiles=2, blocks=1, prefetch_x=False)
WIDE_TILES = MmaTiles(row_tiles=2, blocks=1)
LONG_TILES = MmaTiles(row_tiles=1, blocks=4, prefetch_x=False)
TILES = MmaTiles(row_tiles=1, blocks=2, prefetch_x=False)


def tiles_for(n: int, k: int) -> MmaTiles:
    """The tiles for a weight [n, k]."""
    if n >= 65536:  # vocabulary-sized
        return HEAD_TILES
    return WIDE_TILES if n >= 16384 else LONG_TILES if k >= 8192 else TILES


def _powers(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


@functools.cache
def _layouts(num_warps: int, row_tiles: int, blocks: int):
    """(words [warps, BN, blocks, 4 (lane t), 4 (word c)], activations [warps, 8, blocks*128]) as
    linear layouts whose permutation by the kernel is the batched mma's A and B operand layouts
    (the batch dimension is the warp's share of K)."""
    reg = [[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 8, 0, 0, 0]] + [[0, 0, b, 0, 0] for b in _powers(blocks)]
    reg += [[0, 16 * b, 0, 0, 0] for b in _powers(row_tiles)]
    lanes = [[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 4, 0, 0, 0]]
    warps = [[b, 0, 0, 0, 0] for b in _powers(num_warps)]
    words = gl.DistributedLinearLayout(reg, lanes, warps, [], [num_warps, 16 * row_tiles, blocks, 4, 4])
    # a thread holds 32 consecutive values of one activation row per block (lane t: values 32t..32t+31)
    reg = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]] + [[0, 0, BLOCK * b] for b in _powers(blocks)]
    lanes = [[0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    warps = [[b, 0, 0] for b in _powers(num_warps)]
    acts = gl.DistributedLinearLayout(reg, lanes, warps, [], [num_warps, MAX_ROWS, BLOCK * blocks])
    return words, acts


def tensor_core_reason(device: torch.device, dtype: torch.dtype, bits: int) -> str | None:
    """Why a 4-bit tensor-core kernel of ours (this one, frag.py) cannot take these
    activations and weights (None: it can, on a GPU `gpu_reason` accepts)."""
    if reason := platform_reason(device):
        return reason
    if dtype not in (torch.bfloat16, torch.float16):
        return f"activations in {str(dtype).removeprefix('torch.')} (the mma takes bfloat16 and float16)"
    if bits != 4:
        return f"{bits}-bit weights (the tensor-core kernels decode 4-bit)"
    return None


def gpu_reason(device: torch.device) -> str | None:
    """Why the GPU cannot run the 4-bit tensor-core kernels (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not is_sm90(device):
        return "a GPU before sm_90 (packed bfloat16 arithmetic)"
    return None


def unsupported_reason(device: torch.device, dtype: torch.dtype, bits: int, group_size: int,
                       in_features: int) -> str | None:
    """Why a layer cannot take this kernel (None: it can)."""
    if reason := tensor_core_reason(device, dtype, bits):
        return reason
    if group_size % 32:
        return f"group size {group_size} (a thread's 4 words must share a group: a multiple of 32)"
    if in_features % BLOCK:
        return f"{in_features} input features (not a multiple of {BLOCK})"
    return gpu_reason(device)


@functools.cache
def _decode_asm(half: bool, zero_point: bool) -> str:
    """PTX for `_decode_word`: outputs $0..$7 (value j in $j), inputs $8 word, $9 scale pair,
    $10 offset pair (zero point: (magic + z) pair)."""
    magic, kind = ("0x64006400", "f16x2") if half else ("0x43004300", "bf16x2")
    if zero_point:
        scale = f"sub.{kind} u, u, $10;\nmul.rn.{kind} u, u, $9;\n"
    else:
        scale = f"sub.{kind} u, u, m;\nfma.rn.{kind} u, u, $9, $10;\n"
    return nibble_pairs_asm(magic, scale)


def nibble_pairs_asm(magic: str, then: str = "") -> str:
    """PTX: the 8 nibbles of the word $8 as magic + q in the 16-bit outputs $0..$7 (value j in $j).
    Nibbles i and i + 4 (bits 4i and 16 + 4i) come out of one LOP3 (0xEA: (a & b) | c) as a pair
    in the register u, which the PTX `then` may rework (the register m holds the magic pair)
    before it is split into $i and $i + 4. frag.py's decode is this with nothing after."""
    body = f"{{\n.reg .b32 u, m, t;\nmov.b32 m, {magic};\n"
    for i in range(4):
        source = "$8" if i == 0 else "t"
        if i:
            body += f"shr.b32 t, $8, {4 * i};\n"
        body += f"lop3.b32 u, {source}, 0x000F000F, m, 0xEA;\n{then}mov.b32 {{${i}, ${i + 4}}}, u;\n"
    return body + "}"


if gluon is not None:
    _BLOCK = gl.constexpr(BLOCK)
    _MAX_ROWS = gl.constexpr(MAX_ROWS)

    @gluon.jit
    def _pair(v):
        # a 16-bit value twice in one register: the (s, s) operand of the packed instructions
        return gl.inline_asm_elementwise("mov.b32 $0, {$1, $1};", "=r,h", [v], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _decode_word(word, scale2, offset2, ASM: gl.constexpr, OUT: gl.constexpr):
        """word: 8 values at bits 4j; scale2 / offset2: pairs -> the 8 weights in OUT (bfloat16 or
        float16), value j in result j; ASM is `_decode_asm`'s program for the dtype and form."""
        return gl.inline_asm_elementwise(ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [word, scale2, offset2],
                                         dtype=(OUT.value,) * 8, is_pure=True, pack=1)

    @gluon.jit
    def _load_x(x_ptr, k0, x_k, K: gl.constexpr, EVEN_K: gl.constexpr):
        # rows past M read row M-1 again (x_ptr is clamped): their columns of the product are never
        # stored, and a mask would cost a zeroing instruction per register
        if EVEN_K:
            return gl.load(x_ptr + k0, mask=k0 < K)
        else:
            return gl.load(x_ptr + k0, mask=x_k + k0 < K, other=0.0)

    @gluon.jit
    def _load_weights(w_ptr, s_ptr, o_ptr, k0, start, s_ok, K: gl.constexpr, GROUP: gl.constexpr,
                      UNMASKED: gl.constexpr):
        """One step's words, scales and offsets at K offset k0 ([WS, BN, KB, 4(, 4)]; nothing is
        read at or past K or N)."""
        if UNMASKED:
            live = k0 < K
            words = gl.load(w_ptr + k0 // 8, mask=live)
            s = gl.load(s_ptr + k0 // GROUP, mask=live)
            o = gl.load(o_ptr + k0 // GROUP, mask=live)
        else:
            ok = s_ok & (start + k0 < K)
            words = gl.load(w_ptr + k0 // 8, mask=gl.expand_dims(ok, 4), other=0)
            s = gl.load(s_ptr + k0 // GROUP, mask=ok, other=0.0)
            o = gl.load(o_ptr + k0 // GROUP, mask=ok, other=0.0)
        return words, s, o

    @gluon.jit
    def _mma_kernel(X, WQ, S, O, Y, M, N, stride_xm, stride_wn, stride_sn, stride_ym,
                    K: gl.constexpr, GROUP: gl.constexpr, ZERO_POINT: gl.constexpr, RT: gl.constexpr,
                    KB: gl.constexpr, EVEN_N: gl.constexpr, PREFETCH_X: gl.constexpr, GRID_WAIT: gl.constexpr,
                    DECODE_ASM: gl.constexpr, LW: gl.constexpr, LX: gl.constexpr, SILU_GATE: gl.constexpr):
        WS: gl.constexpr = gl.num_warps()  # warps, each its own share of K
        BN: gl.constexpr = 16 * RT
        BK: gl.constexpr = _BLOCK * KB  # per warp and iteration
        STEP: gl.constexpr = BK * WS
        EVEN_K: gl.constexpr = K % STEP == 0
        MT: gl.constexpr = _MAX_ROWS
        HALF: gl.constexpr = X.dtype.element_ty == gl.float16
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        LA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
        LB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        LS: gl.constexpr = gl.SliceLayout(4, LW)  # per (warp, row, block, lane t): one group
        L3: gl.constexpr = gl.SliceLayout(3, LS)
        pid = gl.program_id(0)

        # [WS, BN, KB, 4] value offsets of each thread's 4 words, and its rows
        ws = gl.arange(0, WS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        rows = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        blk = gl.arange(0, KB, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        lane_t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LS))))
        start3 = (gl.expand_dims(gl.expand_dims(ws, 1), 2) * BK + gl.expand_dims(gl.expand_dims(blk, 0), 1) * _BLOCK
                  + 0 * gl.expand_dims(gl.expand_dims(rows, 0), 2))
        start = gl.expand_dims(start3, 3) + gl.expand_dims(gl.expand_dims(gl.expand_dims(lane_t, 0), 1), 2) * 32
        rows4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(rows, 0), 2), 3)
        word_c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LW)))))
        w_ptr = (WQ + gl.expand_dims(rows4.to(gl.int64) * stride_wn + start // 8, 4)
                 + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(word_c, 0), 1), 2), 3))
        s_off = rows4.to(gl.int64) * stride_sn + start // GROUP
        s_ok = (rows4 < N) & (start < K)

        xw = gl.arange(0, WS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))
        mx = gl.arange(0, MT, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))
        kx = gl.arange(0, BK, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))
        x_k = gl.expand_dims(gl.expand_dims(xw, 1), 2) * BK + gl.expand_dims(gl.expand_dims(kx, 0), 1)
        x_row = gl.expand_dims(gl.expand_dims(gl.minimum(mx, M - 1), 0), 2)
        x_ptr = X + x_row * stride_xm + x_k

        acc = gl.zeros([WS, BN, MT], gl.float32, layout=MMA)
        # software pipeline: every load of the next step (words, scales, offsets, activations) is
        # issued before this step's are used, so no step waits a full memory round trip
        words, s, o = _load_weights(w_ptr, S + s_off, O + s_off, 0, start, s_ok, K, GROUP, EVEN_N and EVEN_K)
        if GRID_WAIT:
            wait_for_previous_grid()
        if PREFETCH_X:
            xv = _load_x(x_ptr, 0, x_k, K, EVEN_K)
        for k0 in range(0, K, STEP):
            words_n, s_n, o_n = _load_weights(w_ptr, S + s_off, O + s_off, k0 + STEP, start, s_ok, K, GROUP,
                                              EVEN_N and EVEN_K)
            if PREFETCH_X:
                xv_n = _load_x(x_ptr, k0 + STEP, x_k, K, EVEN_K)
            if ZERO_POINT:
                o = (o.to(gl.float32) + (1024.0 if HALF else 128.0)).to(O.dtype.element_ty)  # exact: z < 16
            v0, v1, v2, v3, v4, v5, v6, v7 = _decode_word(words, gl.expand_dims(_pair(s), 4),
                                                          gl.expand_dims(_pair(o), 4), DECODE_ASM,
                                                          X.dtype.element_ty)
            # [WS, BN, KB, t, c, p, i0, i1] (value 4p + i of word c, i = i0 + 2 i1) -> the mma's k order
            a = gl.join(gl.join(gl.join(v0, v4), gl.join(v1, v5)), gl.join(gl.join(v2, v6), gl.join(v3, v7)))
            a = gl.reshape(gl.permute(a, (0, 1, 2, 4, 7, 6, 3, 5)), [WS, BN, BK])
            a = gl.convert_layout(a, LA, assert_trivial=True)
            if not PREFETCH_X:
                xv = _load_x(x_ptr, k0, x_k, K, EVEN_K)
            # [WS, 8, KB, t, c, p, i1, i0] (physical order) -> [WS, KB, c, i1, i0, t, p, 8] -> [WS, BK, 8]
            b = gl.permute(gl.reshape(xv, [WS, MT, KB, 4, 4, 2, 2, 2]), (0, 2, 4, 6, 7, 3, 5, 1))
            b = gl.convert_layout(gl.reshape(b, [WS, BK, MT]), LB, assert_trivial=True)
            acc = mma_v2(a, b, acc)
            words, s, o = words_n, s_n, o_n
            if PREFETCH_X:
                xv = xv_n
        y = gl.sum(acc, axis=0)  # [BN, MT]: the warps' shares, added in a fixed order
        if SILU_GATE:
            # rows 0-15 are 16 gate rows, 16-31 the matching up rows (QuantizedLinear.interleave_gate_up):
            # SiLU(gate) * up, each rounded to the output dtype first as the unfused path stores them
            gate, up = gl.split(gl.permute(gl.reshape(y, [2, 16, MT]), (1, 2, 0)))
            gate = gate.to(Y.dtype.element_ty).to(gl.float32)
            up = up.to(Y.dtype.element_ty).to(gl.float32)
            out = gate / (1.0 + gl.exp(-gate)) * up  # [16, MT]
            ry = pid * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, out.type.layout))
            my = gl.arange(0, MT, layout=gl.SliceLayout(0, out.type.layout))
            y_ptr = Y + gl.expand_dims(my, 0) * stride_ym + gl.expand_dims(ry, 1)
            gl.store(y_ptr, out.to(Y.dtype.element_ty), mask=(gl.expand_dims(my, 0) < M) & (gl.expand_dims(ry, 1) < N // 2))
        else:
            ry = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(0, MMA)))
            my = gl.arange(0, MT, layout=gl.SliceLayout(0, gl.SliceLayout(0, MMA)))
            y_ptr = Y + gl.expand_dims(my, 0) * stride_ym + gl.expand_dims(ry, 1)
            gl.store(y_ptr, y.to(Y.dtype.element_ty), mask=(gl.expand_dims(my, 0) < M) & (gl.expand_dims(ry, 1) < N))


def _blocks(k: int, tiles: MmaTiles) -> int:
    """Blocks per iteration: the tile's, or fewer where K is not a multiple of them."""
    blocks = tiles.blocks
    while (k // BLOCK) % blocks:
        blocks //= 2
    return blocks


def mma_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
             group_size: int, zero_point: bool = False, tiles: MmaTiles | None = None,
             silu_gate: bool = False) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, bfloat16 / float16); packed [N, K/8] int32; scales, offsets [N,
    K/group_size] in x's dtype (offsets: unsigned zero points when `zero_point`) -> y [M, N] in
    x's dtype, accumulated in float32. With `silu_gate` the rows are GATE_CHUNK gate rows, then
    the matching GATE_CHUNK up rows, and so on, and y [M, N/2] is SiLU(gate) * up."""
    m, k = x.shape
    n = packed.shape[0]
    reason = unsupported_reason(x.device, x.dtype, bits, group_size, k)
    if not reason and silu_gate and n % (2 * GATE_CHUNK):
        reason = f"{n} gate/up rows (SiLU in the epilogue takes multiples of {2 * GATE_CHUNK})"
    if reason or m > MAX_ROWS:
        raise ValueError(f"mma.mma_gemv: {reason or f'{m} rows (at most {MAX_ROWS})'}")
    packed = packed.view(torch.int32) if packed.dtype != torch.int32 else packed
    x, packed = x.contiguous(), packed.contiguous()
    scales, offsets = scales.to(x.dtype).contiguous(), offsets.to(x.dtype).contiguous()
    tiles = tiles or tiles_for(n, k)
    if silu_gate:  # a program's 32 rows: 16 gate rows and their 16 up rows
        tiles = dataclasses.replace(tiles, row_tiles=2)
    blocks = _blocks(k, tiles)
    words_layout, acts_layout = _layouts(tiles.num_warps, tiles.row_tiles, blocks)
    bn = 16 * tiles.row_tiles
    y = torch.empty(m, n // 2 if silu_gate else n, dtype=x.dtype, device=x.device)
    pdl = launch.PDL  # programmatic dependent launch (kernels/launch.py)
    _mma_kernel[(triton.cdiv(n, bn),)](
        x, packed, scales, offsets, y, m, n, x.stride(0), packed.stride(0), scales.stride(0), y.stride(0),
        K=k, GROUP=group_size, ZERO_POINT=zero_point, RT=tiles.row_tiles, KB=blocks, EVEN_N=n % bn == 0,
        PREFETCH_X=tiles.prefetch_x, GRID_WAIT=pdl, DECODE_ASM=_decode_asm(x.dtype == torch.float16, zero_point),
        LW=words_layout, LX=acts_layout, SILU_GATE=silu_gate, num_warps=tiles.num_warps, launch_pdl=pdl)
    return y
