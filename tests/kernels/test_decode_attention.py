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


def run_paged_case(lengths: list[int], t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, window: int | None,
                   block_size: int, seed: int = 0) -> float:
    """A batch of sequences of different lengths in shuffled pool blocks; every pool row no
    sequence owns (and every owned row past a sequence's length) is NaN, so a stray read shows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b = len(lengths)
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_seq) + 7
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(blocks_per_seq)
    tables = torch.zeros(b, width, dtype=torch.long)
    k_pool = torch.full((num_blocks * block_size, hkv, d), float("nan"), device="cuda", dtype=dtype)
    v_pool = torch.full_like(k_pool, float("nan"))
    taken = 0
    for i, n in enumerate(lengths):
        ids = [x + 1 for x in order[taken:taken + blocks_per_seq[i]]]
        taken += blocks_per_seq[i]
        tables[i, :len(ids)] = torch.tensor(ids)
        for p in range(n):
            row = ids[p // block_size] * block_size + p % block_size
            k_pool[row] = torch.randn(hkv, d, device="cuda", generator=gen).to(dtype)
            v_pool[row] = torch.randn(hkv, d, device="cuda", generator=gen).to(dtype)
    tables = tables.cuda()
    q = torch.randn(b, hq, t, d, device="cuda", generator=gen).to(dtype)
    pos = torch.stack([torch.arange(n - t, n, device="cuda") for n in lengths])
    ref = kernel.paged_decode_attention_reference(q.double(), k_pool.double(), v_pool.double(), tables, block_size,
                                                  pos, d ** -0.5, window)
    out = kernel.paged_decode_attention(q, k_pool, v_pool, tables, block_size, pos, d ** -0.5, window)
    assert not torch.isnan(out).any()
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("t", [1, 4])
def test_paged_ragged_batch(block_size, t):
    lengths = [t + 3, 17, 1000, 63, 4097, 300]
    assert run_paged_case(lengths, t, hq=32, hkv=8, d=128, dtype=torch.bfloat16, window=None,
                          block_size=block_size) < 1e-2
    assert run_paged_case(lengths, t, hq=8, hkv=2, d=64, dtype=torch.float32, window=None,
                          block_size=block_size) < 1e-4


def test_paged_sliding_window():
    assert run_paged_case([40, 700, 2000], 3, hq=16, hkv=4, d=128, dtype=torch.bfloat16, window=100,
                          block_size=16) < 1e-2


def test_output_layout_and_repeatability():
    """The output is [B, Hq, T, D] viewing [B, T, Hq, D] memory, so the output projection's
    transpose(1, 2) + reshape needs no copy; repeated launches give the same bits."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 32, 4, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 8, 6000, 128, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(2, 8, 6000, 128, device="cuda", generator=gen).to(torch.bfloat16)
    pos = torch.tensor([[5000, 5001, 5002, 5003], [100, 101, 102, 103]], device="cuda")
    first = kernel.decode_attention(q, k, v, pos, 128 ** -0.5)
    assert first.shape == (2, 32, 4, 128) and first.transpose(1, 2).is_contiguous()
    ref = kernel.decode_attention_reference(q.double(), k.double(), v.double(), pos, 128 ** -0.5)
    assert float((first.double() - ref).norm() / ref.norm()) < 1e-2
    for _ in range(10):
        assert torch.equal(kernel.decode_attention(q, k, v, pos, 128 ** -0.5), first)
