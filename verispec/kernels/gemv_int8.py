"""8-bit group-quantized weights times a few rows of activations (decode and verify passes), on CUDA
cores: y[M, N] = x[M, K] @ dequant(W)[N, K]^T for M <= MAX_ROWS.

Why not the tensor-core kernel (kernels/quant_matmul.py) for these passes: it pads M to 16 rows and
decodes every weight to float32 before its product, so at one row it is compute-bound at ~27% of
the copy bandwidth (docs/benchmarks.md, tenth session). Here each program streams BLOCK_N weight
rows as bytes (an 8-bit value is one byte of the little-endian packed words) and folds the group's
affine map into the sums instead of into every weight:
  affine (MLX):              sum_k (q s + o) x = s * sum_k q x + o * sum_k x
  zero point (compressed-tensors): sum_k (q - o) s x = s * (sum_k q x - o * sum_k x)
per group of `group_size` columns, all in float32.

Rows: a program always works on BLOCK_M = 4 rows (masked past M), with a grid axis over blocks of
4, so a row's sums run in the same order whatever M is: a decode step and a verify pass agree row
by row. K is never split (no partial sums to add in another kernel).

`quant_matmul.dequant_matmul_reference` is the definition it is tested against.
"""
from __future__ import annotations

import dataclasses

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None

BLOCK_M = 4
MAX_ROWS = 8  # passes up to this many rows take this kernel (weights are read once per 4 rows)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


DEFAULT = GemvConfig()


def supported(bits: int, group_size: int, in_features: int, cfg: GemvConfig = DEFAULT) -> bool:
    return (triton is not None and bits == 8 and cfg.block_k % group_size == 0
            and in_features % group_size == 0)


if triton is not None:

    @triton.jit
    def _gemv_int8_kernel(X, WQ, S, O, Y, M, N, stride_xm, stride_wn, stride_sn, stride_ym,
                          K: tl.constexpr, GROUP: tl.constexpr, ZERO_POINT: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_n = offs_n < N
        mask_m = offs_m < M
        rows_w = WQ + offs_n[:, None].to(tl.int64) * stride_wn
        rows_s = offs_n[:, None].to(tl.int64) * stride_sn
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            mask_k = k < K
            q = tl.load(rows_w + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0).to(tl.float32)
            x = tl.load(X + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)
            qx = tl.reshape(q[:, None, :] * x[None, :, :], [BLOCK_N, BLOCK_M, GROUPS, GROUP])
            dots = tl.sum(qx, axis=3)  # [BLOCK_N, BLOCK_M, GROUPS]: sum_k q x per group
            x_sums = tl.sum(tl.reshape(x, [BLOCK_M, GROUPS, GROUP]), axis=2)  # [BLOCK_M, GROUPS]
            group = k0 // GROUP + tl.arange(0, GROUPS)
            gmask = mask_n[:, None] & (group < K // GROUP)[None, :]
            s = tl.load(S + rows_s + group[None, :], mask=gmask, other=0.0).to(tl.float32)[:, None, :]
            o = tl.load(O + rows_s + group[None, :], mask=gmask, other=0.0).to(tl.float32)[:, None, :]
            if ZERO_POINT:
                acc += tl.sum(s * (dots - o * x_sums[None, :, :]), axis=2)
            else:
                acc += tl.sum(s * dots + o * x_sums[None, :, :], axis=2)
        tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
                 mask=mask_n[:, None] & mask_m[None, :])


def gemv_int8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
              group_size: int, zero_point: bool = False, cfg: GemvConfig = DEFAULT) -> torch.Tensor:
    """x [M, K] (float32, float16 or bfloat16); packed [N, K/4] int32 words of 8-bit values; scales,
    offsets [N, K/group_size] -> y [M, N] in x's dtype, accumulated in float32."""
    m, k = x.shape
    n, num_groups = scales.shape
    if num_groups * group_size != k or offsets.shape != scales.shape or packed.shape != (n, k // 4):
        raise ValueError(f"gemv_int8: x [{m}, {k}], packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, "
                         f"offsets {tuple(offsets.shape)} do not fit 8-bit values in group_size {group_size}")
    if cfg.block_k % group_size:
        raise ValueError(f"gemv_int8: block_k {cfg.block_k} is not a multiple of group_size {group_size}")
    weight = packed.contiguous().view(torch.uint8)  # [N, K]: little-endian words hold values in order
    x, scales, offsets = x.contiguous(), scales.contiguous(), offsets.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, BLOCK_M))
    _gemv_int8_kernel[grid](x, weight, scales, offsets, y, m, n, x.stride(0), weight.stride(0), scales.stride(0),
                            y.stride(0), K=k, GROUP=group_size, ZERO_POINT=zero_point, BLOCK_M=BLOCK_M,
                            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
                            num_stages=cfg.num_stages)
    return y
