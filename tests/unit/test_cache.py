"""KV cache: commit/rollback bookkeeping, growth, and that a rolled-back cache gives the same logits
as a fresh full-sequence forward (checked against transformers)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from verispec.cache.kv import KVCache, LayerCacheSpec
from verispec.loading.model_loader import load_model

# Incremental forwards run different matmul shapes than one full forward; measured <= 3e-6.
ATOL = 2e-5
RTOL = 1e-5
SPECS = [LayerCacheSpec(num_kv_heads=2, head_dim=4), LayerCacheSpec(num_kv_heads=1, head_dim=8)]


def rows(spec: LayerCacheSpec, t: int, start: float) -> torch.Tensor:
    """Distinct, recognisable rows [1, Hkv, t, D]."""
    n = spec.num_kv_heads * t * spec.head_dim
    return (torch.arange(n, dtype=torch.float32) + start).view(1, spec.num_kv_heads, t, spec.head_dim)


def write(cache: KVCache, t: int, start: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One 'forward pass' writing t rows to every layer; returns what each append returned."""
    return [cache.append(i, rows(s, t, start + 1000 * i), -rows(s, t, start + 1000 * i))
            for i, s in enumerate(cache.specs)]


# ---- bookkeeping ----------------------------------------------------------------------------

def test_append_returns_committed_plus_pending_rows():
    cache = KVCache(SPECS, 16, torch.float32, "cpu")
    write(cache, 3, 0.0)
    cache.commit(3)
    views = write(cache, 2, 500.0)
    for i, (spec, (k, v)) in enumerate(zip(SPECS, views)):
        assert k.shape == (1, spec.num_kv_heads, 5, spec.head_dim)
        torch.testing.assert_close(k[:, :, :3], rows(spec, 3, 1000 * i))
        torch.testing.assert_close(k[:, :, 3:], rows(spec, 2, 500 + 1000 * i))
        torch.testing.assert_close(v, -k)
    assert cache.length == 3 and cache.pending == 2


def test_commit_keeps_a_prefix_of_pending_rows():
    cache = KVCache(SPECS, 16, torch.float32, "cpu")
    write(cache, 4, 0.0)
    cache.commit(4)
    write(cache, 5, 100.0)  # a verify pass of 5 rows, of which 2 are accepted
    cache.commit(2)
    assert cache.length == 6 and cache.pending == 0
    k, _ = write(cache, 1, 900.0)[0]
    assert k.shape[2] == 7
    torch.testing.assert_close(k[:, :, 4:6], rows(SPECS[0], 5, 100.0)[:, :, :2])
    torch.testing.assert_close(k[:, :, 6:], rows(SPECS[0], 1, 900.0))


def test_rollback_drops_committed_rows_and_next_write_overwrites():
    cache = KVCache(SPECS, 16, torch.float32, "cpu")
    write(cache, 6, 0.0)
    cache.commit(6)
    cache.rollback(2)
    assert cache.length == 4 and cache.pending == 0
    k, _ = write(cache, 1, 700.0)[0]
    assert k.shape[2] == 5
    torch.testing.assert_close(k[:, :, :4], rows(SPECS[0], 6, 0.0)[:, :, :4])
    torch.testing.assert_close(k[:, :, 4:], rows(SPECS[0], 1, 700.0))


@pytest.mark.parametrize("action", ["commit_too_many", "commit_without_forward", "rollback_too_many",
                                    "commit_after_rollback"])
def test_invalid_moves_raise(action):
    cache = KVCache(SPECS, 16, torch.float32, "cpu")
    write(cache, 3, 0.0)
    with pytest.raises(ValueError):
        if action == "commit_too_many":
            cache.commit(4)
        elif action == "commit_without_forward":
            cache.commit(3)
            cache.commit(1)
        elif action == "rollback_too_many":
            cache.commit(3)
            cache.rollback(4)
        else:
            cache.rollback(0)  # drops the pending rows
            cache.commit(1)


def test_overflow_raises():
    cache = KVCache(SPECS, 1, torch.float32, "cpu")
    write(cache, cache.capacity, 0.0)
    cache.commit(cache.capacity)
    with pytest.raises(RuntimeError, match="overflow"):
        write(cache, 1, 0.0)


def test_growth_preserves_committed_rows():
    cache = KVCache(SPECS, 8, torch.float32, "cpu")
    first = cache.capacity
    write(cache, 10, 0.0)
    cache.commit(10)
    cache.ensure_capacity(first + 1)
    assert cache.capacity > first
    views = write(cache, 1, 5000.0)
    for i, (spec, (k, v)) in enumerate(zip(SPECS, views)):
        torch.testing.assert_close(k[:, :, :10], rows(spec, 10, 1000 * i))
        torch.testing.assert_close(v[:, :, :10], -rows(spec, 10, 1000 * i))
    assert cache.length == 10


def test_ensure_capacity_never_shrinks():
    cache = KVCache(SPECS, 600, torch.float32, "cpu")
    cap = cache.capacity
    assert cap >= 600
    cache.ensure_capacity(10)
    assert cache.capacity == cap


# ---- with a model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tiny_models):
    """Mistral with a 16-token window: rollback must also work after the window has slid."""
    path = tiny_models.get("cache_mistral", "mistral", sliding_window=16)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_model(path, torch.float32, torch.device("cpu")), hf


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def forward(model, cache: KVCache, tokens: list[int]) -> torch.Tensor:
    """Forward `tokens` after the cache's committed rows; logits [T, V] (nothing committed)."""
    start = cache.length
    positions = torch.arange(start, start + len(tokens))[None]
    return model.logits(model(torch.tensor([tokens]), positions, cache).hidden)[0]


@torch.inference_mode()
def reference(hf, tokens: list[int], last: int) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0, -last:]


def test_partial_commit_then_continue_matches_full_forward(models):
    model, hf = models
    prompt, drafts, after = ids(40, 0), ids(8, 1), ids(6, 2)
    cache = model.make_cache(64)
    forward(model, cache, prompt)
    cache.commit(len(prompt))
    forward(model, cache, drafts)  # a verify pass: 3 of 8 accepted
    cache.commit(3)
    got = forward(model, cache, after)
    torch.testing.assert_close(got, reference(hf, prompt + drafts[:3] + after, len(after)), atol=ATOL, rtol=RTOL)


def test_rollback_then_reforward_matches_full_forward(models):
    model, hf = models
    prompt, wrong, right = ids(40, 3), ids(12, 4), ids(12, 5)
    cache = model.make_cache(80)
    forward(model, cache, prompt)
    cache.commit(len(prompt))
    for tok in wrong:  # decode 12 tokens one at a time: the 16-token window slides
        forward(model, cache, [tok])
        cache.commit(1)
    cache.rollback(10)
    got = forward(model, cache, right)
    expected = reference(hf, prompt + wrong[:2] + right, len(right))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # and a fresh cache fed the same sequence gives the same logits
    fresh = model.make_cache(80)
    forward(model, fresh, prompt + wrong[:2])
    fresh.commit(42)
    torch.testing.assert_close(forward(model, fresh, right), got, atol=ATOL, rtol=RTOL)


def test_growth_mid_sequence_matches_full_forward(models):
    model, hf = models
    first, second = ids(250, 6), ids(20, 7)
    cache = model.make_cache(1)
    assert cache.capacity < len(first) + len(second)
    forward(model, cache, first)
    cache.commit(len(first))
    cache.ensure_capacity(len(first) + len(second))
    got = forward(model, cache, second)
    torch.testing.assert_close(got, reference(hf, first + second, len(second)), atol=ATOL, rtol=RTOL)
