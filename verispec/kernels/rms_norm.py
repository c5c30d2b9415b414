"""The residual add and the next RMSNorm over a hidden row, in one kernel of ours.

What `layers.fused.add_rms_norm` computes (summed = x + update, rounded to the activations'
dtype; statistics in float32; the normed value rounded before the weight is applied, or (1 + w)
applied in float32 for unit-offset norms). torch.compile made this a kernel too, but one whose
reduction order could change with the pass's row count (it specialises one-row passes); here one
program takes one row, with a layout that depends on the hidden size only, so a row's result does
not depend on how many rows share the pass (speculative == plain greedy needs that).

On sm_90 it launches with programmatic dependent launch, as the quantized products do
(kernels/launch.py): it is queued while the product before it finishes, waits for that product's
results (griddepcontrol.wait), and lets the product after it start loading its weights as soon as
its own stores are issued.
"""
from __future__ import annotations

import torch

from verispec.kernels import launch
from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs: the torch functions stand in
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(X, U, W, S, Y, stride_x, stride_u, stride_s, stride_y, eps,
                             H: tl.constexpr, BLOCK: tl.constexpr, HAS_UPDATE: tl.constexpr,
                             UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr = True):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        if PDL:
            gdc_wait()  # the kernel before this one (the product writing `update`) has finished
        x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
        dtype = x.dtype
        if HAS_UPDATE:
            u = tl.load(U + row * stride_u + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + u.to(tl.float32)).to(dtype)
            tl.store(S + row * stride_s + cols, x, mask=ok)
        if PDL and EARLY:
            gdc_launch_dependents()
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            y = (xf * rstd * (1.0 + w)).to(dtype)
        else:
            y = (w * (xf * rstd).to(dtype).to(tl.float32)).to(dtype)
        tl.store(Y + row * stride_y + cols, y, mask=ok)


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why `add_rms_norm` cannot take these inputs (None: it can)."""
    if triton is None:
        return "Triton is not installed"
    if x.device.type != "cuda":
        return f"device {x.device.type}"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {x.dtype}"
    if x.shape[-1] > 16384:
        return f"a hidden size of {x.shape[-1]} (at most 16384 in one program)"
    if weight.shape != x.shape[-1:]:
        return f"a norm weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]}"
    return None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] as [rows, H] without a copy where the strides allow it."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def add_rms_norm(x: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x, update [..., H] (update None: the norm alone) -> (x + update, its RMSNorm), each [..., H]
    in x's dtype; weight [H]."""
    h = x.shape[-1]
    xs = _rows(x)
    rows = xs.shape[0]
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if update is not None else x
    if rows == 0:
        return summed, normed
    us = _rows(update) if update is not None else xs
    block = triton.next_power_of_2(h)
    pdl = launch.pdl_enabled(x.device)
    _add_rms_norm_kernel[(rows,)](
        xs, us, weight, summed, normed, xs.stride(0), us.stride(0), h, h, eps,
        H=h, BLOCK=block, HAS_UPDATE=update is not None, UNIT_OFFSET=unit_offset, PDL=pdl,
        EARLY=True, num_warps=max(1, min(16, block // 512)), launch_pdl=pdl)
    return summed, normed
