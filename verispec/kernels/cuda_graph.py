"""A callable captured once as a CUDA graph and replayed over static input buffers.

The engine's verify passes and the drafters' passes are built on `GraphedCall`; capture is made
robust here (thread-local capture mode, no garbage collection inside it, one retry).
"""
from __future__ import annotations

import contextlib
import gc
import threading

import torch

from verispec import log
from verispec.kernels import compile_ahead, launch


def _capture_once(fn, inputs: list[torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, tuple]:
    graph = torch.cuda.CUDAGraph()
    # thread_local: only this thread's unsafe calls can spoil the capture. In the default
    # ("global") mode a sync or cudaMalloc from any other thread invalidates it - e.g. another
    # engine's worker finishing its last step while this one captures
    # (cudaErrorStreamCaptureInvalidated)
    try:
        with _no_garbage_collection(), torch.inference_mode(), \
                torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = fn(*inputs)
    except BaseException:
        _stop_recording_to_pool(graph)
        raise
    return graph, outputs


@contextlib.contextmanager
def _no_garbage_collection():
    """Python's cycle collector off for the capture. A collection that runs inside it (any
    allocation can start one) frees whatever unreachable cycles hold, e.g. an engine dropped
    earlier with its CUDA graphs, and destroying a graph is not permitted while this thread
    captures: the capture is invalidated ("operation failed due to a previous error during
    capture", after torch's "operation not permitted when stream is capturing (function reset)"
    warnings). torch stopped collecting before captures (torch.compiler.config.force_cudagraph_gc),
    so engines built one after another met it now and then. Collection resumes after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _stop_recording_to_pool(graph: torch.cuda.CUDAGraph) -> None:
    """After a failed capture: torch ends the capture but, when ending it fails, may leave the
    caching allocator recording into the graph's pool; the next capture into that pool then fails
    with "beginAllocateToPool: already recording". Ends that recording if it is still open."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), graph.pool())
    except Exception as exc:  # already ended (the usual case) or the capture never began
        log.debug("after a failed capture, the pool's recording was already closed (%s)", exc)


def failure_line(exc: BaseException) -> str:
    """A failed capture's error in one line, for the log (torch's CUDA errors run to many)."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def capture(fn, inputs: list[torch.Tensor], pool=None) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """`fn(*inputs)` captured as a CUDA graph -> (graph, its outputs). A capture that fails is made
    once more, into a memory pool of its own (the shared one may still be marked as recording) and
    without programmatic dependent launch, and says so; a second failure raises."""
    try:
        return _capture_once(fn, inputs, pool)
    except RuntimeError as exc:
        log.warning("CUDA graph capture failed (%s); capturing once more, into a pool of its own and without "
                    "programmatic dependent launch", failure_line(exc))
    with launch.launches_without_pdl():
        return _capture_once(fn, inputs, None)


WARM_UP_RUNS = 2  # a pass's runs before its capture: compiles and autotuning happen outside it
_warmups = threading.local()  # count: this thread's, inside warm_up_once()


@contextlib.contextmanager
def warm_up_once():
    """Captures made on this thread run their pass once before capturing, not twice: for passes
    that have just run dry (kernels/compile_ahead.py), which did what the first run would have
    (Triton and torch.compile's kernels built, torch's lazy state set up); the one run left
    autotunes what the dry run could not."""
    previous = getattr(_warmups, "count", WARM_UP_RUNS)
    _warmups.count = 1
    try:
        yield
    finally:
        _warmups.count = previous


class GraphedCall:
    """`fn(*inputs)` (tensors in, a tuple of tensors out) captured once with static input buffers
    shaped like `example_inputs`; calling it copies the new inputs in (host tensors: without a
    sync) and replays. Outputs are the graph's own buffers: valid until the next replay. The target's
    verify passes (engine/cuda_graphs.py) and the drafters' passes are built on it."""

    def __init__(self, fn, example_inputs: list[torch.Tensor], pool=None):
        device = example_inputs[0].device
        self.inputs = [x.clone() for x in example_inputs]
        if compile_ahead.active():  # a dry run: the pass once, for its kernels; nothing captured
            with torch.inference_mode():
                self.outputs = fn(*self.inputs)
            self.graph = None
            return
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(getattr(_warmups, "count", WARM_UP_RUNS)):
                fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph, self.outputs = capture(fn, self.inputs, pool)

    def pool(self):
        return self.graph.pool() if self.graph is not None else None

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        for buffer, x in zip(self.inputs, inputs):
            buffer.copy_(x, non_blocking=True)
        self.graph.replay()
        return self.outputs
