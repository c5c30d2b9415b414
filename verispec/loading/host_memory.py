"""A CPU load's resident memory, kept near what the model holds (glibc's allocator; a no-op elsewhere).

Loading converts tensor after tensor (unpacked codes, the kernels' copies, merged projections),
and glibc serves those temporaries from its heap, which keeps freed pages resident where live
tensors sit between them: the default model's process peaked ~200 MiB above what it held after.
While a model loads, allocations from 256 KiB up are mapped on their own (`mallopt`), so a freed
temporary goes back to the system at once; after it, the threshold is 32 MiB (glibc's own
ceiling: a decode step's buffers reuse the heap, with no page faults) and what is free is handed
back (`malloc_trim`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from verispec import host_libc

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
LOADING_THRESHOLD = 256 << 10
RUNNING_THRESHOLD = 32 << 20


def _libc():
    libc = host_libc.library()
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def release_free_pages() -> None:
    """Hands the heap's free pages back to the system now (before a step that adds a large copy)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def lean_allocations() -> Iterator[None]:
    """Inside: large temporaries are returned to the system when freed; after: free pages are."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, LOADING_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, RUNNING_THRESHOLD)
            libc.malloc_trim(0)
