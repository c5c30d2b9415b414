"""Whether this process imports Triton: with a CUDA device, with Triton's interpreter asked for
(TRITON_INTERPRET=1: the test suite runs the kernels' arithmetic on a CPU), or told to
(VERISPEC_TRITON=1: compiling kernels for a GPU on a machine without one, tools/sass). A CPU-only
server never launches a Triton kernel, and importing Triton would hold ~50 MiB of its memory.

Each kernel module imports Triton inside `try: require_triton(); import triton ...` and keeps its
torch path where that raises ImportError, as on an install without Triton.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_wanted() -> bool:
    told = os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("VERISPEC_TRITON") == "1"
    return told or torch.cuda.is_available()


def require_triton() -> None:
    """Raises ImportError where no Triton kernel can run in this process."""
    if not triton_wanted():
        raise ImportError("Triton is not imported: no CUDA device and no TRITON_INTERPRET=1")
