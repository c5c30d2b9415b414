"""One Triton disk cache per process from the first compile (engine/warmup.py pin_triton_cache_dir):
Triton's own directory unless the user named one (inductor keeps it too), and nothing set off CUDA."""
from __future__ import annotations

import os

import torch
from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

from verispec.engine import warmup


def unset(monkeypatch) -> None:
    """TRITON_CACHE_DIR absent now, and as it was after the test (setenv records the original)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", "placeholder")
    monkeypatch.delenv("TRITON_CACHE_DIR")


def test_cuda_pins_tritons_own_directory_which_inductor_then_keeps(monkeypatch):
    from triton import knobs

    unset(monkeypatch)
    expected = knobs.cache.dir  # computed while unset: Triton's default
    assert warmup.pin_triton_cache_dir(torch.device("cuda", 1)) == expected
    assert os.environ["TRITON_CACHE_DIR"] == expected
    assert triton_cache_dir(1) == expected  # where inductor's kernels go once it is set


def test_a_users_directory_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert warmup.pin_triton_cache_dir(torch.device("cuda", 0)) == str(tmp_path)


def test_nothing_set_off_cuda(monkeypatch):
    unset(monkeypatch)
    assert warmup.pin_triton_cache_dir(torch.device("cpu")) is None
    assert "TRITON_CACHE_DIR" not in os.environ
