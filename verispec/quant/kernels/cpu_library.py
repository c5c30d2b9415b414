"""The CPU kernels' one shared library: cpu_layers.c, which includes qdot.c (the integer-dot
products) and cpu_pool.h (how their phases share torch's OpenMP threads). One library, so that the
layer kernel calls qdot.c's tiles directly and both are built, cached and loaded once;
quant/kernels/cpu_qdot.py and cpu_layers.py call into it."""
from __future__ import annotations

import ctypes
from pathlib import Path

from verispec import log
from verispec.kernels.cpu_build import Library

_here = Path(__file__).parent


def _declare(library: ctypes.CDLL) -> None:
    library.qdot_linear.restype = ctypes.c_int
    library.qdot_linear.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    library.decoder_layers.restype = ctypes.c_int
    library.decoder_layers.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    library.qdot_decode_rows.restype = ctypes.c_int
    library.qdot_decode_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    library.qdot_isa.restype = ctypes.c_char_p
    log.debug("CPU integer-dot kernel: %s", library.qdot_isa().decode())


library = Library(_here / "cpu_layers.c", _declare, includes=(_here / "qdot.c", _here / "cpu_pool.h"))
