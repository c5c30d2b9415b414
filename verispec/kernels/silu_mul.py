"""A gated MLP's activation, silu(gate) * up, in one kernel of ours.

What `layers.fused.silu_mul` computes, in float32 and rounded once to the activations' dtype (as
torch.compile's fused kernel did). Ours so that a model of the Llama family needs no torch.compile
at all: importing dynamo and inductor cost a CUDA start-up ~4.5 s, and an empty cache their compiles
of this function's variants. Elementwise, so a row's bits do not depend on the rows beside it.
"""
from __future__ import annotations

import torch

from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch function stands in
    triton = None
    tl = None

BLOCK = 1024

if triton is not None:

    @triton.jit
    def _silu_mul_kernel(G, U, Y, stride_g, stride_u, stride_y, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        g = tl.load(G + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)


def unsupported_reason(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    """Why `silu_mul` cannot take these inputs (None: it can)."""
    if triton is None:
        return "Triton is not installed"
    if gate.device.type != "cuda":
        return f"device {gate.device.type}"
    if gate.dtype not in (torch.bfloat16, torch.float16, torch.float32) or up.dtype != gate.dtype:
        return f"dtypes {gate.dtype} and {up.dtype}"
    if gate.shape != up.shape:
        return f"shapes {tuple(gate.shape)} and {tuple(up.shape)}"
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] as [rows, N] without a copy where the strides allow it (a chunk of the merged
    gate/up product is such a view)."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., N] -> silu(gate) * up [..., N], in gate's dtype."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    g, u = _rows(gate), _rows(up)
    rows, n = g.shape
    if rows and n:
        _silu_mul_kernel[(rows, triton.cdiv(n, BLOCK))](g, u, out, g.stride(0), u.stride(0), n, n, BLOCK=BLOCK,
                                                          num_warps=4)
    return out
