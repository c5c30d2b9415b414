"""Grid-wide barriers for persistent Gluon kernels (quant/kernels/stream_chain.py): every program of a
launch arrives before any leaves, which is only safe when all of them are resident at once, so the
launcher takes the program count from the driver's occupancy query (`resident_per_multiprocessor`).

The barrier counts arrivals on an int64 counter that only grows: a barrier's target is the next
multiple of the arrivals it waits for, so no launch resets it (nothing to capture into a CUDA graph
but the kernel), and at ~10^4 arrivals a decode step it cannot wrap in any server's lifetime
(an int32 one would after ~2 * 10^5 steps). Every launch on one counter must wait for the same
number of arrivals a barrier: `counter_for` keeps one counter a device and arrival count.
"""
from __future__ import annotations

import ctypes

import torch

from verispec.kernels.launch import gl, gluon

_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def counter_for(device: torch.device, arrivals: int) -> torch.Tensor:
    """The int64 [1] barrier counter of launches on `device` whose barriers wait for `arrivals`
    programs (or partitions): created zero (a multiple of every count) on first use."""
    key = (torch.device(device), arrivals)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1, dtype=torch.int64, device=device)
    return _COUNTERS[key]


def resident_per_multiprocessor(kernel, warps: int) -> int:
    """Programs of this compiled kernel a multiprocessor holds at once (the driver's occupancy
    calculation: registers, shared memory, warps), which a grid barrier needs of all of them."""
    kernel._init_handles()
    count = ctypes.c_int()
    status = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(count), ctypes.c_void_p(kernel.function), ctypes.c_int(32 * warps),
        ctypes.c_size_t(kernel.metadata.shared))
    if status:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed ({status})")
    return count.value


if gluon is not None:
    @gluon.jit
    def grid_barrier(COUNTER, ARRIVALS: gl.constexpr):
        """Every one of ARRIVALS callers (a program, or a warp partition of each) arrives before any
        leaves. COUNTER: int64, a multiple of ARRIVALS at the launch's start (see the module)."""
        gl.thread_barrier()
        old = gl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
        target = (old // ARRIVALS + 1) * ARRIVALS
        seen = old + 1
        while seen < target:
            seen = gl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
        gl.thread_barrier()
