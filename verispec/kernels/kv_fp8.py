"""The fp8 KV-cache format (`--kv-cache-dtype fp8`): float8 e4m3 codes with one power-of-two scale per
(token, kv head), stored as its biased float32 exponent in one byte beside the codes.

Why a scale per token and head, not one static scale per layer/head or one per block: a static
scale needs calibration data this server does not have (an outlier past 448 x scale would
saturate), and a block's scale would change as later tokens land in the block, so a row's value
would depend on what was written after it (a prefix-cache hit, a rollback). A row's own scale
depends on that row alone, so encoding is the same in every pass: prompt chunk, decode, verify.

Why a power of two: dividing by it and multiplying by it are exact, so the only rounding is to
e4m3's grid (round to nearest even, done in float32 bit arithmetic here: the cast of a value
already on the grid is exact everywhere, where casts that round differ, as Triton's interpreter
does from a GPU on ties that carry into the exponent), and the decoded value code x scale (4
significant bits) is exact in bfloat16, float16 and float32. Triton (`encode` / `decode` below) and torch
(`encode_reference` / `decode_reference`) therefore give the same bits, and attention over the
compressed blocks equals attention over their decoded copy. A power-of-two scale costs no
relative precision: e4m3 keeps 3 mantissa bits over its whole normal range.

Bytes per token and layer: 2 x Hkv x (D + 1), against 2 x Hkv x 2D for bfloat16 (1.98x at D=128).
"""
from __future__ import annotations

import torch

from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch functions stand in
    triton = None
    tl = None

CODE_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.uint8  # the scale's biased float32 exponent: scale = 2 ** (e - 127)
MAX = 448.0  # the largest e4m3 value
# the scale is the smallest power of two 2^k with amax / 2^k <= 448 = 1.75 x 2^8: with amax =
# (1 + m / 2^23) x 2^(E - 127), that is k = E - 135 when the mantissa fraction is <= 0.75, else E - 134
_MANTISSA_AT_1_75 = 6291456  # 0.75 x 2^23
_SUBNORMAL = 2.0 ** -6  # below it e4m3 steps by 2^-9
_SUBNORMAL_ROUNDER = 24576.0  # 1.5 x 2^14: (y + it) - it rounds y to a multiple of 2^-9, ties to even


def bytes_per_token(num_kv_heads: int, head_dim: int) -> int:
    """One layer's K and V of one token: codes plus one scale byte per head."""
    return 2 * num_kv_heads * (head_dim + 1)


def scale_exponents(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> the biased exponent [...] (uint8) of each row's power-of-two scale."""
    amax = x.float().abs().amax(-1)
    bits = amax.view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    k = torch.where(mantissa <= _MANTISSA_AT_1_75, exponent - 135, exponent - 134)
    k = torch.where(amax > 0, k, 0).clamp(-126, 126)  # all-zero rows: scale 1
    return (k + 127).to(SCALE_DTYPE)


def _power_of_two(biased: torch.Tensor) -> torch.Tensor:
    return (biased.to(torch.int32) << 23).view(torch.float32)


def encode_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes [..., D] e4m3, scale exponents [...] uint8)."""
    exponents = scale_exponents(x)
    inverse = _power_of_two(254 - exponents.to(torch.int32))  # 2^-k, exact
    y = x.float() * inverse[..., None]
    return _round_to_grid(y).clamp(-MAX, MAX).to(CODE_DTYPE), exponents


def _round_to_grid(y: torch.Tensor) -> torch.Tensor:
    """float32 y -> the nearest e4m3 value (ties to even), still float32: normal values keep 3 of
    their 23 mantissa bits (round half to even on the bit pattern), subnormal ones a multiple of 2^-9."""
    bits = y.view(torch.int32)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).view(torch.float32)
    subnormal = (y + _SUBNORMAL_ROUNDER) - _SUBNORMAL_ROUNDER
    return torch.where(y.abs() < _SUBNORMAL, subnormal, normal)


def decode_reference(codes: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] e4m3, exponents [...] -> values [..., D] in `dtype` (exact in 16-bit floats)."""
    return (codes.float() * _power_of_two(exponents)[..., None]).to(dtype)


if triton is not None:

    @triton.jit
    def encode(x):
        """A tile x [..., D] (rows along the last axis) -> (e4m3 codes, uint8 scale exponents [...]),
        bit for bit `encode_reference`."""
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), len(xf.shape) - 1)
        bits = amax.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) & 0xFF
        k = tl.where((bits & 0x7FFFFF) <= 6291456, exponent - 135, exponent - 134)
        k = tl.minimum(tl.maximum(tl.where(amax > 0, k, 0), -126), 126)
        inverse = ((127 - k) << 23).to(tl.float32, bitcast=True)
        y = xf * tl.expand_dims(inverse, len(xf.shape) - 1)
        y = tl.minimum(tl.maximum(_grid(y), -448.0), 448.0)
        return y.to(tl.float8e4nv), (k + 127).to(tl.uint8)

    @triton.jit
    def _grid(y):
        """`_round_to_grid` of the torch path, the same bit arithmetic."""
        bits = y.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        subnormal = (y + 24576.0) - 24576.0
        return tl.where(tl.abs(y) < 0.015625, subnormal, normal)

    @triton.jit
    def decode(codes, exponents, dtype: tl.constexpr):
        """codes [..., D] e4m3 and their rows' exponents [...] -> values in `dtype`."""
        scale = (exponents.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        return (codes.to(tl.float32) * tl.expand_dims(scale, len(codes.shape) - 1)).to(dtype)
