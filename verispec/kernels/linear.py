"""A dense linear layer (y = x W^T + b, 16-bit or float32 weights) whose rows do not depend on the
pass they are computed in.

cuBLAS picks its kernel by shape: a one-row decode step, a four-row verify pass and a 2,048-row prompt
chunk run different kernels (split-K among them), so the same row sums its products in different
orders and bf16 near-ties flip. Here every pass runs one Triton kernel whose reduction over K is the
same at every row count: each output is a chain of tensor-core products over K in order, 16 columns
at a time, with no split of K. The tiles (rows, columns, K per stage) change with the row count for
speed; they do not change the chain (tests/gpu/test_gpu_exact_kernels.py holds every tile to the same
bits on the GPU). float32 weights take the exact FMA chain (no TF32).
"""
from __future__ import annotations

import dataclasses

import torch

from verispec.kernels import launch
from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: torch's own product runs there
    triton = None
    tl = None


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False  # the persistent kernel whose tiles the copy engine loads (wide passes)
    flatten: bool = False


def tiles_for(rows: int, out_features: int, element_size: int, tma: bool = False) -> Tiles:
    """The tiles for a pass of `rows` rows (measured on the H200, docs/benchmarks.md): narrow column
    tiles for decode and verify passes, so a weight read is spread over every multiprocessor; for
    wide passes the persistent kernel fed by the copy engine (`tma`: sm_90, aligned operands)."""
    if element_size > 2:  # float32: the FMA chain, small tiles
        return Tiles(16 if rows <= 16 else 32, 32, 32, 4, 2)
    if rows <= 16:
        return Tiles(16, 32 if out_features <= 16384 else 64, 128, 4, 4)
    if rows <= 64:
        return Tiles(64, 32 if out_features <= 4096 else 64, 128, 4, 6)
    if not tma:
        return Tiles(128, 128, 64, 8, 3)
    if rows <= 256:
        return Tiles(128, 128, 64, 4, 4, tma=True, flatten=True)
    return Tiles(128, 256, 64, 8, 3, tma=True)


if triton is not None:

    # M at run time, as in the persistent kernel below: specialised (M == 1, M % 16 == 0, other) each
    # tile compiled up to three times, 10 variants of an empty cache's 48 kernels for the default model
    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(X, W, BIAS, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        # GROUP_M row tiles take a column tile in turn, so its weights are read from L2 after the first
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # K in order, no split; columns past K are zeros, whose products leave the chain as it was
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


    @triton.jit
    def _tile_of(tile, num_m, num_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of a flat tile index, GROUP_M row tiles sharing each column tile."""
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m

    # M and the program count are runtime values: as compile-time ones (or specialised on M % 16) each
    # new prompt length compiled the kernel again inside a client's prefill (~0.4 s each on the H200)
    @triton.jit(do_not_specialize=["M", "NUM_PROGRAMS"])
    def _linear_tma_kernel(x_desc, w_desc, y_desc, BIAS, M, N, K, NUM_PROGRAMS,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, FLATTEN: tl.constexpr):
        # persistent: NUM_PROGRAMS programs walk the tiles; the copy engine (TMA) loads the tiles,
        # zero-filling past the edges, so K's last tile adds zeros to the chain as the other kernel's does
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN):
            pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kt in range(k_tiles):
                x = x_desc.load([off_m, kt * BLOCK_K])
                w = w_desc.load([off_n, kt * BLOCK_K])
                acc = tl.dot(x, w.T, acc)
            if HAS_BIAS:
                offs_n = off_n + tl.arange(0, BLOCK_N)
                acc += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


def weight_reason(weight: torch.Tensor) -> str | None:
    """Why `linear` cannot take this weight (None: it can, with activations of its dtype)."""
    if triton is None:
        return "Triton is not installed"
    if weight.device.type != "cuda":
        return f"device {weight.device.type}"
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"weights in {weight.dtype}"
    if weight.stride(-1) != 1:
        return "weight rows not contiguous"
    return None


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why `linear` cannot take these inputs (None: it can)."""
    if (reason := weight_reason(weight)) is not None:
        return reason
    if x.device != weight.device:
        return f"activations on {x.device}, weights on {weight.device}"
    if x.dtype != weight.dtype:
        return f"activations in {x.dtype}, weights in {weight.dtype}"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: Tiles | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N], each row summed the same way at every
    row count. `tiles` overrides the choice by row count (the GPU tests try several)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*shape[:-1], n)
    t = tiles or tiles_for(m, n, x.element_size(), tma=m > 64 and _tma_ok(x2, weight))
    if t.tma:
        _launch_tma(x2, weight, bias, y, t)
        return y.reshape(*shape[:-1], n)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _linear_kernel[grid](x2, weight, bias if bias is not None else weight, y, m, n, k,
                         x2.stride(0), weight.stride(0), y.stride(0),
                         BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                         HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                         num_warps=t.num_warps, num_stages=t.num_stages)
    return y.reshape(*shape[:-1], n)


def _tma_ok(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """The copy engine takes these operands: sm_90+, 16-byte aligned starts and row strides."""
    if not x2.is_cuda or not launch.is_sm90(x2.device):
        return False
    size = x2.element_size()
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0 for t in (x2, weight)) \
        and (weight.shape[0] * size) % 16 == 0


def _launch_tma(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, t: Tiles) -> None:
    m, k = x2.shape
    n = weight.shape[0]
    sms = torch.cuda.get_device_properties(x2.device).multi_processor_count if x2.is_cuda else 4
    programs = min(sms, triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n))
    _linear_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(x2, [t.block_m, t.block_k]),
        TensorDescriptor.from_tensor(weight, [t.block_n, t.block_k]),
        TensorDescriptor.from_tensor(y, [t.block_m, t.block_n]),
        bias if bias is not None else weight, m, n, k, NUM_PROGRAMS=programs,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, HAS_BIAS=bias is not None,
        FLATTEN=t.flatten, num_warps=t.num_warps, num_stages=t.num_stages)
