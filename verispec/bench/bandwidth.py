"""Measured memory bandwidth: the roofline's numerator, taken on the machine that runs the bench.

A device-to-device copy of a large buffer, timed with CUDA events; bytes moved = read + written.
Only CUDA is measured: on other devices the roofline is reported as n/a unless --bandwidth is given.
"""
from __future__ import annotations

import statistics

import torch

DEFAULT_COPY_BYTES = 2 << 30  # 2 GiB copied (4 GiB allocated): far past every cache


def measure_copy_bandwidth(device: torch.device, num_bytes: int = DEFAULT_COPY_BYTES,
                           repeats: int = 20, warmup: int = 3) -> float | None:
    """Bytes per second (read + written) of `dst.copy_(src)` on a CUDA device; None elsewhere.
    The median of `repeats` timed copies after `warmup` untimed ones."""
    if device.type != "cuda":
        return None
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    try:
        for _ in range(warmup):
            dst.copy_(src)
        seconds = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1000)
        return 2 * num_bytes / statistics.median(seconds)
    finally:
        del src, dst
        torch.cuda.empty_cache()
