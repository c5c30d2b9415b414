"""Gemma 4 against Hugging Face transformers (the external oracle).

Tiny random checkpoints (`build_tiny_gemma4`: weight-only norms, layer_scalar and the router's
scales drawn in [0.5, 1.5) so that a skipped or misplaced term shows) are saved with
`save_pretrained` and loaded from disk by both sides:
- `dense`: model_type gemma4_text (oracle Gemma4ForCausalLM), the 31B's structure: sliding layers
  (window 8, 2 kv heads x 16) and full layers (1 kv head x 32, k_eq_v, proportional RoPE), tied
  lm_head, final logit softcapping;
- `moe_wrapper`: model_type gemma4 (oracle Gemma4ForConditionalGeneration), the 26B-A4B's routed
  experts beside the dense MLP, text weights under model.language_model.*, a vision tower to skip,
  untied lm_head;
- `e_series`: gemma4_text with the small models' features: per-layer inputs, the last 2 layers
  reading the K/V of earlier ones, double-wide MLP there, no k_eq_v, attention bias.
Every prompt is longer than the sliding window and than one prefill chunk. The MoE oracle runs
transformers' eager experts (its default grouped_mm sums experts in another order).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma4ForCausalLM as HFGemma4ForCausalLM
from transformers import Gemma4ForConditionalGeneration as HFGemma4ForConditionalGeneration

from tools.tiny import GEMMA4_TINY_TEXT, build_tiny_gemma4
from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams
from verispec.errors import UnsupportedModelError
from verispec.loading.model_loader import load_model
from verispec.models.gemma4 import Gemma4Settings, LayerType, gemma_rms_norm
from verispec.models.layers import fused, moe
from verispec.models.registry import model_class
from tests.models.family_checks import Loaded, hf_logits, load_case, our_logits, random_ids, run_passes

# Measured max |verispec - transformers| over a 100-token prompt, float32, one thread: 0.0 for every
# case (the same kernels in the same order; with multi-threaded BLAS the MoE case showed 4.2e-7, the
# per-expert matmuls running on gathered rows of another alignment). Logits are of magnitude ~2.7
# (softcap 5). Real mistakes (a norm as 1 + w, layer_scalar skipped, the router on the normed
# stream, a wrong RoPE split) move them by > 1e-2.
LOGITS_ATOL = 1e-5
LOGITS_RTOL = 1e-5
# Passes of other sizes (1- and 7-token chunks, partial commits, the in-place decode-kernel path
# with its einsum reference) run other matmul shapes: measured <= 3.8e-5 in float32 (attention at
# scale 1.0 over unit-RMS q/k is peaked and amplifies rounding); the same comparisons agree to 1e-13
# in float64, so this is rounding, not a position or mask error.
PASSES_ATOL = 1e-4
PASSES_RTOL = 1e-5
# bfloat16 weights and activations on both sides: measured 0.0 (the norms, router and scaled
# embedding round where transformers rounds); torch's default bf16 rtol allows another kernel order.
BF16_ATOL = 1e-5
BF16_RTOL = 1.6e-2
# The experts' grouped and gathered paths against the loop (float32): measured 0.0 and 1.0e-7.
EXPERTS_ATOL = 1e-6
EXPERTS_RTOL = 1e-5
# A feature switched off (same weights) must move the logits by far more than the tolerances.
FEATURE_EFFECT_MIN = 1e-2

PREFILL_STEP = 16
NEW_TOKENS = 64
LOGITS_PROMPT_LEN = 100
GREEDY_PROMPT_LENS = (9, 50, 81)  # 9: longer than the 8-token window; 50, 81: several prefill chunks
WINDOW = GEMMA4_TINY_TEXT["sliding_window"]

CASES = {
    "dense": dict(moe=False, wrapper=False),
    "moe_wrapper": dict(moe=True, wrapper=True, tie_word_embeddings=False),
    "e_series": dict(moe=False, wrapper=False, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                     use_double_wide_mlp=True, attention_k_eq_v=False, attention_bias=True),
}


@pytest.fixture(scope="module")
def gemma4_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4")
    for i, (name, case) in enumerate(CASES.items()):
        build_tiny_gemma4(root / name, seed=21 + i, tokenizer_dir=tokenizer_dir, **case)
    return {name: root / name for name in CASES}


def hf_model(name: str, path: Path, dtype=torch.float32) -> torch.nn.Module:
    cls = HFGemma4ForConditionalGeneration if CASES[name]["wrapper"] else HFGemma4ForCausalLM
    hf = cls.from_pretrained(str(path), dtype=dtype, experts_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # run the full 64 tokens on both sides
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, gemma4_dirs) -> Loaded:
    path = gemma4_dirs[request.param]
    return load_case(request.param, path, hf_model(request.param, path), PREFILL_STEP)


def text_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)


# ---- the fixtures have the features they are about --------------------------------------------
def test_checkpoint_has_the_case_features(loaded):
    config = json.loads((loaded.path / "config.json").read_text())
    case = CASES[loaded.name]
    assert config["model_type"] == ("gemma4" if case["wrapper"] else "gemma4_text")
    s: Gemma4Settings = loaded.ours.settings
    assert s.sliding_window == WINDOW < min(GREEDY_PROMPT_LENS)
    full = [i for i, t in enumerate(s.layer_types) if t is LayerType.FULL]
    sliding = [i for i, t in enumerate(s.layer_types) if t is LayerType.SLIDING]
    assert full and sliding and s.final_logit_softcapping == 5.0
    hf_text = loaded.hf.model.language_model if case["wrapper"] else loaded.hf.model
    for i, layer in enumerate(loaded.ours.model.layers):  # per-layer shapes as transformers built them
        ref = hf_text.layers[i].self_attn
        assert layer.self_attn.head_dim == ref.head_dim == (32 if i in full else 16)
        assert (layer.self_attn.kv_source is not None) == ref.is_kv_shared_layer
    layers = loaded.ours.model.layers
    k_eq_v = case.get("attention_k_eq_v", True)
    owners = [i for i, layer in enumerate(layers) if layer.self_attn.kv_source is None]
    assert all(hasattr(layers[i].self_attn, "v_proj") != k_eq_v for i in full if i in owners)
    assert all(hasattr(layers[i].self_attn, "v_proj") for i in sliding if i in owners)
    assert s.enable_moe == case["moe"] == hasattr(layers[0], "experts")
    tied = loaded.ours.lm_head.weight.data_ptr() == loaded.ours.model.embed_tokens.weight.data_ptr()
    assert tied == case.get("tie_word_embeddings", True)
    scalars = torch.stack([layer.layer_scalar.detach() for layer in layers])
    assert (scalars - 1).abs().max() > 0.2  # randomised, so a skipped layer_scalar shows
    assert loaded.ours.kv_owner_layer(LayerType.FULL) == (2 if loaded.name == "e_series" else 5)
    assert loaded.ours.kv_owner_layer("sliding_attention") == (3 if loaded.name == "e_series" else 4)
    if loaded.name == "e_series":
        assert s.kv_sources == [None, None, None, None, 3, 2]  # [S, S, F, S | S, F] share from 3 (S) and 2 (F)
        assert s.mlp_sizes == [96] * 4 + [192] * 2 and s.per_layer_input_size == 8
    if case["wrapper"]:
        from safetensors import safe_open

        with safe_open(str(loaded.path / "model.safetensors"), "pt") as f:
            assert any(k.startswith("model.vision_tower.") for k in f.keys())  # present, and skipped


# ---- parity -------------------------------------------------------------------------------------
def test_logits_match_transformers(loaded):
    ids = random_ids(LOGITS_PROMPT_LEN, loaded.ours.vocab_size, seed=0)
    ref = hf_logits(loaded.hf, ids)
    got = our_logits(loaded.ours, ids)
    assert got.shape == ref.shape == (LOGITS_PROMPT_LEN, loaded.ours.vocab_size)
    torch.testing.assert_close(got, ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    for chunk in (1, 7, PREFILL_STEP):
        torch.testing.assert_close(our_logits(loaded.ours, ids, chunk), ref, atol=PASSES_ATOL, rtol=PASSES_RTOL,
                                   msg=lambda m: f"chunk {chunk}: {m}")


@pytest.mark.parametrize("prompt_len", GREEDY_PROMPT_LENS)
def test_greedy_matches_transformers(loaded, prompt_len):
    ids = random_ids(prompt_len, loaded.engine.tokenizer.vocab_size, seed=100 + prompt_len)
    with torch.inference_mode():
        ref = loaded.hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 pad_token_id=0)[0, prompt_len:].tolist()
    assert len(ref) == NEW_TOKENS
    result = loaded.engine.generate_all(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert result.token_ids == ref
    assert result.finish_reason.value == "length"


def test_bf16_logits_match_transformers(loaded):
    hf = hf_model(loaded.name, loaded.path, torch.bfloat16)
    ours = load_model(loaded.path, torch.bfloat16, torch.device("cpu"))
    ids = random_ids(LOGITS_PROMPT_LEN, ours.vocab_size, seed=0)
    got, ref = our_logits(ours, ids), hf_logits(hf, ids)
    assert got.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, atol=BF16_ATOL, rtol=BF16_RTOL)


# ---- the cache: commit / rollback after the window has slid --------------------------------------
PROMPT_LEN = 21  # > 2 windows, so the sliding layers' masks have moved on before the verify pass


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["sdpa", "in_place"])
def test_partial_commit_and_rollback_after_window_slid(loaded, decode_kernel):
    """After a prefill, a verify-like pass of T tokens is committed partially (commit(n), every n in
    1..T) and decoding goes on (a 3-token pass, two 1-token passes); then 4 rows are rolled back and
    decoding goes on again. Every logit row equals transformers' over the committed sequence alone.
    `in_place`: passes of <= 8 tokens write the cache at their positions and attend with the split-K
    kernel's torch reference (the CUDA path, shared-KV layers included)."""
    model, vocab = loaded.ours, loaded.ours.vocab_size
    prompt = random_ids(PROMPT_LEN, vocab, seed=10)
    verify = random_ids(5, vocab, seed=20)
    cont = random_ids(5, vocab, seed=30)
    again = random_ids(3, vocab, seed=40)
    ref_verify = hf_logits(loaded.hf, prompt + verify)[PROMPT_LEN:]
    for n in range(1, len(verify) + 1):
        cache = model.make_cache(64)
        cache.use_decode_kernel = decode_kernel
        run_passes(model, cache, prompt, [PREFILL_STEP, PROMPT_LEN - PREFILL_STEP])
        with torch.inference_mode():
            positions = torch.arange(PROMPT_LEN, PROMPT_LEN + len(verify))[None]
            logits = model.logits(model(torch.tensor([verify]), positions, cache).hidden)[0]
        torch.testing.assert_close(logits, ref_verify, atol=PASSES_ATOL, rtol=PASSES_RTOL)
        cache.commit(n)
        start = PROMPT_LEN + n
        got = run_passes(model, cache, cont, [3, 1, 1], start=start)
        committed = prompt + verify[:n] + cont
        ref = hf_logits(loaded.hf, committed)[start:]
        torch.testing.assert_close(got, ref, atol=PASSES_ATOL, rtol=PASSES_RTOL, msg=lambda m: f"commit({n}): {m}")
        cache.rollback(4)
        kept = committed[:-4]
        got = run_passes(model, cache, again, [2, 1], start=len(kept))
        ref = hf_logits(loaded.hf, kept + again)[len(kept):]
        torch.testing.assert_close(got, ref, atol=PASSES_ATOL, rtol=PASSES_RTOL, msg=lambda m: f"rollback after commit({n}): {m}")


# ---- routed experts ------------------------------------------------------------------------------
def test_experts_methods_agree(gemma4_dirs):
    """The grouped (CUDA-graph-safe) and gathered paths against the loop, on a real MoE layer's
    weights, and the grouped path against transformers' own grouped_mm experts."""
    hf = hf_model("moe_wrapper", gemma4_dirs["moe_wrapper"])
    ref_experts = hf.model.language_model.layers[1].experts
    ours = load_model(gemma4_dirs["moe_wrapper"], torch.float32, torch.device("cpu"))
    layer = ours.model.layers[1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, ours.hidden_size, generator=gen)
    assert moe.grouped_mm_usable(x, layer.experts.gate_up_proj.shape[1], layer.experts.down_proj.shape[-1])
    with torch.inference_mode():
        weights, index = layer.router(x)
        assert len(set(index.flatten().tolist())) == ours.settings.num_experts  # every expert has tokens
        results = {}
        for method in moe.ExpertsMethod:
            if method is moe.ExpertsMethod.GEMV:
                continue  # at most 16 tokens: tests/kernels/test_expert_gemv.py
            layer.experts.method = method
            results[method] = layer.experts(x, index, weights)
        layer.experts.method = None
        ref_experts.config._experts_implementation = "grouped_mm"
        hf_grouped = ref_experts(x, index, weights)
        ref_experts.config._experts_implementation = "eager"
        hf_eager = ref_experts(x, index, weights)
    loop = results[moe.ExpertsMethod.LOOP]
    torch.testing.assert_close(loop, hf_eager, atol=0, rtol=0)
    for method in (moe.ExpertsMethod.GROUPED, moe.ExpertsMethod.GATHERED):
        torch.testing.assert_close(results[method], loop, atol=EXPERTS_ATOL, rtol=EXPERTS_RTOL, msg=method.value)
    torch.testing.assert_close(results[moe.ExpertsMethod.GROUPED], hf_grouped, atol=EXPERTS_ATOL, rtol=EXPERTS_RTOL)


# ---- the CUDA fast path's rewrites, checked on CPU ---------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_merged_projections_same_outputs(gemma4_dirs, name):
    """fuse_small_ops(compile=False) merges q/k(/v) and gate/up into single GEMMs: the same logits,
    captured streams and pre-norm stream (float64)."""
    ours = load_model(gemma4_dirs[name], torch.float64, torch.device("cpu"))
    merged = load_model(gemma4_dirs[name], torch.float64, torch.device("cpu"))
    merged.fuse_small_ops(compile=False)
    merged.fuse_small_ops(compile=False)  # idempotent
    attn = merged.model.layers[0].self_attn
    assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
    ids = random_ids(30, ours.vocab_size, seed=4)
    outs = []
    for model in (ours, merged):
        with torch.inference_mode():
            out = model(torch.tensor([ids]), torch.arange(30)[None], model.make_cache(30), capture=(0, 3, 5))
        outs.append([model.logits(out.hidden), out.pre_norm, *out.aux])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_compiled_small_ops_match_eager(gemma4_dirs):
    """fuse_small_ops() also compiles the norms and RoPE (torch.compile; inductor on CPU here)."""
    eager = load_model(gemma4_dirs["e_series"], torch.float32, torch.device("cpu"))
    fast = load_model(gemma4_dirs["e_series"], torch.float32, torch.device("cpu"))
    fast.fuse_small_ops()
    assert fast.model.norm.impl is fused.compiled_rows(gemma_rms_norm)
    for ids in (random_ids(35, eager.vocab_size, seed=5), [44]):
        torch.testing.assert_close(our_logits(fast, ids), our_logits(eager, ids), atol=PASSES_ATOL, rtol=PASSES_RTOL)


# ---- features matter, configs are read as transformers reads them ------------------------------
FEATURES_OFF = {
    "sliding window": ("dense", {"sliding_window": 4096}),
    "softcapping": ("dense", {"final_logit_softcapping": None}),
    "proportional RoPE": ("dense", {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.0, "rope_theta": 1e6}}}),
    "top-k routing": ("moe_wrapper", {"top_k_experts": 1}),
}


@pytest.mark.parametrize("feature", list(FEATURES_OFF))
def test_feature_is_exercised(gemma4_dirs, feature):
    """With the feature switched off in our config (same weights), the logits move well past the
    tolerance: the prompts are long enough for the window, the softcap bites, and so on."""
    name, off = FEATURES_OFF[feature]
    ours = load_model(gemma4_dirs[name], torch.float32, torch.device("cpu"))
    config = copy.deepcopy(ours.config)
    text = config.get("text_config", config)
    text.update(off)
    plain = model_class(config["model_type"])(config)
    plain.load_state_dict(ours.state_dict())
    plain.tie_weights()
    ids = random_ids(LOGITS_PROMPT_LEN, ours.vocab_size, seed=0)
    diff = (our_logits(plain, ids) - our_logits(ours, ids)).abs().max().item()
    assert diff > FEATURE_EFFECT_MIN, f"{feature}: switching it off changed logits by only {diff}"


def test_released_config_format(gemma4_dirs, tmp_path):
    """Released checkpoints give the full layers' shape as global_head_dim / num_global_key_value_heads
    (transformers >= 5.17 saves `per_layer_config` instead): both read the same, here and there."""
    import shutil

    path = Path(shutil.copytree(gemma4_dirs["dense"], tmp_path / "released"))
    config = json.loads((path / "config.json").read_text())
    assert config.pop("per_layer_config") == {"2": {"head_dim": 32, "num_key_value_heads": 1},
                                              "5": {"head_dim": 32, "num_key_value_heads": 1}}
    config.update(global_head_dim=32, num_global_key_value_heads=1)
    (path / "config.json").write_text(json.dumps(config))
    ours = load_model(path, torch.float32, torch.device("cpu"))
    assert ours.settings.head_dims == [16, 16, 32, 16, 16, 32] and ours.settings.num_kv_heads == [2, 2, 1, 2, 2, 1]
    hf = HFGemma4ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = random_ids(40, ours.vocab_size, seed=2)
    torch.testing.assert_close(our_logits(ours, ids), hf_logits(hf, ids), atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


@pytest.mark.parametrize("change, message", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"per_layer_config": {"2": {"intermediate_size": 8}}}, "per_layer_config overrides intermediate_size"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "RoPE type 'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "per layer type"),
    ({"num_kv_shared_layers": 5}, "shares the K/V of an earlier full_attention layer"),
    ({"enable_moe_block": True, "num_experts": None}, "num_experts"),
    ({"layer_types": ["sliding_attention"] * 5 + ["chunked_attention"]}, "chunked_attention"),
])
def test_unsupported_configs_are_refused(gemma4_dirs, change, message):
    """What verispec cannot compute (yet) is refused by name, never silently computed otherwise."""
    config = json.loads((gemma4_dirs["dense"] / "config.json").read_text())
    config.update(change)
    with pytest.raises(UnsupportedModelError, match=message):
        model_class("gemma4_text")(config)


@pytest.mark.gpu
def test_cuda_bf16_graphs_match_eager(gemma4_dirs):
    """On CUDA (bf16): the engine with CUDA graphs, the split-K kernel and the grouped experts
    produces the same greedy ids as an eager engine without graphs (MoE and shared-KV models)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for name in ("moe_wrapper", "e_series"):
        path = str(gemma4_dirs[name])
        graphed = load_engine(path, dtype="bfloat16", device="cuda", prefill_step_size=PREFILL_STEP)
        eager = load_engine(path, dtype="bfloat16", device="cuda", prefill_step_size=PREFILL_STEP, cuda_graphs=False)
        assert graphed.use_graphs and not eager.use_graphs
        graphed.prewarm()
        ids = random_ids(50, graphed.model.vocab_size, seed=7)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        assert graphed.generate_all(ids, params).token_ids == eager.generate_all(ids, params).token_ids, name
