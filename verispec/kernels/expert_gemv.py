"""Matrix-vector products with routed experts' weights, read in place: the decode / verify path
of a mixture-of-experts layer (a few token/expert pairs).

For pair p with expert e_p:  y[p] = W[e_p] @ x[p // rows_per_x]
W is one of the fused 3-D expert tensors ([E, N, K]: `gate_up_proj` [E, 2I, H] or `down_proj`
[E, H, I]); the expert ids come from a device tensor, so a step needs no host sync and can be
captured in a CUDA graph. Each selected expert's matrix is streamed once per pair: no sort, no
histogram, no gathered copy of the weights (what torch's grouped GEMM path needs around it, for
tiles that are mostly empty at one token).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch paths are used instead
    triton = None
    tl = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _expert_gemv_kernel(X, W, IDX, Y,
                            stride_xp, stride_we, stride_wn, stride_yp,
                            N: tl.constexpr, K: tl.constexpr, ROWS_PER_X: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pair = tl.program_id(1)
        expert = tl.load(IDX + pair).to(tl.int64)
        x_row = pair // ROWS_PER_X
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = W + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            mask_k = k < K
            x = tl.load(X + x_row * stride_xp + k, mask=mask_k, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(Y + pair * stride_yp + offs_n, acc.to(Y.dtype.element_ty), mask=mask_n)


def expert_gemv(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor, rows_per_x: int = 1,
                block_n: int = 32, block_k: int = 128) -> torch.Tensor:
    """x [R, K] (row r serves pairs r*rows_per_x .. r*rows_per_x + rows_per_x - 1);
    weight [E, N, K] (last dim contiguous); expert_ids [P] with P = R * rows_per_x -> y [P, N]
    in x's dtype, accumulated in float32."""
    pairs = expert_ids.numel()
    e, n, k = weight.shape
    if x.shape[-1] != k or weight.stride(-1) != 1:
        raise ValueError(f"expert_gemv: x [{', '.join(map(str, x.shape))}] against weight [{e}, {n}, {k}] "
                         "(needs x's last dim == K and a contiguous last weight dim)")
    if x.shape[0] * rows_per_x != pairs:
        raise ValueError(f"expert_gemv: {x.shape[0]} rows x {rows_per_x} != {pairs} expert ids")
    x = x.contiguous()
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), pairs)
    _expert_gemv_kernel[grid](x, weight, expert_ids.reshape(-1), y,
                              x.stride(0), weight.stride(0), weight.stride(1), y.stride(0),
                              N=n, K=k, ROWS_PER_X=rows_per_x, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
