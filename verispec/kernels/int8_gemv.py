"""8-bit weights times a few rows on CUDA cores: the decode / verify product for 8-bit layers.

The tensor-core kernel (quant_matmul.py) pads every pass to 16 rows and pays per decoded value
for unpacking, conversion to the product's dtype and the operand's layout change: measured flat
at 7.4 ms per Qwen3-8B step at 8 bits, 0.61x a bf16 step, whatever M is. At 1-8 rows a product
is a matrix-vector one, bound by reading the weights, so this kernel skips the tensor cores:
- the packed int32 words of an 8-bit layer are its values in order, one byte each (both layouts
  pack the lowest bits first), so the weight is read as uint8 [N, K] with no unpacking;
- a K step is exactly one quantization group, so the group's scale and offset are one value per
  output row, broadcast over the step;
- each program keeps float32 partial products per (row, output, lane) and reduces over K once at
  the end, so the loop has no cross-lane traffic.

A row's sum runs in the same order whatever M is (the K split and the step depend on the weight's
shape and the device only), so a verify pass of k+1 rows gives each row what a decode step gives
it. Its torch reference is quant_matmul.dequant_matmul_reference.
"""
from __future__ import annotations

import torch

from verispec.kernels.quant_matmul import _multiprocessors

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton
    triton = None

MAX_ROWS = 8  # wider passes go to the tensor-core kernel or a dequantized GEMM
GROUP_SIZES = (32, 64, 128)


def available(device: torch.device) -> bool:
    return triton is not None and device.type in ("cuda", "cpu")


if triton is not None:

    @triton.jit
    def _gemv_kernel(X, WQ, S, O, Y, N, stride_xm, stride_wn, stride_sn, stride_ys, stride_ym,
                     K_PER_SPLIT: tl.constexpr, GROUP: tl.constexpr, ZERO_POINT: tl.constexpr,
                     BLOCK_M: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_g = tl.arange(0, GROUP)
        mask_m = offs_m < M
        mask_n = offs_n < N
        rows_w = WQ + offs_n[:, None].to(tl.int64) * stride_wn
        rows_s = offs_n.to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N, GROUP], dtype=tl.float32)
        k_first = pid_k * K_PER_SPLIT
        for k0 in range(0, K_PER_SPLIT, GROUP):
            k = k_first + k0
            q = tl.load(rows_w + (k + offs_g)[None, :], mask=mask_n[:, None], other=0).to(tl.uint32)
            q = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # exact: 2**23 + q - 2**23
            g = k // GROUP
            s = tl.load(S + rows_s + g, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            o = tl.load(O + rows_s + g, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            if ZERO_POINT:
                w = (q - o) * s
            else:
                w = q * s + o
            x = tl.load(X + offs_m[:, None] * stride_xm + (k + offs_g)[None, :], mask=mask_m[:, None],
                        other=0.0).to(tl.float32)
            acc += w[None, :, :] * x[:, None, :]
        y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
        out = Y + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, y.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def supports(bits: int, group_size: int, rows: int, in_features: int) -> bool:
    return bits == 8 and group_size in GROUP_SIZES and 1 <= rows <= MAX_ROWS and in_features % group_size == 0


def split_k(n: int, k: int, group_size: int, device: torch.device) -> int:
    """Slices of K, from the weight's shape and the device only (never M): about eight programs
    per multiprocessor over 32-wide output tiles; a power of two (gemv halves it until the groups
    divide evenly)."""
    if device.type != "cuda":
        return 1
    tiles = -(-n // 32)
    want = max(1, min(k // (4 * group_size), (8 * _multiprocessors(device.index or 0)) // tiles))
    return 1 << (want.bit_length() - 1)


def gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
         zero_point: bool = False, block_n: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """x [M, K], M <= 8 (float32, float16 or bfloat16); packed [N, K/4] int32 (8-bit values, lowest
    byte first); scales, offsets [N, K/group_size] -> y [M, N] in x's dtype, summed in float32:
    w = scales * q + offsets, or (q - offsets) * scales with `zero_point`. block_n / num_warps:
    for tuning (scripts/gpu_int8_gemv.py); neither changes the order of a row's sum."""
    m, k = x.shape
    n = packed.shape[0]
    if not supports(8, group_size, m, k) or packed.shape[1] * 4 != k or scales.shape != (n, k // group_size):
        raise ValueError(f"int8 gemv: x [{m}, {k}], packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, "
                         f"group {group_size} (needs 1..{MAX_ROWS} rows, groups {GROUP_SIZES}, 8-bit words)")
    weights = packed.contiguous().view(torch.uint8)  # [N, K]: the words' bytes are the values in order
    x, scales, offsets = x.contiguous(), scales.contiguous(), offsets.contiguous()
    num_groups = k // group_size
    splits = split_k(n, k, group_size, x.device)
    while num_groups % splits:  # equal slices of whole groups: no step reads past K
        splits //= 2
    k_per_split = k // splits
    block_m = max(1, triton.next_power_of_2(m))
    block_n = block_n or max(8, 32 // block_m)  # the accumulator stays within registers as M grows
    y = torch.empty(splits, m, n, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), splits)
    _gemv_kernel[grid](x, weights, scales, offsets, y, n, x.stride(0), weights.stride(0), scales.stride(0),
                       y.stride(0), y.stride(1), K_PER_SPLIT=k_per_split, GROUP=group_size, ZERO_POINT=zero_point,
                       BLOCK_M=block_m, M=m, BLOCK_N=block_n, num_warps=num_warps)
    return y[0] if splits == 1 else y.sum(0).to(x.dtype)
