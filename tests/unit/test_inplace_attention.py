"""The in-place decode path (K/V written at device-side positions, attention bounded by
positions: what CUDA graphs and the split-K kernel use) gives the same results as the SDPA path.
On CPU the kernel's torch reference stands in for the Triton kernel."""
from __future__ import annotations

import pytest
import torch

from tools.tiny import build_tiny_qwen3_5
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.kernels.decode_attention import decode_attention_reference
from verispec.models.layers.attention import attention_mask

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


class InPlaceEngine(Engine):
    """An engine whose cache uses the in-place path, as on CUDA."""

    def _cache_for(self, num_rows):
        cache = super()._cache_for(num_rows)
        cache.use_decode_kernel = True
        return cache


@pytest.mark.parametrize("name,model_type,overrides", [
    ("inplace-qwen3", "qwen3", {}),
    ("inplace-mistral", "mistral", {"sliding_window": 12}),
])
def test_in_place_decode_matches_sdpa(tiny_models, name, model_type, overrides):
    path = tiny_models.get(name, model_type, **overrides)
    plain = load_engine(str(path), dtype="float64", device="cpu", prefill_step_size=16)
    inplace = InPlaceEngine(plain.model, plain.tokenizer, plain.config, plain.model_dir)
    for prompt in ("def fibonacci(n):", "x" * 30):
        ids = plain.tokenizer.encode(prompt)
        assert inplace.generate_all(ids, GREEDY).token_ids == plain.generate_all(ids, GREEDY).token_ids


def test_reference_kernel_matches_masked_sdpa():
    torch.manual_seed(0)
    q = torch.randn(1, 8, 5, 32, dtype=torch.float64)
    k = torch.randn(1, 2, 50, 32, dtype=torch.float64)
    v = torch.randn(1, 2, 50, 32, dtype=torch.float64)
    positions = torch.arange(35, 40)[None]
    for window in (None, 7):
        ours = decode_attention_reference(q, k, v, positions, 32 ** -0.5, window)
        mask = attention_mask(positions, 40, window)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q, k[:, :, :40], v[:, :, :40], attn_mask=mask, scale=32 ** -0.5, enable_gqa=True)
        torch.testing.assert_close(ours, sdpa, rtol=1e-12, atol=1e-12)


def test_hybrid_in_place_decode_matches_sdpa(tmp_path, tokenizer_dir):
    """Qwen3.5's gated attention layers take the in-place path too (the hybrid's graph path)."""
    build_tiny_qwen3_5(tmp_path / "m", seed=3, tokenizer_dir=tokenizer_dir)
    plain = load_engine(str(tmp_path / "m"), dtype="float64", device="cpu", prefill_step_size=16)
    inplace = InPlaceEngine(plain.model, plain.tokenizer, plain.config, plain.model_dir)
    for prompt in ("def fibonacci(n):", "x" * 30):
        ids = plain.tokenizer.encode(prompt)
        assert inplace.generate_all(ids, GREEDY).token_ids == plain.generate_all(ids, GREEDY).token_ids
