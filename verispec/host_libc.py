"""The host's C library, loaded once, for the few calls verispec makes into it (glibc's allocator
settings and trim, madvise): None where it cannot be found. Any layer may use it; each caller checks
for the functions it calls (another platform's C library may lack them) and goes without."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def library() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
