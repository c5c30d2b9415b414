"""Llama-family parity against Hugging Face transformers (the external oracle).

Each case is a tiny random checkpoint saved with `save_pretrained`; verispec loads it from disk,
and so does transformers. We compare float32 logits over a whole prompt, greedy token ids for
64 new tokens over several prompts (through the engine, with chunked prefill), and chunked vs
one-shot prefill.
"""
from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from verispec.sampling.params import SamplingParams
from verispec.loading.model_loader import load_model
from verispec.models.registry import model_class
from tests.models.family_checks import Loaded, hf_logits, load_case, our_logits, random_ids

# Measured max |verispec - transformers| over a 100-token prompt is 0.0 for every case below
# (both sides run the same float32 kernels in the same order). The tolerance leaves room for a
# different BLAS/SDPA path, yet sits far below what any real mistake produces (>= 1e-2, see
# test_feature_is_exercised).
LOGITS_ATOL = 1e-5
LOGITS_RTOL = 1e-5
# Chunked vs one-shot prefill runs different matmul shapes, so bits may differ; measured <= 2.6e-6.
CHUNKED_ATOL = 2e-5
CHUNKED_RTOL = 1e-5
# bfloat16: measured difference 0.0 as well; torch's default bf16 tolerance (about 3 bf16 ulps at the
# logits' magnitude of ~3) allows another kernel order without hiding real mistakes.
BF16_ATOL = 1e-5
BF16_RTOL = 1.6e-2
# A feature switched off must move the logits by far more than the tolerance above.
FEATURE_EFFECT_MIN = 1e-2

PREFILL_STEP = 16
NEW_TOKENS = 64
LOGITS_PROMPT_LEN = 100  # > 64 (llama3 original_max_position_embeddings) and > the 16-token window
GREEDY_PROMPT_LENS = (9, 50, 81)  # shorter than, ~3x and ~5x the prefill chunk

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@dataclass(frozen=True)
class Case:
    model_type: str
    overrides: dict
    # config changes that switch the case's feature off (None: the feature has no config switch)
    feature_off: dict | None = None


CASES = {
    "llama_gqa": Case("llama", {}),
    "llama_mha_tied": Case("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama_bias": Case("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3_rope": Case("llama", {"rope_scaling": LLAMA3_ROPE},
                        feature_off={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                     "rope_scaling": None}),
    "linear_rope": Case("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                        feature_off={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                     "rope_scaling": None}),
    "qwen2_bias": Case("qwen2", {"rope_theta": 1e6},  # q/k/v bias; also a non-default rope_theta
                       feature_off={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # layer 0 full attention, layer 1 a 16-token window (Qwen2's use_sliding_window/max_window_layers)
    "qwen2_window": Case("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
                         feature_off={"layer_types": None, "use_sliding_window": False}),
    "qwen2_tied": Case("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen3_qk_norm": Case("qwen3", {}),
    # head_dim != hidden_size / num_heads, as in the real Qwen3 checkpoints
    "qwen3_wide_head": Case("qwen3", {"head_dim": 32}),
    "qwen3_tied": Case("qwen3", {"tie_word_embeddings": True}),
    "mistral_window": Case("mistral", {"sliding_window": 16}, feature_off={"sliding_window": None}),
}


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, tiny_models) -> Loaded:
    case = CASES[request.param]
    path = tiny_models.get(request.param, case.model_type, **case.overrides)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run the full 64 tokens on both sides
    return load_case(request.param, path, hf, PREFILL_STEP)


def test_config_matches_case(loaded):
    """Guards the fixture: the saved checkpoint really has the feature the case is about."""
    config = json.loads((loaded.path / "config.json").read_text())
    s = loaded.ours.settings
    assert s.num_kv_heads == config["num_key_value_heads"]
    assert s.tie_word_embeddings == config["tie_word_embeddings"]
    tied = loaded.ours.lm_head.weight.data_ptr() == loaded.ours.model.embed_tokens.weight.data_ptr()
    assert tied == config["tie_word_embeddings"]
    if config["model_type"] == "mistral" and config.get("sliding_window"):
        assert s.windows == [config["sliding_window"]] * s.num_layers
    if "layer_types" in config:
        assert s.windows == [config["sliding_window"] if t == "sliding_attention" else None
                             for t in config["layer_types"]]
    assert s.head_dim == loaded.hf.model.layers[0].self_attn.head_dim


def test_logits_match_transformers(loaded):
    vocab = loaded.ours.vocab_size
    ids = random_ids(LOGITS_PROMPT_LEN, vocab, seed=0)
    ref = hf_logits(loaded.hf, ids)
    got = our_logits(loaded.ours, ids)
    assert got.shape == ref.shape == (LOGITS_PROMPT_LEN, vocab)
    torch.testing.assert_close(got, ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_bf16_logits_match_transformers(loaded):
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=torch.bfloat16).eval()
    ours = load_model(loaded.path, torch.bfloat16, torch.device("cpu"))
    ids = random_ids(LOGITS_PROMPT_LEN, ours.vocab_size, seed=0)
    got, ref = our_logits(ours, ids), hf_logits(hf, ids)
    assert got.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, atol=BF16_ATOL, rtol=BF16_RTOL)


def test_chunked_prefill_matches_one_shot(loaded):
    ids = random_ids(53, loaded.ours.vocab_size, seed=1)
    one_shot = our_logits(loaded.ours, ids)
    for chunk in (1, 7, PREFILL_STEP):
        torch.testing.assert_close(our_logits(loaded.ours, ids, chunk), one_shot,
                                   atol=CHUNKED_ATOL, rtol=CHUNKED_RTOL)


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


def test_window_config_without_layer_types(tiny_models, tmp_path):
    """transformers v4 checkpoints have no `layer_types`: the window layers come from
    use_sliding_window + max_window_layers, for us and for transformers alike."""
    case = CASES["qwen2_window"]
    src = tiny_models.get("qwen2_window", case.model_type, **case.overrides)
    path = Path(shutil.copytree(src, tmp_path / "v4"))
    config = json.loads((path / "config.json").read_text())
    assert config.pop("layer_types") == ["full_attention", "sliding_attention"]
    (path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = load_model(path, torch.float32, torch.device("cpu"))
    assert ours.settings.windows == [None, 16]
    ids = random_ids(LOGITS_PROMPT_LEN, ours.vocab_size, seed=0)
    torch.testing.assert_close(our_logits(ours, ids), hf_logits(hf, ids), atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


FEATURE_CASES = [name for name, case in CASES.items() if case.feature_off]


@pytest.mark.parametrize("name", FEATURE_CASES)
def test_feature_is_exercised(tiny_models, name):
    """The prompt is long enough for the feature to matter: with the feature switched off in our
    config (same weights), the logits move well past the tolerance. Without this, a feature that
    is silently ignored could still pass the parity test."""
    case = CASES[name]
    path = tiny_models.get(name, case.model_type, **case.overrides)
    ours = load_model(path, torch.float32, torch.device("cpu"))
    config = copy.deepcopy(ours.config)
    config.update(case.feature_off)
    plain = model_class(config["model_type"])(config)
    plain.load_state_dict(ours.state_dict())
    ids = random_ids(LOGITS_PROMPT_LEN, ours.vocab_size, seed=0)
    diff = (our_logits(plain, ids) - our_logits(ours, ids)).abs().max().item()
    assert diff > FEATURE_EFFECT_MIN, f"{name}: switching the feature off changed logits by only {diff}"
