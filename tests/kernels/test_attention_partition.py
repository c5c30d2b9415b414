"""A query row's split-K attention does not depend on the other rows of its pass: a verify pass
over positions p..p+3 gives each row the bits a one-row pass at that position gives, also where
the keys' split into shares changes size between p and p+3 (speculative == plain greedy needs
this). Runs on CUDA, and on the CPU in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from verispec.kernels import decode_attention as kernel

pytestmark = pytest.mark.skipif(kernel.triton is None, reason="needs Triton")


def _device_case():
    if torch.cuda.is_available():  # the engine's shapes: 16 splits of 128-key blocks, bf16
        return "cuda", torch.bfloat16, 32, 8, 128, None
    # the interpreter: small heads, 2 splits of 64-key blocks (float32 tiles) -> shares change
    # size when the keys pass 128
    return "cpu", torch.float32, 4, 1, 16, 2


def _rows_alone_and_together(first: int, t: int, window: int | None):
    device, dtype, hq, hkv, d, splits = _device_case()
    gen = torch.Generator(device=device).manual_seed(first)
    cap = first + t + 5
    q = torch.randn(1, hq, t, d, device=device, generator=gen).to(dtype)
    k = torch.randn(1, hkv, cap, d, device=device, generator=gen).to(dtype)
    v = torch.randn(1, hkv, cap, d, device=device, generator=gen).to(dtype)
    pos = torch.arange(first, first + t, device=device)[None]
    together = kernel.decode_attention(q, k, v, pos, d ** -0.5, window, num_splits=splits)
    alone = [kernel.decode_attention(q[:, :, i:i + 1].contiguous(), k, v, pos[:, i:i + 1], d ** -0.5, window,
                                     num_splits=splits) for i in range(t)]
    return together, torch.cat(alone, dim=2)


@pytest.fixture(autouse=True)
def _shares_of_one_block_on_cpu(monkeypatch):
    """In the interpreter's small case a share may hold a single block, so shares grow inside it."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(kernel, "MIN_SHARE_KEYS", 64)


def _crossing(device: str) -> int:
    """A first position such that a 4-row pass's keys cross the point where shares grow: 16 shares
    of MIN_SHARE_KEYS keys on CUDA (one 64-key block each, 2 shares, in the interpreter)."""
    return 16 * kernel.MIN_SHARE_KEYS - 2 if device == "cuda" else 2 * 64 - 2


@pytest.mark.parametrize("window", [None, 50])
def test_rows_of_a_verify_pass_equal_their_one_row_passes(window):
    device = _device_case()[0]
    for first in (_crossing(device) // 2 - 2, _crossing(device)):
        together, alone = _rows_alone_and_together(first, 4, window)
        assert torch.equal(together, alone), f"positions {first}..{first + 3}, window {window}"


def test_shares_of_few_kv_heads_hold_fewer_keys(monkeypatch):
    """8 or more kv heads: MIN_SHARE_KEYS keys a share at least; 4 and 2 heads a half and a quarter
    of it (their batch-1 decode would otherwise run on 4 or 2 programs); always whole blocks."""
    monkeypatch.setattr(kernel, "MIN_SHARE_KEYS", 512)
    full = 512
    assert kernel._min_share_keys(128, 8) == kernel._min_share_keys(128, 32) == full
    assert kernel._min_share_keys(128, 4) == full // 2
    assert kernel._min_share_keys(64, 2) == full // 4
    assert kernel._min_share_keys(128, 1) == 128  # never less than one block
    assert kernel._min_share_keys(96, 4) % 96 == 0
