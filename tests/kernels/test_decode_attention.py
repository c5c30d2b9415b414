"""The Triton split-K attention kernel against its torch reference (CUDA only)."""
from __future__ import annotations

import random

import pytest
import torch

from verispec.kernels import decode_attention as kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or kernel.triton is None,
                                                   reason="needs CUDA and Triton")]

LENGTHS = [1, 2, 15, 16, 17, 63, 64, 65, 127, 1000, 4095, 4097, 16384, 32771, 131072]


def run_case(length: int, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, window: int | None,
             splits: int | None = None, seed: int = 0) -> float:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cap = length + 37  # rows past the sequence hold garbage the kernel must not read
    q = torch.randn(1, hq, t, d, device="cuda", generator=gen).to(dtype)
    k = torch.randn(1, hkv, cap, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(1, hkv, cap, d, device="cuda", generator=gen).to(dtype)
    k[:, :, length:] = float("nan")
    v[:, :, length:] = float("nan")
    pos = torch.arange(length - t, length, device="cuda")[None]
    if length < t:
        pytest.skip("fewer keys than queries")
    ref = kernel.decode_attention_reference(q.double(), k.double(), v.double(), pos, d ** -0.5, window)
    out = kernel.decode_attention(q, k, v, pos, d ** -0.5, window, num_splits=splits)
    assert not torch.isnan(out).any()
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("t", [1, 3, 5, 8])
def test_lengths_bf16(length, t):
    if length < t:
        pytest.skip("fewer keys than queries")
    assert run_case(length, t, hq=32, hkv=8, d=128, dtype=torch.bfloat16, window=None) < 1e-2


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_head_dims_and_dtypes(d, dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for length in (5, 333, 5000):
        assert run_case(length, 3, hq=8, hkv=2, d=d, dtype=dtype, window=None) < tol


@pytest.mark.parametrize("window", [1, 16, 100, 1024])
def test_sliding_window(window):
    for length in (7, 200, 3000):
        for t in (1, 4):
            assert run_case(length, t, hq=16, hkv=8, d=256, dtype=torch.bfloat16, window=window) < 1e-2


def test_random_shapes():
    rng = random.Random(0)
    for i in range(25):
        hkv = rng.choice([1, 2, 4, 8])
        group = rng.choice([1, 2, 4, 6, 8])
        d = rng.choice([64, 96, 128, 192, 256, 512])
        t = rng.randint(1, 8)
        length = rng.randint(t, 20000)
        window = rng.choice([None, None, rng.randint(1, 4096)])
        splits = rng.choice([None, 1, 2, 16])
        err = run_case(length, t, hq=hkv * group, hkv=hkv, d=d, dtype=torch.bfloat16, window=window,
                       splits=splits, seed=i)
        assert err < 1e-2, (hkv, group, d, t, length, window, splits, err)
