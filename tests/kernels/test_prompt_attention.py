"""The prompt-chunk attention kernel (kernels/prompt_attention.py `chunk_attention`) against the
torch reference, and the property exact serving rests on: a prompt token's output is the bits that
a one-token decode step, a verify pass, or any other chunking of the prompt gives it, and the same
beside other sequences (padded rows included). Contiguous and paged caches, with and without a
sliding window. Runs on CUDA, and on the CPU in Triton's interpreter (small heads, float32)."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import decode_attention as kernel
from verispec.kernels import prompt_attention

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# (dtype, query heads, kv heads, head dim, shares): the interpreter's case is small, with 2 shares of
# 64-key blocks, so the shares change size inside the prompt
CASE = (torch.bfloat16, 32, 8, 128, None) if CUDA else (torch.float32, 4, 2, 16, 2)
LENGTH = 300 if CUDA else 150
# the interpreter's prompt also with 4 shares: rows then sum several whole shares before their last
# one, whose folds the kernel's one walk over a tile's blocks makes inside its loop
SPLITS = [CASE[4]] if CUDA else [CASE[4], 4]


@pytest.fixture(autouse=True)
def _shares_of_one_block_on_cpu(monkeypatch):
    """In the interpreter's small case a share may hold a single block, so shares change size
    inside the prompt (on CUDA the 4,096-key case crosses the engine's own share sizes)."""
    if not CUDA:
        monkeypatch.setattr(kernel, "MIN_SHARE_KEYS", 64)


def tensors(length: int, batch: int = 1, seed: int = 0):
    dtype, hq, hkv, d, _ = CASE
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, hq, length, d, device=DEVICE, generator=gen).to(dtype)
    k = torch.randn(batch, hkv, length + 8, d, device=DEVICE, generator=gen).to(dtype)
    v = torch.randn(batch, hkv, length + 8, d, device=DEVICE, generator=gen).to(dtype)
    return q, k, v


def prompt(q, k, v, first: int, n: int, window=None, tile=None, splits=CASE[4]):
    """Queries first..first+n-1 of every sequence, as one chunk."""
    pos = torch.arange(first, first + n, device=DEVICE)[None].expand(q.shape[0], -1).contiguous()
    return prompt_attention.chunk_attention(q[:, :, first:first + n], k, v, pos, q.shape[-1] ** -0.5, window,
                                  num_splits=splits, query_tile=tile)


@pytest.mark.parametrize("window", [None, 40])
def test_equals_the_reference(window):
    q, k, v = tensors(LENGTH)
    got = prompt(q, k, v, 0, LENGTH, window)
    pos = torch.arange(LENGTH, device=DEVICE)[None]
    want = kernel.decode_attention_reference(q.double(), k.double(), v.double(), pos, q.shape[-1] ** -0.5, window)
    assert float((got.double() - want).norm() / want.norm()) < (1e-2 if CUDA else 1e-5)


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("window", [None, 40])
def test_a_prompt_token_is_its_decode_step_and_any_chunking(window, splits):
    q, k, v = tensors(LENGTH)
    whole = prompt(q, k, v, 0, LENGTH, window, splits=splits)
    for first, n, tile in ((0, 37, None), (37, 64, 3), (101, LENGTH - 101, 16)):
        assert torch.equal(prompt(q, k, v, first, n, window, tile, splits), whole[:, :, first:first + n]), (first, n)
    for position in (0, 63, 64, 65, 127, 128, 129, LENGTH - 1):
        pos = torch.tensor([[position]], device=DEVICE)
        step = kernel.decode_attention(q[:, :, position:position + 1].contiguous(), k, v, pos, q.shape[-1] ** -0.5,
                                       window, num_splits=splits)
        assert torch.equal(step, whole[:, :, position:position + 1]), position
    verify = kernel.decode_attention(q[:, :, 120:124].contiguous(), k, v, torch.arange(120, 124, device=DEVICE)[None],
                                     q.shape[-1] ** -0.5, window, num_splits=splits)
    assert torch.equal(verify, whole[:, :, 120:124])


@pytest.mark.parametrize("splits", SPLITS)
def test_padded_rows_of_a_batch_leave_each_sequence_alone(splits):
    q, k, v = tensors(LENGTH, batch=3, seed=1)
    lengths = [LENGTH - 40, LENGTH, 17]
    alone = [prompt(q[i:i + 1], k[i:i + 1], v[i:i + 1], 0, n, splits=splits) for i, n in enumerate(lengths)]
    pos = torch.arange(LENGTH, device=DEVICE)[None].expand(3, -1).contiguous()
    together = prompt_attention.chunk_attention(q, k, v, pos, q.shape[-1] ** -0.5, None,
                                      torch.tensor(lengths, device=DEVICE), num_splits=splits)
    for i, n in enumerate(lengths):
        assert torch.equal(together[i:i + 1, :, :n], alone[i]), i
        # padding rows are zeros, not what the allocation held: they flow through the next layers,
        # where a recurrent layer masks them by multiplying by 0 (a NaN there poisoned its state)
        assert not together[i, :, n:].any(), i


def test_paged_equals_contiguous():
    q, k, v = tensors(LENGTH, batch=2, seed=2)
    block, blocks = 16, -(-(LENGTH + 8) // 16)
    order = torch.randperm(2 * blocks, generator=torch.Generator().manual_seed(0)).to(DEVICE) + 1
    tables = order.view(2, blocks)
    pools = []
    for cache in (k, v):  # [B, Hkv, S, D] -> pool [slots, Hkv, D], slot = table[b, s // block] * block + s % block
        pool = torch.zeros((2 * blocks + 1) * block, cache.shape[1], cache.shape[3], dtype=cache.dtype, device=DEVICE)
        s = torch.arange(cache.shape[2], device=DEVICE)
        for b in range(2):
            pool[tables[b, s // block] * block + s % block] = cache[b].transpose(0, 1)
        pools.append(pool)
    pos = torch.arange(LENGTH, device=DEVICE)[None].expand(2, -1).contiguous()
    paged = prompt_attention.paged_chunk_attention(q, pools[0], pools[1], tables, block, pos, q.shape[-1] ** -0.5,
                                         num_splits=CASE[4])
    assert torch.equal(paged, prompt_attention.chunk_attention(q, k, v, pos, q.shape[-1] ** -0.5, num_splits=CASE[4]))
