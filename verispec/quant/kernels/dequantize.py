"""Dequantizing a group-quantized weight in one pass: packed words [R, K*bits/32] int32, scales /
offsets [R, K/group] -> w [R, K] in the model's dtype. What prefill multiplies by (one GEMM over
the pass's rows) and what quantized experts' grouped GEMM reads; torch's form of the same
(`QuantizedLinear.dequantized_weight` on the CPU) goes through int32 and float32 temporaries of
the whole matrix, several kernels and 10+ bytes per value, this reads each word once and writes
each value once.

w = q * s + o (affine) or (q - o) * s (zero point), computed in float32 with the multiply and the
add rounded separately (no contraction), as torch computes it, then rounded to the output dtype.
Bits 2, 4 and 8 (no value straddles a word); other widths keep torch's form.
"""
from __future__ import annotations

import torch

from verispec.kernels.triton_import import require_triton
from verispec.quant.packing import unpack_rows

try:
    require_triton()
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None

SUPPORTED_BITS = (2, 4, 8)
BLOCK_ROWS = 16
BLOCK_WORDS = 32


def available(device: torch.device, bits: int) -> bool:
    return triton is not None and device.type == "cuda" and bits in SUPPORTED_BITS


if triton is not None:

    @triton.jit
    def _dequantize_kernel(WQ, S, O, OUT, R, stride_wr, stride_sr, stride_or, K: tl.constexpr, BITS: tl.constexpr,
                           GROUP: tl.constexpr, ZERO_POINT: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_W: tl.constexpr):
        PER_WORD: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = K // PER_WORD
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        mask = (rows[:, None] < R) & (words[None, :] < WORDS)
        w = tl.load(WQ + rows[:, None].to(tl.int64) * stride_wr + words[None, :], mask=mask, other=0)
        shifts = tl.arange(0, PER_WORD) * BITS
        q = ((w[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)).to(tl.float32)  # [R, W, PER_WORD]
        k = words[:, None] * PER_WORD + tl.arange(0, PER_WORD)[None, :]  # [W, PER_WORD]
        mask3 = mask[:, :, None] & (k < K)[None, :, :]
        meta = rows[:, None, None].to(tl.int64) * stride_sr + (k // GROUP)[None, :, :]
        s = tl.load(S + meta, mask=mask3, other=0.0).to(tl.float32)
        o = tl.load(O + meta, mask=mask3, other=0.0).to(tl.float32)
        if ZERO_POINT:
            val = (q - o) * s
        else:
            val = q * s + o
        out = OUT + rows[:, None, None].to(tl.int64) * stride_or + k[None, :, :]
        tl.store(out, val.to(OUT.dtype.element_ty), mask=mask3)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group_size: int,
               zero_point: bool, dtype: torch.dtype) -> torch.Tensor:
    """packed [R, K*bits/32]; scales, offsets [R, K/group_size] -> [R, K] in `dtype` (CUDA)."""
    r = packed.shape[0]
    k = scales.shape[1] * group_size
    if packed.dtype != torch.int32:
        packed = packed.view(torch.int32)
    packed, scales, offsets = packed.contiguous(), scales.contiguous(), offsets.contiguous()
    out = torch.empty(r, k, dtype=dtype, device=packed.device)
    grid = (triton.cdiv(r, BLOCK_ROWS), triton.cdiv(k // (32 // bits), BLOCK_WORDS))
    _dequantize_kernel[grid](packed, scales, offsets, out, r, packed.stride(0), scales.stride(0), out.stride(0),
                             K=k, BITS=bits, GROUP=group_size, ZERO_POINT=zero_point, BLOCK_R=BLOCK_ROWS,
                             BLOCK_W=BLOCK_WORDS, enable_fp_fusion=False)
    return out


def decode(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group_size: int,
           zero_point: bool, dtype: torch.dtype) -> torch.Tensor:
    """packed [R, W]; scales, offsets [R, G] -> [R, G*group_size] in `dtype`, decoded in float32
    (float64 for a float64 `dtype`): the kernel where it runs, torch's form of the same values
    elsewhere (`decode_torch`). Quantized layers' weights and expert stacks decode through here."""
    if available(packed.device, bits) and torch.promote_types(dtype, torch.float32) == torch.float32:
        return dequantize(packed, scales, offsets, bits, group_size, zero_point, dtype)
    return decode_torch(packed, scales, offsets, bits, group_size, zero_point, dtype)


def decode_torch(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group_size: int,
                 zero_point: bool, dtype: torch.dtype) -> torch.Tensor:
    """`decode`'s values in torch's form on any device (embedding lookups take it: a few rows per
    step, inside captured decode graphs where the kernel has not been measured)."""
    return decode_values(unpack_rows(packed, bits, scales.shape[1] * group_size), scales, offsets, zero_point, dtype)


def decode_values(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, zero_point: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    """q [R, K] unsigned codes; scales, offsets [R, G] -> [R, K] in `dtype`, as decode_torch."""
    compute = torch.promote_types(dtype, torch.float32)
    rows, num_groups = scales.shape
    q = q.view(rows, num_groups, -1).to(compute)
    s, o = scales.to(compute).unsqueeze(-1), offsets.to(compute).unsqueeze(-1)
    w = (q - o) * s if zero_point else q * s + o
    return w.view(rows, -1).to(dtype)
