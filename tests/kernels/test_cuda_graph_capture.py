"""A CUDA graph capture that fails is made once more, into a pool of its own and without
programmatic dependent launch (and says so); a second failure is not hidden. Python's cycle
collector is off during a capture (a collection freeing old graphs invalidates it)."""
from __future__ import annotations

import pytest

from verispec.kernels import cuda_graph as cuda_graphs
from verispec.kernels import launch


def test_a_failed_capture_is_made_again_without_pdl(monkeypatch):
    seen, warnings = [], []

    def capture_once(fn, inputs, pool):
        seen.append((launch.PDL, pool))
        if len(seen) == 1:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        return "graph", fn(*inputs)

    monkeypatch.setattr(cuda_graphs, "_capture_once", capture_once)
    monkeypatch.setattr(launch, "PDL", True)
    monkeypatch.setattr(cuda_graphs.log, "warning", lambda msg, *args: warnings.append(msg % args))
    graph, out = cuda_graphs.capture(lambda a: (a + 1,), [1], pool="shared")
    assert (graph, out) == ("graph", (2,))
    assert seen == [(True, "shared"), (False, None)]
    assert launch.PDL is True  # restored after the capture
    assert len(warnings) == 1 and "pool of its own" in warnings[0]
    assert "previous error during capture" in warnings[0]


def test_the_collector_is_off_during_a_capture(monkeypatch):
    import contextlib
    import gc

    states = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode=None):
        yield

    monkeypatch.setattr(cuda_graphs.torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(cuda_graphs.torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    cuda_graphs._capture_once(lambda a: states.append(gc.isenabled()) or (a,), [1], None)
    assert states == [False] and gc.isenabled()


def test_a_second_failure_raises(monkeypatch):
    def capture_once(fn, inputs, pool):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(cuda_graphs, "_capture_once", capture_once)
    monkeypatch.setattr(launch, "PDL", True)
    with pytest.raises(RuntimeError, match="out of memory"):
        cuda_graphs.capture(lambda a: (a,), [1])
    assert launch.PDL is True


def test_a_failed_capture_stops_recording_into_its_pool(monkeypatch):
    """So that the retry can capture into the same pool (torch leaves the allocator recording
    when ending a broken capture fails)."""
    import contextlib

    ended = []

    class FakeGraph:
        def pool(self):
            return (7, 1)

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode=None):
        yield

    def broken(a):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_graphs.torch._C, "_cuda_endAllocateToPool", lambda d, p: ended.append((d, p)),
                        raising=False)
    with pytest.raises(RuntimeError, match="not permitted"):
        cuda_graphs._capture_once(broken, [1], None)
    assert ended == [(0, (7, 1))]
