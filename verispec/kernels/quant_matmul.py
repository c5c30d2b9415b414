"""Fused dequantize + matrix product for group-quantized weights, for short passes (decode and
verify: M = 1..16 rows, and batches of them): y[M, N] = x[M, K] @ dequant(W)[N, K]^T, reading the
packed weights once per 16 rows.

W is a little-endian bitstream of b-bit unsigned values per row (verispec/quant/packing.py),
b in {2, 3, 4, 5, 6, 8}; each group of `group_size` consecutive columns has a scale s and an
offset o, and decodes as
  affine (MLX):              w = q * s + o      (o = the group's bias)
  zero point (compressed-tensors): w = (q - o) * s  (o = the group's unsigned zero point)
Values are decoded in float32 and multiplied as float32 (IEEE products for float32 activations,
TF32 for half-precision ones). Rows are computed in tiles of 16 whatever M is, and K is split by
the weight's shape only, so each row's sum runs in the same order in a decode step, a verify
pass or a batch of them. Passes longer than FUSED_MAX_ROWS (prefill) dequantize the whole matrix
into one GEMM instead (QuantizedLinear.forward).

`dequant_matmul_reference` is the plain-torch definition the kernel is tested against.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import torch

from verispec.quant.packing import unpack_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the layers dequantize with torch instead
    triton = None
    tl = None

BLOCK_M = 16  # rows per tile: tl.dot's smallest, and a decode or verify pass fits in one
FMA_MAX_ROWS = 16  # passes up to this many rows may take the CUDA-core kernel (TileConfig.fma_rows)
FUSED_MAX_ROWS = 128  # passes up to this many rows take the kernel (a guess until measured on GPU)
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def dequantize_reference(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                         group_size: int, zero_point: bool) -> torch.Tensor:
    """packed [N, W] int32; scales, offsets [N, G] -> weight [N, G*group_size] in float32."""
    n, num_groups = scales.shape
    q = unpack_rows(packed, bits, num_groups * group_size).view(n, num_groups, group_size).float()
    s, o = scales.float().unsqueeze(-1), offsets.float().unsqueeze(-1)
    w = (q - o) * s if zero_point else q * s + o
    return w.view(n, -1)


def dequant_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                             bits: int, group_size: int, zero_point: bool = False) -> torch.Tensor:
    """x [M, K] -> y [M, N] in x's dtype, accumulated in float32 (float64 stays float64)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    w = dequantize_reference(packed, scales, offsets, bits, group_size, zero_point).to(compute)
    return (x.to(compute) @ w.T).to(x.dtype)


if triton is not None:

    @triton.jit
    def _dequant_matmul_kernel(X, WQ, S, O, Y, M, N,
                               stride_xm, stride_wn, stride_sn, stride_ys, stride_ym, K: tl.constexpr,
                               K_PER_SPLIT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                               ZERO_POINT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNPACK_WORDS: tl.constexpr,
                               W_FIRST: tl.constexpr, HALF_DOT: tl.constexpr, SLOTS: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)  # which slice of K (split-K); each writes its own partial sums
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        rows_w = WQ + offs_n[:, None].to(tl.int64) * stride_wn
        rows_s = offs_n[:, None].to(tl.int64) * stride_sn
        if W_FIRST:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if SLOTS:
            # power-of-two bits, one product per bit slot: slot i of every word of the tile holds
            # columns 8w+i (4 bits), so the slot's values form a [BLOCK_N, WORDS] operand in the
            # words' own layout (unpacking is elementwise: no reshape, and the packed words, not
            # the decoded values, are what the product's operand layout is converted from);
            # the activations' matching columns are a strided load
            PER_WORD: tl.constexpr = 32 // BITS
            WORDS: tl.constexpr = BLOCK_K // PER_WORD
            for k0 in range(0, K_PER_SPLIT, BLOCK_K):
                word = (pid_k * K_PER_SPLIT + k0) // PER_WORD + tl.arange(0, WORDS)
                wmask = mask_n[:, None] & (word < K // PER_WORD)[None, :]
                words = tl.load(rows_w + word[None, :], mask=wmask, other=0).to(tl.uint32, bitcast=True)
                group = (word * PER_WORD) // GROUP  # a word's values share a group (GROUP % PER_WORD == 0)
                s = tl.load(S + rows_s + group[None, :], mask=wmask, other=0.0).to(tl.float32)
                o = tl.load(O + rows_s + group[None, :], mask=wmask, other=0.0).to(tl.float32)
                for i in tl.static_range(PER_WORD):
                    q = (words >> (i * BITS)) & ((1 << BITS) - 1)
                    # integer to float by the exponent trick (2**23 + q, exact): no conversion unit
                    q = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    if ZERO_POINT:
                        w = (q - o) * s
                    else:
                        w = q * s + o
                    col = word * PER_WORD + i
                    x = tl.load(X + offs_m[:, None] * stride_xm + col[None, :],
                                mask=mask_m[:, None] & (col < K)[None, :], other=0.0)
                    if HALF_DOT:
                        w = w.to(X.dtype.element_ty)
                        if W_FIRST:
                            acc += tl.dot(w, tl.trans(x))
                        else:
                            acc += tl.dot(x, tl.trans(w))
                    else:
                        x = x.to(tl.float32)
                        if W_FIRST:
                            if IEEE:
                                acc += tl.dot(w, tl.trans(x), input_precision="ieee")
                            else:
                                acc += tl.dot(w, tl.trans(x), input_precision="tf32")
                        else:
                            if IEEE:
                                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                            else:
                                acc += tl.dot(x, tl.trans(w), input_precision="tf32")
        else:
            for k0 in range(0, K_PER_SPLIT, BLOCK_K):
                k_start = pid_k * K_PER_SPLIT + k0
                k = k_start + tl.arange(0, BLOCK_K)
                mask_k = k < K
                x = tl.load(X + offs_m[:, None] * stride_xm + k[None, :],
                            mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                if UNPACK_WORDS:
                    # power-of-two bits: no value crosses a word, so load each word once (contiguous)
                    # and split it into its 32/BITS values; the group's scale and offset are loaded
                    # once per group and broadcast over its columns
                    PER_WORD: tl.constexpr = 32 // BITS
                    word = k_start // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
                    words = tl.load(rows_w + word[None, :], mask=mask_n[:, None] & (word < K // PER_WORD)[None, :],
                                    other=0).to(tl.uint32, bitcast=True)
                    shifts = (tl.arange(0, PER_WORD) * BITS).to(tl.uint32)
                    q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
                    # integer to float by the exponent trick (2**23 + q, exact): no conversion unit
                    q = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    q = tl.reshape(q, [BLOCK_N, BLOCK_K // GROUP, GROUP])
                    group = k_start // GROUP + tl.arange(0, BLOCK_K // GROUP)
                    gmask = mask_n[:, None] & (group < K // GROUP)[None, :]
                    s = tl.load(S + rows_s + group[None, :], mask=gmask, other=0.0).to(tl.float32)[:, :, None]
                    o = tl.load(O + rows_s + group[None, :], mask=gmask, other=0.0).to(tl.float32)[:, :, None]
                    if ZERO_POINT:
                        w = tl.reshape((q - o) * s, [BLOCK_N, BLOCK_K])
                    else:
                        w = tl.reshape(q * s + o, [BLOCK_N, BLOCK_K])
                else:
                    wmask = mask_n[:, None] & mask_k[None, :]
                    bit = k * BITS
                    word = bit // 32
                    shift = (bit % 32).to(tl.uint32)
                    lo = tl.load(rows_w + word[None, :], mask=wmask, other=0).to(tl.uint32, bitcast=True)
                    q = lo >> shift[None, :]
                    if 32 % BITS != 0:
                        # values that cross into the next word take their high bits from it
                        crosses = (shift + BITS) > 32
                        hi = tl.load(rows_w + word[None, :] + 1, mask=wmask & crosses[None, :], other=0)
                        hi = hi.to(tl.uint32, bitcast=True) << ((32 - shift) & 31)[None, :]
                        q = tl.where(crosses[None, :], q | hi, q)
                    q = ((q & ((1 << BITS) - 1)) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    group = (k // GROUP)[None, :]
                    s = tl.load(S + rows_s + group, mask=wmask, other=0.0).to(tl.float32)
                    o = tl.load(O + rows_s + group, mask=wmask, other=0.0).to(tl.float32)
                    if ZERO_POINT:
                        w = (q - o) * s
                    else:
                        w = q * s + o
                if HALF_DOT:
                    # half-precision activations with the decoded weight rounded to their dtype
                    w = w.to(X.dtype.element_ty)
                    if W_FIRST:
                        acc += tl.dot(w, tl.trans(x))
                    else:
                        acc += tl.dot(x, tl.trans(w))
                else:
                    # float32 operands: half-precision activations are exact in TF32, and the decoded
                    # weights keep more bits there than a round to bf16 would
                    x = x.to(tl.float32)
                    if W_FIRST:
                        if IEEE:
                            acc += tl.dot(w, tl.trans(x), input_precision="ieee")
                        else:
                            acc += tl.dot(w, tl.trans(x), input_precision="tf32")
                    else:
                        if IEEE:
                            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                        else:
                            acc += tl.dot(x, tl.trans(w), input_precision="tf32")
        out = Y + pid_k * stride_ys
        if W_FIRST:
            tl.store(out + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
                     mask=mask_n[:, None] & mask_m[None, :])
        else:
            tl.store(out + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                     mask=mask_m[:, None] & mask_n[None, :])


    @triton.jit
    def _dequant_gemv_kernel(X, WQ, S, O, Y, M, N,
                             stride_xm, stride_wn, stride_sn, stride_ys, stride_ym, K: tl.constexpr,
                             K_PER_SPLIT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                             ZERO_POINT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        """Few rows (decode / verify): products and sums on the CUDA cores, no tensor-core tile, so
        the decoded weights never leave the registers. Power-of-two bits only. Each of the ROWS
        rows of a program runs the same code with its own accumulator, so a row's sum does not
        depend on the other rows of the pass."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        PER_WORD: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = BLOCK_K // PER_WORD
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows_w = WQ + offs_n[:, None].to(tl.int64) * stride_wn
        rows_s = offs_n[:, None].to(tl.int64) * stride_sn
        slot = tl.arange(0, PER_WORD)
        shifts = (slot * BITS).to(tl.uint32)
        row0 = pid_m * ROWS
        acc0 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            k_start = pid_k * K_PER_SPLIT + k0
            word = k_start // PER_WORD + tl.arange(0, WORDS)
            wmask = mask_n[:, None] & (word < K // PER_WORD)[None, :]
            words = tl.load(rows_w + word[None, :], mask=wmask, other=0).to(tl.uint32, bitcast=True)
            q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
            # integer to float by the exponent trick (2**23 + q, exact), cheaper than a conversion
            q = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            group = (word * PER_WORD) // GROUP
            s = tl.load(S + rows_s + group[None, :], mask=wmask, other=0.0).to(tl.float32)[:, :, None]
            o = tl.load(O + rows_s + group[None, :], mask=wmask, other=0.0).to(tl.float32)[:, :, None]
            if ZERO_POINT:
                w = (q - o) * s
            else:
                w = q * s + o
            kk = word[:, None] * PER_WORD + slot[None, :]  # [WORDS, PER_WORD]
            kmask = kk < K
            x = tl.load(X + row0 * stride_xm + kk, mask=kmask & (row0 < M), other=0.0).to(tl.float32)
            acc0 += tl.sum(w * x[None, :, :], axis=2)
            # rows past M are skipped at run time: a decode step costs one row's products
            if ROWS > 1:
                if row0 + 1 < M:
                    x = tl.load(X + (row0 + 1) * stride_xm + kk, mask=kmask, other=0.0).to(tl.float32)
                    acc1 += tl.sum(w * x[None, :, :], axis=2)
            if ROWS > 2:
                if row0 + 2 < M:
                    x = tl.load(X + (row0 + 2) * stride_xm + kk, mask=kmask, other=0.0).to(tl.float32)
                    acc2 += tl.sum(w * x[None, :, :], axis=2)
                if row0 + 3 < M:
                    x = tl.load(X + (row0 + 3) * stride_xm + kk, mask=kmask, other=0.0).to(tl.float32)
                    acc3 += tl.sum(w * x[None, :, :], axis=2)
        out = Y + pid_k * stride_ys + offs_n
        tl.store(out + row0 * stride_ym, tl.sum(acc0, axis=1).to(Y.dtype.element_ty), mask=mask_n & (row0 < M))
        if ROWS > 1:
            tl.store(out + (row0 + 1) * stride_ym, tl.sum(acc1, axis=1).to(Y.dtype.element_ty),
                     mask=mask_n & (row0 + 1 < M))
        if ROWS > 2:
            tl.store(out + (row0 + 2) * stride_ym, tl.sum(acc2, axis=1).to(Y.dtype.element_ty),
                     mask=mask_n & (row0 + 2 < M))
            tl.store(out + (row0 + 3) * stride_ym, tl.sum(acc3, axis=1).to(Y.dtype.element_ty),
                     mask=mask_n & (row0 + 3 < M))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """How the kernel walks one weight: tile sizes, launch shape and the unpacking / product form.
    Chosen from the weight's shape and format only (`tile_config`), never from M, so a row's sum
    runs in the same order in a decode step, a verify pass or a batch."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    unpack_words: bool = True  # load whole words and split them (bits 2/4/8 only)
    w_first: bool = True  # W as the product's left operand: y^T = W x^T (the 16 rows are the narrow side)
    half_dot: bool = False  # multiply in the activations' dtype (bf16/fp16) instead of TF32
    slots: bool = False  # one product per bit slot of the words (bits 2/4/8): no reshape of the decoded tile
    fma_rows: int = 0  # > 0: passes up to FMA_MAX_ROWS rows take the CUDA-core kernel, this many rows a program (1, 2 or 4)

    def fits(self, bits: int, group_size: int, dtype: torch.dtype) -> "TileConfig":
        """This config with what the format or dtype cannot use turned off."""
        words = self.unpack_words and 32 % bits == 0 and self.block_k % group_size == 0
        half = self.half_dot and dtype in (torch.float16, torch.bfloat16)
        pow2 = 32 % bits == 0 and group_size % (32 // bits) == 0
        return dataclasses.replace(self, unpack_words=words, half_dot=half, slots=self.slots and pow2,
                                   fma_rows=self.fma_rows if pow2 else 0)


# the fastest measured on an H200 (scripts/gpu_quant_tiles.py, docs/benchmarks.md): whole-word
# unpacking, W as the left operand, bf16 products for bf16 activations
DEFAULT_TILES = TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, unpack_words=True, w_first=True,
                           half_dot=True)
WORDS_PER_TILE = 64  # the slot form's K tile starts at this many packed words (the tile sweep)


@functools.cache
def _override() -> dict:
    """VERISPEC_QUANT_TILES='{"block_n": 128, ...}': TileConfig fields for every weight (a tuning
    knob for scripts/gpu_quant_tiles.py's findings; unknown fields are an error)."""
    raw = os.environ.get("VERISPEC_QUANT_TILES")
    if not raw:
        return {}
    fields = json.loads(raw)
    unknown = set(fields) - {f.name for f in dataclasses.fields(TileConfig)}
    if unknown:
        raise ValueError(f"VERISPEC_QUANT_TILES: unknown fields {sorted(unknown)} "
                         f"(accepted: {', '.join(f.name for f in dataclasses.fields(TileConfig))})")
    return fields


def tile_config(n: int, k: int, bits: int, group_size: int, dtype: torch.dtype) -> TileConfig:
    """The tile configuration for a weight [n, k] of `bits` and `group_size` (not M-dependent)."""
    return dataclasses.replace(DEFAULT_TILES, **_override()).fits(bits, group_size, dtype)


def default_split_k(n: int, k: int, device: torch.device, block_n: int = 64, block_k: int = 128) -> int:
    """Slices of K per output tile, so that a matrix with few output tiles still spreads over
    every multiprocessor (about two programs each); a power of two. It depends on the weight's
    shape and the device only, never on M: decode and verify passes sum in the same order."""
    if device.type != "cuda":
        return 1
    tiles = -(-n // block_n)
    want = max(1, min(k // block_k, (2 * _multiprocessors(device.index or 0)) // tiles))
    return 1 << (want.bit_length() - 1)


def dequant_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                   bits: int, group_size: int, zero_point: bool = False, split_k: int | None = None,
                   tiles: TileConfig | None = None) -> torch.Tensor:
    """x [M, K] (float32, float16 or bfloat16); packed [N, W] int32; scales, offsets
    [N, K/group_size] -> y [M, N] in x's dtype, accumulated in float32. With split_k > 1 (default:
    `default_split_k`) each slice of K writes float32 partial sums, added in a fixed order."""
    m, k = x.shape
    n, num_groups = scales.shape
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"dequant_matmul: bits={bits} (supported: {', '.join(map(str, SUPPORTED_BITS))})")
    if num_groups * group_size != k or offsets.shape != scales.shape or packed.shape[0] != n:
        raise ValueError(f"dequant_matmul: x [{m}, {k}], packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, "
                         f"offsets {tuple(offsets.shape)} do not fit group_size {group_size}")
    if packed.dtype != torch.int32:
        packed = packed.view(torch.int32)
    x, packed, scales, offsets = x.contiguous(), packed.contiguous(), scales.contiguous(), offsets.contiguous()
    cfg = (tiles or tile_config(n, k, bits, group_size, x.dtype)).fits(bits, group_size, x.dtype)
    if x.device.type != "cuda":  # Triton's interpreter (tests on CPU) multiplies bf16 tiles wrongly
        cfg = dataclasses.replace(cfg, half_dot=False)
    split_k = split_k or default_split_k(n, k, x.device, cfg.block_n, cfg.block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slices
    y = torch.empty(split_k, m, n, dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    if cfg.fma_rows and m <= FMA_MAX_ROWS:
        grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, cfg.fma_rows))
        _dequant_gemv_kernel[grid](x, packed, scales, offsets, y, m, n,
                                   x.stride(0), packed.stride(0), scales.stride(0), y.stride(0), y.stride(1),
                                   K=k, K_PER_SPLIT=k_per_split, BITS=bits, GROUP=group_size, ZERO_POINT=zero_point,
                                   ROWS=cfg.fma_rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                   num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return y[0] if split_k == 1 else y.sum(0).to(x.dtype)
    grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, BLOCK_M))
    _dequant_matmul_kernel[grid](x, packed, scales, offsets, y, m, n,
                                 x.stride(0), packed.stride(0), scales.stride(0), y.stride(0), y.stride(1),
                                 K=k, K_PER_SPLIT=k_per_split, BITS=bits, GROUP=group_size, ZERO_POINT=zero_point,
                                 IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
                                 BLOCK_K=cfg.block_k, UNPACK_WORDS=cfg.unpack_words, W_FIRST=cfg.w_first,
                                 HALF_DOT=cfg.half_dot, SLOTS=cfg.slots, num_warps=cfg.num_warps,
                                 num_stages=cfg.num_stages)
    return y[0] if split_k == 1 else y.sum(0).to(x.dtype)
