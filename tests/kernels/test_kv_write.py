"""The one-launch K/V cache write (verispec/kernels/kv_write.py) against torch's index_copy_, for
the paged pools and the contiguous cache, one and several sequences and tokens, and k / v as the
transposed views attention hands over. Runs on CUDA, and on CPU through Triton's interpreter
(tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import kv_write

pytestmark = pytest.mark.skipif(kv_write.triton is None, reason="needs Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def new_kv(b: int, h: int, t: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, H, T, D] as the attention layer makes them: [B, T, H, D] buffers seen heads-first."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, t, h, d, generator=gen).to(DEVICE, torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, t, h, d, generator=gen).to(DEVICE, torch.bfloat16).transpose(1, 2)
    return k, v


@pytest.mark.parametrize("b,t", [(1, 1), (1, 4), (3, 2)])
def test_paged_pools_equal_index_copy(b, t):
    h, d, slots = 3, 72, 40  # neither a power of two
    k, v = new_kv(b, h, t, d, b * 10 + t)
    rows = torch.randperm(slots, generator=torch.Generator().manual_seed(t))[: b * t].to(DEVICE)
    pools = [torch.zeros(slots, h, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
    kv_write.write_kv(k, v, pools[0], pools[1], rows, row_dim=0, batch_dim=None, head_dim=1)
    pools[2].index_copy_(0, rows, k.transpose(1, 2).reshape(b * t, h, d))
    pools[3].index_copy_(0, rows, v.transpose(1, 2).reshape(b * t, h, d))
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


@pytest.mark.parametrize("b,t", [(1, 1), (2, 3)])
def test_contiguous_cache_equals_index_copy(b, t):
    h, d, capacity = 2, 64, 16
    k, v = new_kv(b, h, t, d, 7 + t)
    rows = torch.tensor([5, 9, 2][:t], device=DEVICE)  # every sequence writes the same rows
    caches = [torch.zeros(b, h, capacity, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
    kv_write.write_kv(k, v, caches[0], caches[1], rows, row_dim=2, batch_dim=0, head_dim=1)
    caches[2].index_copy_(2, rows, k)
    caches[3].index_copy_(2, rows, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_refuses_mismatched_rows():
    k, v = new_kv(2, 2, 2, 64, 1)
    pool = torch.zeros(8, 2, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="3 rows for 2 x 2 tokens"):
        kv_write.write_kv(k, v, pool, pool.clone(), torch.arange(3, device=DEVICE), 0, None, 1)
