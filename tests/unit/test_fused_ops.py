"""The CUDA fast path's model rewrites give the same model: merged q/k/v and gate/up GEMMs,
and compiled (fused) norms, RoPE, residual adds and activation. Checked on CPU."""
from __future__ import annotations

import copy

import pytest
import torch

from tools.tiny import build_tiny_qwen3_5
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.models.layers import fused

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def logits_of(model, ids):
    cache = model.make_cache(len(ids))
    out = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, capture=(0, 1))
    return model.logits(out.hidden), out.aux, out.pre_norm


def test_merged_projections_same_outputs(tiny_models):
    path = tiny_models.get("fused-qwen2", "qwen2")  # q/k/v biases get merged too
    engine = load_engine(str(path), dtype="float64", device="cpu", prefill_step_size=16)
    merged = copy.deepcopy(engine.model)
    merged.fuse_small_ops(compile=False)
    merged.fuse_small_ops(compile=False)  # idempotent
    assert not hasattr(merged.model.layers[0].self_attn, "q_proj")
    ids = engine.tokenizer.encode("def fibonacci(n):\n    return fibonacci(n - 1)")
    (a, aux_a, pre_a), (b, aux_b, pre_b) = logits_of(engine.model, ids), logits_of(merged, ids)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for x, y in zip(aux_a + [pre_a], aux_b + [pre_b]):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    other = Engine(merged, engine.tokenizer, engine.config, engine.model_dir)
    assert other.generate_all(ids, GREEDY).token_ids == engine.generate_all(ids, GREEDY).token_ids


def test_merging_frees_each_layers_projections_as_it_goes(tiny_models, monkeypatch):
    """A layer's replaced projections are gone once the next layer merges: held to the end, they sat
    beside their merged copies (a CPU load's peak)."""
    import weakref

    from verispec.loading.model_loader import load_model
    from verispec.models.layers.mlp import GatedMLP

    path = tiny_models.get("fused-qwen2", "qwen2")
    model = load_model(path, torch.float32, torch.device("cpu"))  # not yet prepared: nothing merged
    mlps = [layer.mlp for layer in model.model.layers]
    assert len(mlps) >= 2 and all(isinstance(m, GatedMLP) for m in mlps)
    gone_before = {id(m): weakref.ref(m.gate_proj) for m in mlps[:-1]}
    merge = GatedMLP.merge_projections
    seen = []

    def checked(self):
        if seen:  # the MLP merged before this one let its projections go
            assert gone_before[seen[-1]]() is None
        seen.append(id(self))
        merge(self)
    monkeypatch.setattr(GatedMLP, "merge_projections", checked)
    del mlps
    model.fuse_small_ops(compile=False)
    assert len(seen) >= 2


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_compiled_small_ops_match_eager(tiny_models):
    path = tiny_models.get("fused-qwen3", "qwen3")
    engine = load_engine(str(path), dtype="float32", device="cpu", prefill_step_size=16)
    fast = copy.deepcopy(engine.model)
    fast.fuse_small_ops(compile=True)
    assert fast.model.layers[0].self_attn.prepare_qk is fused.fast_prepare_qk  # the compiled function on a CPU
    for ids in ([5, 9, 200, 31, 7] * 7, [44]):
        (a, _, _), (b, _, _) = logits_of(engine.model, ids), logits_of(fast, ids)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_hybrid_rewrites_same_outputs(tmp_path_factory, tokenizer_dir):
    """Qwen3.5: merged GDN input projections (qkv, z, b, a) and attention q/k/v in float64 give
    the same logits; compiled gates, conv, gated norm and RoPE match in float32."""
    path = tmp_path_factory.mktemp("fused-qwen3_5")
    build_tiny_qwen3_5(path, seed=5, tokenizer_dir=tokenizer_dir)
    engine = load_engine(str(path), dtype="float64", device="cpu", prefill_step_size=16)
    merged = copy.deepcopy(engine.model)
    merged.fuse_small_ops(compile=False)
    gdn = next(layer.linear_attn for layer in merged.model.layers if hasattr(layer, "linear_attn"))
    assert gdn.in_proj is not None and not hasattr(gdn, "in_proj_b")
    ids = engine.tokenizer.encode("def fibonacci(n):\n    return fibonacci(n - 1)")
    (a, _, pre_a), (b, _, pre_b) = logits_of(engine.model, ids), logits_of(merged, ids)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pre_a, pre_b, rtol=1e-12, atol=1e-12)
    other = Engine(merged, engine.tokenizer, engine.config, engine.model_dir)
    assert other.generate_all(ids, GREEDY).token_ids == engine.generate_all(ids, GREEDY).token_ids

    eager32 = load_engine(str(path), dtype="float32", device="cpu").model
    fast = copy.deepcopy(eager32)
    fast.fuse_small_ops(compile=True)
    assert fast.model.layers[0].linear_attn.conv is fused.compiled(fused.causal_conv_silu)
    for ids in ([5, 9, 200, 31, 7] * 7, [44]):
        (a, _, _), (b, _, _) = logits_of(eager32, ids), logits_of(fast, ids)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_causal_conv_matches_conv1d():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 4, generator=gen, dtype=torch.float64)
    for t in (1, 3, 70):
        window = torch.randn(2, 24, 3 + t, generator=gen, dtype=torch.float64)
        ref = torch.nn.functional.silu(torch.nn.functional.conv1d(window, weight[:, None, :], groups=24))
        torch.testing.assert_close(fused.causal_conv_silu(window, weight), ref, rtol=1e-12, atol=1e-12)


def test_prewarm_prefills_every_length_class_once_unsplit(tiny_models, monkeypatch):
    """warmup.warm_prompt_lengths: every short pass length whose kernels specialise on it (split-K
    attention to MAX_QUERY_TOKENS, the Gated DeltaNet per-position kernel to 16 tokens), and 16 consecutive prompt lengths (every residue mod 16) at one and at two 64-token
    chunks, each one prefill pass of its whole length (no prefix hit, no split)."""
    from verispec.kernels import decode_attention as split_k
    from verispec.engine import warmup

    engine = load_engine(str(tiny_models.get("qwen3", "qwen3")), device="cpu", dtype="float32", kv_cache_gb=0.05,
                         max_model_len=256, batch_prefill=True)  # prewarm's batched passes, as on CUDA
    seen = []
    original = engine.runner.prefill
    # one-sequence passes: each length once (the batched passes of each group come on top)
    batch_sizes = []
    monkeypatch.setattr(engine.runner, "prefill", lambda seqs, counts, *a, **k: (
        seen.extend(counts), batch_sizes.append(len(seqs)), original(seqs, counts, *a, **k))[2])
    warmup.warm_prompt_lengths(engine)
    expected = [n for first in warmup.WARM_LENGTH_STARTS for n in range(first, first + warmup.WARM_LENGTHS_PER_START)]
    # each length twice, unsplit: alone, then with its group (passes of several sequences)
    assert sorted(seen) == sorted(2 * (expected + list(range(1, max(split_k.MAX_QUERY_TOKENS, 16) + 1))))
    assert max(batch_sizes) > 1
    for first in warmup.WARM_LENGTH_STARTS:
        assert {n % 16 for n in range(first, first + warmup.WARM_LENGTHS_PER_START)} == set(range(16))
