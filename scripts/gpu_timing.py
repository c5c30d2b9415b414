"""Timing one GPU call without its launch overhead, for the tuning scripts (gpu_*_tune / tiles)."""
from __future__ import annotations

import torch


def graph_time_us(fn, reps: int = 20, iters: int = 15) -> float:
    """Median microseconds of one `fn()` call, measured as a CUDA graph of `reps` calls replayed
    `iters` times (warmed up on a side stream first, as capture needs)."""
    return cycle_time_us([fn] * reps, iters)


def cycle_time_us(fns, iters: int = 15) -> float:
    """Median microseconds per call of a CUDA graph calling each of `fns` once in turn (e.g. the
    same product over several copies of a weight, so that it is read from memory, not L2)."""
    for fn in fns[:2]:
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(fns))
    return sorted(times)[len(times) // 2]
