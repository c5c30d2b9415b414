"""What our Triton / Gluon kernels share: the Gluon import (None without it), the checks for NVIDIA
inline assembly and sm_90, and programmatic dependent launch (PDL).

PDL (sm_90+): a kernel is queued to start while the previous kernel on the stream finishes, loads
its first weights, then waits (griddepcontrol.wait) for that kernel's results. On the H200 it gave
Qwen3-8B 4-bit decode +6-8% and 8-bit +5% in the quantized products (docs/benchmarks.md). A CUDA
graph capture that fails with it on is made again without it (kernels/cuda_graph.py:
`launches_without_pdl`).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from verispec.kernels.triton_import import require_triton

try:
    require_triton()
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # CPU-only installs, or a Triton without Gluon
    triton = None
    gluon = None
    gl = None

# read at launch (and so at capture): launches_without_pdl turns it off for one capture
PDL = True


def platform_reason(device: torch.device) -> str | None:
    """Why a Gluon kernel with NVIDIA inline assembly cannot run on `device` (None: it can)."""
    if gluon is None:
        return "this Triton has no Gluon"
    if device.type != "cuda":
        return f"device {device.type}"
    if torch.version.hip:
        return "ROCm (the kernel's inline assembly is NVIDIA PTX)"
    return None


@functools.cache
def is_sm90(device: torch.device) -> bool:
    """The GPU is sm_90 or later (griddepcontrol, packed bfloat16 subtraction); asked once per device."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic launch for a kernel on `device` (never off CUDA: the interpreter has none)."""
    return PDL and device.type == "cuda" and is_sm90(device)


def small_kernel_pdl(device: torch.device) -> tuple[bool, bool]:
    """(launch with PDL, release the dependents at the kernel's start) for the step's small kernels
    (q/k preparation, split-K attention, its combine): each waits for the kernel before it first
    thing and releases its dependents at its start, so the next product's first weights are on
    their way while it runs. H200, Qwen3-8B 4-bit decode: no PDL 457.3, release at the end 463.1,
    at the start 469.5 tok/s (docs/benchmarks.md). The products themselves release at their end:
    earlier release measured slower (their dependents took multiprocessors they needed)."""
    on = pdl_enabled(device)
    return on, on


@contextlib.contextmanager
def launches_without_pdl():
    """Launch (and so capture) our kernels without programmatic dependent launch."""
    global PDL
    previous, PDL = PDL, False
    try:
        yield
    finally:
        PDL = previous


if gluon is not None:

    @gluon.jit
    def wait_for_previous_grid():
        # PDL: a kernel may start while the previous one finishes; it must read nothing that kernel
        # writes, and write nothing, before this line
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
