"""Group-quantized linear layers under exact numerics: every pass, whatever its row count, computes
y = x @ W^T with W the weight decoded to the activations' dtype, summed by the same tensor-core
chain as the dense kernel (verispec/kernels/linear.py): K in order, no split. Short passes (decode,
verify, batches of them) decode each weight tile inside the product; wide ones (prompt chunks)
decode the whole weight once with the same decoder (`matmul.decode_tile`), then run the dense
kernel on it. So a token's rows are the same bits in a decode step, a verify pass, a batch and a
prompt chunk. The fast path's kernels (frag, mma, gemv, tinygemm) each sum in their own order and
are not used here (docs/quantization.md, "Exact numerics").
"""
from __future__ import annotations

import torch

from verispec.kernels import linear as dense
from verispec.kernels.triton_import import require_triton
from verispec.quant.kernels import matmul

try:
    require_triton()
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

FUSED_MAX_ROWS = 64  # passes up to this many rows decode inside the product; wider ones decode the weight first
BLOCK_K = 128


if triton is not None:

    @triton.jit
    def _exact_product_kernel(X, WQ, S, O, Y, M, N, stride_xm, stride_wn, stride_sn, stride_ym, K: tl.constexpr,
                              BITS: tl.constexpr, GROUP: tl.constexpr, ZERO_POINT: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              UNPACK_WORDS: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        rows_w = WQ + offs_n[:, None].to(tl.int64) * stride_wn
        rows_s = offs_n[:, None].to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            k = k_start + tl.arange(0, BLOCK_K)
            mask_k = k < K
            x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = matmul.decode_tile(rows_w, rows_s, S, O, k_start, k, mask_n, mask_k, K, BITS, GROUP, ZERO_POINT,
                                   BLOCK_N, BLOCK_K, UNPACK_WORDS)
            w = tl.where(mask_n[:, None] & mask_k[None, :], w, 0.0).to(X.dtype.element_ty)
            acc = tl.dot(x, tl.trans(w), acc)
        tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def _exact_decode_kernel(WQ, S, O, W, N, stride_wn, stride_sn, stride_on, K: tl.constexpr, BITS: tl.constexpr,
                             GROUP: tl.constexpr, ZERO_POINT: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, UNPACK_WORDS: tl.constexpr):
        pid_n = tl.program_id(0)
        k_start = tl.program_id(1) * BLOCK_K
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = k_start + tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mask_k = k < K
        w = matmul.decode_tile(WQ + offs_n[:, None].to(tl.int64) * stride_wn, offs_n[:, None].to(tl.int64) * stride_sn,
                               S, O, k_start, k, mask_n, mask_k, K, BITS, GROUP, ZERO_POINT, BLOCK_N, BLOCK_K,
                               UNPACK_WORDS)
        tl.store(W + offs_n[:, None].to(tl.int64) * stride_on + k[None, :], w.to(W.dtype.element_ty),
                 mask=mask_n[:, None] & mask_k[None, :])


def unsupported_reason(device: torch.device, dtype: torch.dtype, bits: int) -> str | None:
    """Why exact numerics cannot run this layer on `device` in `dtype` (None: they can)."""
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda":
        return f"device {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"activations in {dtype}"
    if bits not in matmul.SUPPORTED_BITS:
        return f"{bits}-bit weights"
    return None


def _unpack_words(bits: int, group_size: int) -> bool:
    return 32 % bits == 0 and BLOCK_K % group_size == 0


def decoded_weight(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group_size: int,
                   zero_point: bool, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight [N, K] decoded to `dtype` by the decoder the fused product uses."""
    n, num_groups = scales.shape
    k = num_groups * group_size
    w = torch.empty(n, k, dtype=dtype, device=packed.device)
    block_n = 64
    _exact_decode_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, BLOCK_K))](
        packed.view(torch.int32), scales, offsets, w, n, packed.stride(0), scales.stride(0), w.stride(0),
        K=k, BITS=bits, GROUP=group_size, ZERO_POINT=zero_point, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        UNPACK_WORDS=_unpack_words(bits, group_size), num_warps=4)
    return w


def exact_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                 group_size: int, zero_point: bool) -> torch.Tensor:
    """x [M, K] -> y [M, N]: the dense kernel's chain over the decoded weight, at any M."""
    m, k = x.shape
    n = scales.shape[0]
    if m > FUSED_MAX_ROWS:
        return dense.linear(x, decoded_weight(packed, scales, offsets, bits, group_size, zero_point, x.dtype))
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n = 32 if n <= 16384 else 64
    _exact_product_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, packed.view(torch.int32), scales, offsets, y, m, n, x.stride(0), packed.stride(0), scales.stride(0),
        y.stride(0), K=k, BITS=bits, GROUP=group_size, ZERO_POINT=zero_point, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=BLOCK_K, UNPACK_WORDS=_unpack_words(bits, group_size), num_warps=4, num_stages=4)
    return y
