"""The CUDA checks (`pytest -m gpu tests/gpu`; every module here skips without CUDA)."""
from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _free_cuda_memory():
    """Each test builds several engines (KV pools, graph pools): give their memory back after it."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
