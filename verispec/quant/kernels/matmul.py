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

import torch

from verispec.kernels.triton_import import require_triton
from verispec.quant.packing import unpack_rows

try:
    require_triton()
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the layers dequantize with torch instead
    triton = None
    tl = None

BLOCK_M = 16  # rows per tile: tl.dot's smallest, and a decode or verify pass fits in one
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
    def decode_tile(rows_w, rows_s, S, O, k_start, k, mask_n, mask_k, K: tl.constexpr, BITS: tl.constexpr,
                    GROUP: tl.constexpr, ZERO_POINT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    UNPACK_WORDS: tl.constexpr):
        """The weights of columns k (from k_start, BLOCK_K of them) of the rows `rows_w` point at,
        decoded in float32: [BLOCK_N, BLOCK_K]. Every kernel that decodes a tile calls this, so a
        weight decodes to the same bits in each (quant/kernels/exact.py relies on that)."""
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
        return w

    @triton.jit
    def _dequant_matmul_kernel(X, WQ, S, O, Y, M, N,
                               stride_xm, stride_wn, stride_sn, stride_ys, stride_ym, K: tl.constexpr,
                               K_PER_SPLIT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                               ZERO_POINT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNPACK_WORDS: tl.constexpr,
                               W_FIRST: tl.constexpr, HALF_DOT: tl.constexpr):
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
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            k_start = pid_k * K_PER_SPLIT + k0
            k = k_start + tl.arange(0, BLOCK_K)
            mask_k = k < K
            x = tl.load(X + offs_m[:, None] * stride_xm + k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = decode_tile(rows_w, rows_s, S, O, k_start, k, mask_n, mask_k, K, BITS, GROUP, ZERO_POINT, BLOCK_N,
                            BLOCK_K, UNPACK_WORDS)
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
                    acc += tl.dot(w, tl.trans(x), input_precision=PRECISION)
                else:
                    acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        out = Y + pid_k * stride_ys
        if W_FIRST:
            tl.store(out + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
                     mask=mask_n[:, None] & mask_m[None, :])
        else:
            tl.store(out + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                     mask=mask_m[:, None] & mask_n[None, :])


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

    def fits(self, bits: int, group_size: int, dtype: torch.dtype) -> "TileConfig":
        """This config with what the format or dtype cannot use turned off."""
        words = self.unpack_words and 32 % bits == 0 and self.block_k % group_size == 0
        half = self.half_dot and dtype in (torch.float16, torch.bfloat16)
        return dataclasses.replace(self, unpack_words=words, half_dot=half)


# the fastest measured on an H200 (docs/benchmarks.md): whole-word
# unpacking, W as the left operand, bf16 products for bf16 activations
DEFAULT_TILES = TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, unpack_words=True, w_first=True,
                           half_dot=True)


def tile_config(n: int, k: int, bits: int, group_size: int, dtype: torch.dtype) -> TileConfig:
    """The tile configuration for a weight [n, k] of `bits` and `group_size` (not M-dependent)."""
    return DEFAULT_TILES.fits(bits, group_size, dtype)


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
    if not cfg.unpack_words and x.dtype == torch.float32:
        # value-by-value decoding pipelines four full [block_n, block_k] tiles (words, straddling
        # words, scales, offsets) per stage; in float32 three stages need 311 KB of shared memory
        # (H200: 227 KB)
        cfg = dataclasses.replace(cfg, num_stages=1)
    split_k = split_k or default_split_k(n, k, x.device, cfg.block_n, cfg.block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slices
    y = torch.empty(split_k, m, n, dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), split_k, triton.cdiv(m, BLOCK_M))
    _dequant_matmul_kernel[grid](x, packed, scales, offsets, y, m, n,
                                 x.stride(0), packed.stride(0), scales.stride(0), y.stride(0), y.stride(1),
                                 K=k, K_PER_SPLIT=k_per_split, BITS=bits, GROUP=group_size, ZERO_POINT=zero_point,
                                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M,
                                 BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UNPACK_WORDS=cfg.unpack_words,
                                 W_FIRST=cfg.w_first,
                                 HALF_DOT=cfg.half_dot, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y[0] if split_k == 1 else y.sum(0).to(x.dtype)
