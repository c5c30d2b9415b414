"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention) against Hugging Face transformers.

Tiny random checkpoints (`build_tiny_qwen3_5`: norm weights, A_log and dt_bias drawn so that a
skipped term shows) are saved with `save_pretrained` and loaded from disk by both sides:
- `text`: model_type qwen3_5_text (oracle Qwen3_5ForCausalLM), 8 layers, full attention every 4th;
- `wrapper`: model_type qwen3_5 (oracle Qwen3_5ForConditionalGeneration), text weights under
  model.language_model.*, a vision tower to skip, explicit layer_types, tied lm_head.
Then: the GDN kernels against transformers' torch fallbacks, logits over a prompt longer than one
prefill chunk, greedy ids for 64 new tokens, chunked vs one-shot prefill, the recurrent rollback
(commit(n) of a verify pass for every n), and lossless speculation (EAGLE3 and replay proposers).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForCausalLM as HFQwen3_5ForCausalLM
from transformers import Qwen3_5ForConditionalGeneration as HFQwen3_5ForConditionalGeneration
from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                          torch_recurrent_gated_delta_rule)

from verispec.cache.paged import BatchCache
from verispec.cache.kv import KVCache, LayerCacheSpec, RecurrentLayerSpec
from tools.tiny import build_tiny_qwen3_5, write_random_eagle3
from verispec.engine.engine import load_engine
from verispec.loading.model_loader import load_model
from verispec.models.layers import gated_delta_net
from verispec.models.layers.attention import AttentionInputs
from verispec.models.layers.gated_delta_net import torch_gated_delta_rule
from verispec.models.qwen3_5 import LayerType, Qwen3_5DecoderLayer, Qwen3_5Settings
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3

from tests.spec.conftest import ReplayProposer, greedy, spec_engine
from tests.models.family_checks import Loaded, hf_logits, load_case, our_logits, random_ids, run_passes

# One-shot prefill runs the chunked GDN algorithm, as transformers does for a whole prompt:
# measured max |verispec - transformers| 4.9e-6 (text) / 1.4e-6 (wrapper) on logits of magnitude ~3.
LOGITS_ATOL = 2e-5
LOGITS_RTOL = 1e-5
# Passes of <= 16 tokens run the token-by-token recurrence, which rounds differently from the
# chunked algorithm (~1e-6 per GDN layer, amplified by the random layers). Measured: 2.3e-5 against
# transformers over 100 tokens in 16-token chunks, 1.3e-4 for 1-token chunks against one-shot,
# 8.1e-5 after partial commits. In float64 the same comparisons agree to 1e-13, so this is rounding;
# real mistakes (a state one position off, a conv window without the committed state, a missing
# dt_bias, query/gate swapped, a norm without its 1 + w) move logits by > 1.
RECURRENT_ATOL = 5e-4
RECURRENT_RTOL = 1e-4
# bfloat16, one-shot prefill: measured 0.0 (the same kernels in the same order); torch's default
# bf16 tolerance allows another kernel order.
BF16_ATOL = 1e-5
BF16_RTOL = 1.6e-2
# The kernels alone, float32, against transformers' own torch fallbacks (measured <= 3.8e-6).
KERNEL_ATOL = 2e-5
KERNEL_RTOL = 1e-5

PREFILL_STEP = 16
NEW_TOKENS = 64
LOGITS_PROMPT_LEN = 100
GREEDY_PROMPT_LENS = (9, 50, 81)

CASES = {
    "text": dict(wrapper=False, num_hidden_layers=8,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}),
    "wrapper": dict(wrapper=True, num_hidden_layers=4, tie_word_embeddings=True,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
}


@pytest.fixture(scope="module")
def qwen3_5_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_5")
    for i, (name, case) in enumerate(CASES.items()):
        build_tiny_qwen3_5(root / name, seed=11 + i, tokenizer_dir=tokenizer_dir, **case)
    return {name: root / name for name in CASES}


def hf_model(name: str, path: Path, dtype=torch.float32) -> torch.nn.Module:
    cls = HFQwen3_5ForConditionalGeneration if CASES[name]["wrapper"] else HFQwen3_5ForCausalLM
    hf = cls.from_pretrained(str(path), dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # run the full 64 tokens on both sides
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, qwen3_5_dirs) -> Loaded:
    path = qwen3_5_dirs[request.param]
    return load_case(request.param, path, hf_model(request.param, path), PREFILL_STEP)


# ---- config and layout -----------------------------------------------------------------------
def test_config_matches_transformers(loaded):
    """Guards the fixtures: both layer types appear at least twice, the partial rotary width and
    tying are what transformers built, and the cache has one spec of the right kind per layer."""
    hf_text = loaded.hf.config.get_text_config()
    s = loaded.ours.settings
    assert [t.value for t in s.layer_types] == list(hf_text.layer_types)
    for t in LayerType:
        assert s.layer_types.count(t) >= 2
    hf_rotary = (loaded.hf.model.language_model if CASES[loaded.name]["wrapper"] else loaded.hf.model).rotary_emb
    assert s.rotary_dim == 2 * hf_rotary.inv_freq.numel() < s.head_dim
    hf_tied = loaded.hf.lm_head.weight.data_ptr() == loaded.hf.get_input_embeddings().weight.data_ptr()
    ours_tied = loaded.ours.lm_head.weight.data_ptr() == loaded.ours.model.embed_tokens.weight.data_ptr()
    assert ours_tied == hf_tied == CASES[loaded.name].get("tie_word_embeddings", False)
    for t, spec in zip(s.layer_types, loaded.ours.cache_specs()):
        if t is LayerType.LINEAR_ATTENTION:
            assert spec == RecurrentLayerSpec(2 * 2 * 8 + 4 * 12, 4, 4, 8, 12)
        else:
            assert spec == LayerCacheSpec(2, 16)


def test_wrapper_layout_and_skipped_vision(qwen3_5_dirs, monkeypatch):
    """The multimodal checkpoint keeps text weights under model.language_model.* next to a vision
    tower; all vision tensors are skipped with one debug line."""
    from safetensors import safe_open

    path = qwen3_5_dirs["wrapper"]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["model_type"] == "qwen3_5_text"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    visual = [n for n in names if n.startswith("model.visual.")]
    assert visual
    lines = []
    monkeypatch.setattr("verispec.loading.model_loader.log.debug", lambda msg, *a: lines.append(msg % a))
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    ignored = [line for line in lines if "ignored" in line]
    assert len(ignored) == 1 and f"ignored {len(visual)} checkpoint tensors" in ignored[0]


def test_full_attention_interval_without_layer_types(qwen3_5_dirs):
    """Older configs give `full_attention_interval` instead of `layer_types` (as transformers reads it)."""
    config = json.loads((qwen3_5_dirs["text"] / "config.json").read_text())
    expected = config.pop("layer_types")
    config["full_attention_interval"] = 4
    assert [t.value for t in Qwen3_5Settings(config).layer_types] == expected
    assert expected.count("full_attention") == 2 and expected[3] == expected[7] == "full_attention"


# ---- the Gated DeltaNet kernels ------------------------------------------------------------------
def gdn_inputs(batch: int, length: int, seed: int, dtype=torch.float32):
    """Raw q/k (not normalised), v, g <= 0, beta in (0, 1), a non-zero initial state."""
    gen = torch.Generator().manual_seed(seed)
    heads, dk, dv = 4, 8, 12
    q = torch.randn(batch, length, heads, dk, generator=gen)
    k = torch.randn(batch, length, heads, dk, generator=gen)
    v = torch.randn(batch, length, heads, dv, generator=gen)
    rate = torch.empty(heads).uniform_(0.01, 2.0, generator=gen)
    g = -rate * torch.nn.functional.softplus(torch.randn(batch, length, heads, generator=gen))
    beta = torch.rand(batch, length, heads, generator=gen)
    state = torch.randn(batch, heads, dk, dv, generator=gen)
    return [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype), state]


@pytest.mark.parametrize("length", [1, 5, 16, 17, 100, 130])
def test_gdn_kernels_match_transformers(length):
    """Both of our algorithms (per-position recurrence, chunked) against both of transformers'
    (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule), from a non-zero state, with
    lengths that do and don't fill the 64-token chunks."""
    q, k, v, g, beta, state = gdn_inputs(2, length, seed=length)
    kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_rec, ref_rec_state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    ref_chunk, ref_chunk_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    for per_position in (True, False):
        out, states = torch_gated_delta_rule(q, k, v, g, beta, state, per_position)
        assert states.dtype == torch.float32
        assert states.shape == ((length if per_position else 1), 2, 4, 8, 12)
        for ref, ref_state in ((ref_rec, ref_rec_state), (ref_chunk, ref_chunk_state)):
            torch.testing.assert_close(out, ref, atol=KERNEL_ATOL, rtol=KERNEL_RTOL)
            torch.testing.assert_close(states[-1], ref_state, atol=KERNEL_ATOL, rtol=KERNEL_RTOL)


def test_gdn_per_position_states():
    """states[n - 1] of a pass is the state after its first n tokens (what commit(n) restores)."""
    q, k, v, g, beta, state = gdn_inputs(1, 6, seed=7)
    _, states = torch_gated_delta_rule(q, k, v, g, beta, state, per_position=True)
    for n in range(1, 7):
        _, ref = torch_recurrent_gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n],
                                                  initial_state=state, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(states[n - 1], ref, atol=KERNEL_ATOL, rtol=KERNEL_RTOL)
    assert (states[0] - states[1]).abs().max() > 1e-2  # positions really differ


def test_gdn_dispatch_uses_torch_on_cpu(monkeypatch):
    """The fla path is for CUDA only; on CPU the torch reference runs even when fla would import."""
    monkeypatch.setattr(gated_delta_net, "fla_available", lambda: True)
    monkeypatch.setattr(gated_delta_net, "fla_gated_delta_rule", lambda *a: pytest.fail("fla path on CPU"))
    q, k, v, g, beta, state = gdn_inputs(1, 3, seed=1)
    out, _ = gated_delta_net.gated_delta_rule(q, k, v, g, beta, state, True)
    assert out.shape == (1, 3, 4, 12)


# ---- parity with transformers --------------------------------------------------------------------
def test_logits_match_transformers(loaded):
    ids = random_ids(LOGITS_PROMPT_LEN, loaded.ours.vocab_size, seed=0)
    ref = hf_logits(loaded.hf, ids)
    one_shot = our_logits(loaded.ours, ids)
    assert one_shot.shape == ref.shape == (LOGITS_PROMPT_LEN, loaded.ours.vocab_size)
    torch.testing.assert_close(one_shot, ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    chunked = our_logits(loaded.ours, ids, PREFILL_STEP)
    torch.testing.assert_close(chunked, ref, atol=RECURRENT_ATOL, rtol=RECURRENT_RTOL)


def test_captured_streams_match_transformers(loaded):
    """aux[j] is the residual stream entering layer capture[j] (duplicates allowed); pre_norm is the
    stream before the final norm."""
    ids = random_ids(40, loaded.ours.vocab_size, seed=3)
    n = loaded.ours.num_layers
    capture = (n - 1, 0, 1, 1, 3)
    with torch.inference_mode():
        ref = loaded.hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [embeddings, layer outputs]
        out = loaded.ours(torch.tensor([ids]), torch.arange(len(ids))[None], loaded.ours.make_cache(len(ids)), capture)
        torch.testing.assert_close(loaded.ours.model.norm(out.pre_norm), out.hidden)
    assert len(out.aux) == len(capture)
    for layer, aux in zip(capture, out.aux):
        torch.testing.assert_close(aux, ref[layer], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    torch.testing.assert_close(out.hidden, ref[-1], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_chunked_prefill_matches_one_shot(loaded):
    """Chunks of 1 and 7 (per-position recurrence) and 40 (chunked algorithm from a non-zero
    state and conv window) against one pass over the whole prompt."""
    ids = random_ids(93, loaded.ours.vocab_size, seed=1)
    one_shot = our_logits(loaded.ours, ids)
    for chunk in (1, 7, PREFILL_STEP, 40):
        torch.testing.assert_close(our_logits(loaded.ours, ids, chunk), one_shot,
                                   atol=RECURRENT_ATOL, rtol=RECURRENT_RTOL)


@pytest.mark.parametrize("prompt_len", GREEDY_PROMPT_LENS)
def test_greedy_matches_transformers(loaded, prompt_len):
    ids = random_ids(prompt_len, loaded.engine.tokenizer.vocab_size, seed=100 + prompt_len)
    with torch.inference_mode():
        ref = loaded.hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 pad_token_id=0)[0, prompt_len:].tolist()
    assert len(ref) == NEW_TOKENS
    result = loaded.engine.generate_all(ids, greedy(NEW_TOKENS))
    assert result.token_ids == ref
    assert result.finish_reason.value == "length"


def test_bf16_logits_match_transformers(loaded):
    """bfloat16 weights and activations, SSM state in float32 on both sides."""
    hf = hf_model(loaded.name, loaded.path, torch.bfloat16)
    ours = load_model(loaded.path, torch.bfloat16, torch.device("cpu"))
    ids = random_ids(LOGITS_PROMPT_LEN, ours.vocab_size, seed=0)
    got, ref = our_logits(ours, ids), hf_logits(hf, ids)
    assert got.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, atol=BF16_ATOL, rtol=BF16_RTOL)
    chunked = our_logits(ours, ids, PREFILL_STEP)
    assert chunked.dtype == torch.bfloat16 and torch.isfinite(chunked).all()


# ---- recurrent rollback --------------------------------------------------------------------------
PROMPT_LEN = 21  # one pass of > 16 tokens: the chunked algorithm, final state only


@pytest.mark.parametrize("num_verify", [2, 3, 4, 5, 6])
def test_partial_commit_of_verify_pass(loaded, num_verify):
    """After a prefill, a verify-like pass of T tokens is committed partially, commit(n) for every
    n in 1..T; decoding then goes on (a 3-token pass and two 1-token passes). Every logit row must
    equal transformers' over the committed sequence alone: the rejected tokens leave no trace in
    the conv window, the SSM states or the K/V rows."""
    model, vocab = loaded.ours, loaded.ours.vocab_size
    prompt = random_ids(PROMPT_LEN, vocab, seed=10)
    verify = random_ids(num_verify, vocab, seed=20 + num_verify)
    cont = random_ids(5, vocab, seed=30 + num_verify)
    ref_verify = hf_logits(loaded.hf, prompt + verify)[PROMPT_LEN:]
    for n in range(1, num_verify + 1):
        cache = model.make_cache(64)
        run_passes(model, cache, prompt, [PROMPT_LEN])
        with torch.inference_mode():
            positions = torch.arange(PROMPT_LEN, PROMPT_LEN + num_verify)[None]
            logits = model.logits(model(torch.tensor([verify]), positions, cache).hidden)[0]
        torch.testing.assert_close(logits, ref_verify, atol=RECURRENT_ATOL, rtol=RECURRENT_RTOL)
        cache.commit(n)
        assert cache.length == PROMPT_LEN + n
        got = run_passes(model, cache, cont, [3, 1, 1], start=PROMPT_LEN + n)
        ref = hf_logits(loaded.hf, prompt + verify[:n] + cont)[PROMPT_LEN + n:]
        torch.testing.assert_close(got, ref, atol=RECURRENT_ATOL, rtol=RECURRENT_RTOL, msg=f"commit({n})")


def test_commit_of_long_pass(loaded):
    """A pass longer than max_tracked_positions keeps only its final recurrent state: committing
    part of it raises (and changes nothing), committing it whole works. A pass of exactly
    max_tracked_positions tokens may be committed partially."""
    model, vocab = loaded.ours, loaded.ours.vocab_size
    tracked = KVCache.max_tracked_positions
    prompt = random_ids(PROMPT_LEN, vocab, seed=40)
    long_pass = random_ids(tracked + 1, vocab, seed=41)
    cache = model.make_cache(128)
    run_passes(model, cache, prompt, [8, 8, 5])
    with torch.inference_mode():
        model(torch.tensor([long_pass]), torch.arange(PROMPT_LEN, PROMPT_LEN + tracked + 1)[None], cache)
    with pytest.raises(ValueError, match="kept only its final"):
        cache.commit(5)
    cache.commit(tracked + 1)
    start = PROMPT_LEN + tracked + 1
    got = run_passes(model, cache, [7, 8], [1, 1], start=start)
    ref = hf_logits(loaded.hf, prompt + long_pass + [7, 8])[start:]
    torch.testing.assert_close(got, ref, atol=RECURRENT_ATOL, rtol=RECURRENT_RTOL)

    full = long_pass[:tracked]
    cache = model.make_cache(128)
    run_passes(model, cache, prompt, [PROMPT_LEN])
    with torch.inference_mode():
        model(torch.tensor([full]), torch.arange(PROMPT_LEN, PROMPT_LEN + tracked)[None], cache)
    cache.commit(5)
    got = run_passes(model, cache, [7], [1], start=PROMPT_LEN + 5)
    ref = hf_logits(loaded.hf, prompt + full[:5] + [7])[-1:]
    torch.testing.assert_close(got, ref, atol=RECURRENT_ATOL, rtol=RECURRENT_RTOL)


def test_standalone_full_attention_layer(loaded):
    """A full-attention decoder layer built standalone (as the MTP head's) on its own 1-layer cache
    computes what the backbone's layer computes, given the same weights."""
    model = loaded.ours
    s = model.settings
    idx = s.layer_types.index(LayerType.FULL_ATTENTION)
    layer = Qwen3_5DecoderLayer(s, 0, "full_attention")
    layer.load_state_dict(model.model.layers[idx].state_dict())
    x = torch.randn(1, 12, s.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)[None]
    cos, sin = model.rotary(positions, x.dtype)
    with torch.inference_mode():
        specs = model.cache_specs()
        backbone_cache = KVCache(specs, 16, x.dtype, x.device)
        own_cache = KVCache([layer.cache_spec()], 16, x.dtype, x.device)
        ref = model.model.layers[idx](x, None, cos, sin, AttentionInputs(positions, backbone_cache))
        got = layer(x, None, cos, sin, AttentionInputs(positions, own_cache))
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    assert own_cache.pending == 12


# ---- lossless speculation ------------------------------------------------------------------------
SPEC_PROMPTS = [
    "def fibonacci(n):",
    "import collections\n\nclass Counter(dict):\n    def __init__(self, iterable=None, /, **kwds):",
    "x",
]


@pytest.fixture(scope="module")
def spec_target(qwen3_5_dirs):
    """The text target in float64 (no argmax near-ties), its prompts and plain greedy outputs."""
    engine = load_engine(str(qwen3_5_dirs["text"]), dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP)
    prompts = [engine.tokenizer.encode(p) for p in SPEC_PROMPTS]
    plain = [engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompts]
    return engine, prompts, plain


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_eagle3_identity(spec_target, tmp_path):
    engine, prompts, plain = spec_target
    text_config = json.loads((engine.model_dir / "config.json").read_text())
    drafter_dir = write_random_eagle3(tmp_path / "eagle3", text_config, seed=1, aux_layer_ids=[1, 3, 6])
    proposer = Eagle3Proposer(load_eagle3(drafter_dir, engine.model), engine.model.vocab_size)
    for k in range(1, 5):
        spec = spec_engine(engine, proposer, k)
        for i, ids in enumerate(prompts):
            result = spec.generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == plain[i], f"k={k} prompt {i}"
            assert result.stats.method == "eagle3" and result.stats.drafted > 0


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_always_right_proposer(spec_target, k):
    """All k drafts accepted each round: every verify pass is committed whole."""
    engine, prompts, plain = spec_target
    for i, ids in enumerate(prompts):
        result = spec_engine(engine, ReplayProposer(plain[i], engine.model.vocab_size), k).generate_all(
            ids, greedy(NEW_TOKENS))
        assert result.token_ids == plain[i]
        assert result.stats.accepted == result.stats.drafted
        assert result.stats.rounds == -(-(NEW_TOKENS - 1) // (k + 1))


def test_rejection_at_every_depth(spec_target, monkeypatch):
    """Drafts right except at continuation indices = reject_at (mod 4), k = 4: the rejections fall
    at every depth of the chain, so 5-token verify passes are committed partially at each n in 1..4
    (every 4 consecutive drafts hold one wrong one; whole commits are test_always_right_proposer's)."""
    engine, prompts, plain = spec_target
    verify_commits = set()
    commit = BatchCache.commit

    def recording_commit(cache, num_rows):
        if cache.positions.shape[1] == 5:  # the verify passes (one sequence)
            verify_commits.add(num_rows[0])
        commit(cache, num_rows)

    monkeypatch.setattr(BatchCache, "commit", recording_commit)
    for reject_at in range(4):
        for i, ids in enumerate(prompts):
            proposer = ReplayProposer(plain[i], engine.model.vocab_size, right_at=lambda j: j % 4 != reject_at)
            result = spec_engine(engine, proposer, 4).generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == plain[i], f"reject_at={reject_at} prompt {i}"
            assert 0 < result.stats.accepted < result.stats.drafted
    assert verify_commits == {1, 2, 3, 4}


def test_always_wrong_proposer(spec_target):
    engine, prompts, plain = spec_target
    wrong = ReplayProposer(plain[0], engine.model.vocab_size, right_at=lambda j: False)
    result = spec_engine(engine, wrong, 3).generate_all(prompts[0], greedy(NEW_TOKENS))
    assert result.token_ids == plain[0]
    assert result.stats.accepted == 0 and result.stats.rounds == NEW_TOKENS - 1


def test_fla_path_plumbing_with_stand_in_kernels(monkeypatch):
    """On CPU, the fla path runs against stand-ins for fla's two kernels built from transformers'
    torch fallbacks (which mirror fla's signatures): checks the argument passing, the token-by-token
    stepping and the state stacking, not the Triton kernels themselves (test_fla_* below, on CUDA)."""
    import sys
    import types

    def stand_in(kernel):
        def call(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                 cu_seqlens=None, cu_seqlens_cpu=None):
            assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and g.dtype == torch.float32
            if cu_seqlens is None:
                return kernel(q, k, v, g=g, beta=beta, initial_state=initial_state,
                              output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            # fla's variable-length form: B = 1, sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]
            assert q.shape[0] == 1 and cu_seqlens.tolist() == cu_seqlens_cpu.tolist()
            bounds = cu_seqlens_cpu.tolist()
            outs, finals = [], []
            for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
                out, final = kernel(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                                    initial_state=initial_state[i:i + 1], output_final_state=True,
                                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
                outs.append(out)
                finals.append(final)
            return torch.cat(outs, dim=1), torch.cat(finals)
        return call

    fake = types.ModuleType("fla.ops.gated_delta_rule")
    fake.chunk_gated_delta_rule = stand_in(torch_chunk_gated_delta_rule)
    fake.fused_recurrent_gated_delta_rule = stand_in(torch_recurrent_gated_delta_rule)
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    for length, per_position in ((1, True), (6, True), (16, True), (17, False), (100, False)):
        q, k, v, g, beta, state = gdn_inputs(2, length, seed=length)
        out, states = gated_delta_net.fla_gated_delta_rule(q, k, v, g, beta, state, per_position)
        ref, ref_states = torch_gated_delta_rule(q, k, v, g, beta, state, per_position)
        assert states.shape == ref_states.shape
        torch.testing.assert_close(out, ref, atol=KERNEL_ATOL, rtol=KERNEL_RTOL)
        torch.testing.assert_close(states, ref_states, atol=KERNEL_ATOL, rtol=KERNEL_RTOL)


# ---- flash-linear-attention (CUDA only) ----------------------------------------------------------
def _needs_fla():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not gated_delta_net.fla_available():
        pytest.skip("needs flash-linear-attention (fla)")


# bfloat16 inputs; both sides keep the state in float32, fla's matmuls run on bf16 tiles.
FLA_ATOL = 3e-2
FLA_RTOL = 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 5, 16, 17, 100, 300])
def test_fla_matches_torch_reference(length):
    _needs_fla()
    q, k, v, g, beta, state = (x.cuda() for x in gdn_inputs(2, length, seed=length))
    q, k, v, beta = (x.to(torch.bfloat16) for x in (q, k, v, beta))
    for per_position in ([True, False] if length <= KVCache.max_tracked_positions else [False]):
        out, states = gated_delta_net.fla_gated_delta_rule(q, k, v, g, beta, state, per_position)
        ref, ref_states = torch_gated_delta_rule(q, k, v, g, beta, state, per_position)
        assert out.dtype == torch.bfloat16 and states.dtype == torch.float32
        assert states.shape == ref_states.shape
        torch.testing.assert_close(out.float(), ref.float(), atol=FLA_ATOL, rtol=FLA_RTOL)
        torch.testing.assert_close(states, ref_states, atol=FLA_ATOL, rtol=FLA_RTOL)


@pytest.mark.gpu
def test_fla_model_logits_match_torch_path(qwen3_5_dirs, monkeypatch):
    """The text model on CUDA in bfloat16 through a prefill longer than 16 tokens and short
    decode/verify passes: with fla, the logits are as close to a float32 reference (torch path)
    as the bf16 torch path's are — bf16 error is expected, a larger one would be a bug."""
    _needs_fla()
    ids = random_ids(80, 10_000, seed=5)
    sizes = [40, 16, 1, 1, 1, 7, 1]
    reference_model = load_model(qwen3_5_dirs["text"], torch.float32, torch.device("cuda"))
    ids = [i % reference_model.vocab_size for i in ids]
    model = load_model(qwen3_5_dirs["text"], torch.bfloat16, torch.device("cuda"))
    with_fla = run_passes(model, model.make_cache(128), ids[:67], sizes).float()
    monkeypatch.setattr(gated_delta_net, "fla_available", lambda: False)
    torch_bf16 = run_passes(model, model.make_cache(128), ids[:67], sizes).float()
    reference = run_passes(reference_model, reference_model.make_cache(128), ids[:67], sizes).float()

    def rel(x):
        return float((x - reference).norm() / reference.norm())

    assert rel(with_fla) <= max(2 * rel(torch_bf16), 2e-2), (rel(with_fla), rel(torch_bf16))