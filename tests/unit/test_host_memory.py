"""A CPU load's allocator settings (loading/host_memory.py)."""
from __future__ import annotations

import pytest

from verispec.loading import host_memory


class FakeLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return 1


def test_a_load_maps_its_temporaries_then_the_heap_serves_steps_and_free_pages_go_back(monkeypatch):
    libc = FakeLibc()
    monkeypatch.setattr(host_memory, "_libc", lambda: libc)
    with host_memory.lean_allocations():
        assert libc.calls == [("mallopt", host_memory.M_MMAP_THRESHOLD, host_memory.LOADING_THRESHOLD)]
    assert libc.calls[1:] == [("mallopt", host_memory.M_MMAP_THRESHOLD, host_memory.RUNNING_THRESHOLD),
                              ("malloc_trim", 0)]
    libc.calls.clear()
    with pytest.raises(RuntimeError):  # a failed load restores them too
        with host_memory.lean_allocations():
            raise RuntimeError("load failed")
    assert libc.calls[-1] == ("malloc_trim", 0)


def test_without_glibc_nothing_is_asked(monkeypatch):
    monkeypatch.setattr(host_memory, "_libc", lambda: None)
    with host_memory.lean_allocations():
        pass

