"""Gemma 3 against Hugging Face transformers (the external oracle).

Tiny random checkpoints (`build_tiny_gemma3`: 5 sliding layers with an 8-token window then a full
one, RoPE base 100 on sliding and 1e4 with linear x4 on full layers, query_pre_attn_scalar 24 !=
head_dim 16, final logit softcapping 5, norm weights drawn in [-0.5, 0.5) since they apply as 1 + w)
are saved with `save_pretrained` and loaded from disk by both sides:
- `text`: model_type gemma3_text (oracle Gemma3ForCausalLM), tied lm_head;
- `wrapper`: model_type gemma3 (oracle Gemma3ForConditionalGeneration), text weights saved under
  language_model.model.* beside a vision tower to skip, untied lm_head, no softcapping
  (transformers' multimodal class never applies final_logit_softcapping; the released Gemma 3
  configs have it null, and verispec applies it whenever a config sets it, as the text class does).
Every prompt is longer than the sliding window and than one prefill chunk.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM
from transformers import Gemma3ForConditionalGeneration as HFGemma3ForConditionalGeneration

from tools.tiny import GEMMA3_TINY_TEXT, build_tiny_gemma3
from verispec.sampling.params import SamplingParams
from verispec.errors import UnsupportedModelError
from verispec.loading.model_loader import load_model
from verispec.models.gemma3 import LayerType
from verispec.models.registry import model_class

from tests.models.family_checks import Loaded, hf_logits, load_case, our_logits, random_ids, run_passes

# Measured max |verispec - transformers| over a 100-token prompt, float32, one thread: 0.0 (the same
# kernels in the same order). Real mistakes (a norm as w instead of 1 + w, head_dim^-0.5 as the
# scale, the wrong RoPE base) move the logits by > 1e-2 (test_feature_is_exercised).
LOGITS_ATOL = 1e-5
LOGITS_RTOL = 1e-5
# Passes of other sizes (1- and 7-token chunks, partial commits, the in-place decode path) run
# other matmul shapes: rounding only.
PASSES_ATOL = 1e-4
PASSES_RTOL = 1e-5
BF16_ATOL = 1e-5
BF16_RTOL = 1.6e-2
FEATURE_EFFECT_MIN = 1e-2

PREFILL_STEP = 16
NEW_TOKENS = 64
LOGITS_PROMPT_LEN = 100
GREEDY_PROMPT_LENS = (9, 50, 81)
WINDOW = GEMMA3_TINY_TEXT["sliding_window"]

CASES = {
    "text": dict(wrapper=False),
    "wrapper": dict(wrapper=True, tie_word_embeddings=False, final_logit_softcapping=None),
}


@pytest.fixture(scope="module")
def gemma3_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3")
    for i, (name, case) in enumerate(CASES.items()):
        build_tiny_gemma3(root / name, seed=41 + i, tokenizer_dir=tokenizer_dir, **case)
    return {name: root / name for name in CASES}


def hf_model(name: str, path: Path, dtype=torch.float32) -> torch.nn.Module:
    cls = HFGemma3ForConditionalGeneration if CASES[name]["wrapper"] else HFGemma3ForCausalLM
    hf = cls.from_pretrained(str(path), dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # run the full 64 tokens on both sides
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def loaded(request, gemma3_dirs) -> Loaded:
    path = gemma3_dirs[request.param]
    return load_case(request.param, path, hf_model(request.param, path), PREFILL_STEP)


def test_checkpoint_has_the_case_features(loaded):
    config = json.loads((loaded.path / "config.json").read_text())
    case = CASES[loaded.name]
    assert config["model_type"] == ("gemma3" if case["wrapper"] else "gemma3_text")
    s = loaded.ours.settings
    assert s.sliding_window == WINDOW < min(GREEDY_PROMPT_LENS)
    assert s.layer_types == [LayerType.SLIDING] * 5 + [LayerType.FULL]
    assert s.rope[LayerType.SLIDING]["rope_theta"] != s.rope[LayerType.FULL]["rope_theta"]
    assert s.query_pre_attn_scalar != s.head_dim
    assert s.final_logit_softcapping == (None if case["wrapper"] else 5.0)
    tied = loaded.ours.lm_head.weight.data_ptr() == loaded.ours.model.embed_tokens.weight.data_ptr()
    assert tied == case.get("tie_word_embeddings", True)
    if case["wrapper"]:
        from safetensors import safe_open

        with safe_open(str(loaded.path / "model.safetensors"), "pt") as f:
            assert any(k.startswith("vision_tower.") for k in f.keys())  # present, and skipped


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


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["sdpa", "in_place"])
def test_partial_commit_after_window_slid(loaded, decode_kernel):
    """A verify-like 5-token pass after a 21-token prompt (the window has slid), committed
    partially (commit(n), n in 1..5), then decoding goes on: every logit row equals transformers'
    over the committed sequence alone. `in_place`: the split-K kernel's torch reference."""
    model, vocab = loaded.ours, loaded.ours.vocab_size
    prompt, verify, cont = random_ids(21, vocab, seed=10), random_ids(5, vocab, seed=20), random_ids(4, vocab, seed=30)
    for n in range(1, len(verify) + 1):
        cache = model.make_cache(64)
        cache.use_decode_kernel = decode_kernel
        run_passes(model, cache, prompt, [PREFILL_STEP, len(prompt) - PREFILL_STEP])
        with torch.inference_mode():
            model(torch.tensor([verify]), torch.arange(len(prompt), len(prompt) + len(verify))[None], cache)
        cache.commit(n)
        start = len(prompt) + n
        got = run_passes(model, cache, cont, [3, 1], start=start)
        ref = hf_logits(loaded.hf, prompt + verify[:n] + cont)[start:]
        torch.testing.assert_close(got, ref, atol=PASSES_ATOL, rtol=PASSES_RTOL, msg=lambda m: f"commit({n}): {m}")


def test_merged_projections_same_outputs(gemma3_dirs):
    """fuse_small_ops(compile=False) merges q/k/v and gate/up into single GEMMs: same logits (float64)."""
    ours = load_model(gemma3_dirs["text"], torch.float64, torch.device("cpu"))
    merged = load_model(gemma3_dirs["text"], torch.float64, torch.device("cpu"))
    merged.fuse_small_ops(compile=False)
    assert merged.model.layers[0].self_attn.qkv_proj is not None
    ids = random_ids(30, ours.vocab_size, seed=4)
    torch.testing.assert_close(our_logits(merged, ids), our_logits(ours, ids), rtol=1e-12, atol=1e-12)


# ---- features matter, configs are read as transformers reads them ------------------------------
FEATURES_OFF = {
    "sliding window": {"sliding_window": 4096},
    "softcapping": {"final_logit_softcapping": None},
    "local RoPE base": {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                            "full_attention": GEMMA3_TINY_TEXT["rope_parameters"]["full_attention"]}},
    "query_pre_attn_scalar": {"query_pre_attn_scalar": 16},
}


@pytest.mark.parametrize("feature", list(FEATURES_OFF))
def test_feature_is_exercised(gemma3_dirs, feature):
    """With the feature switched off in our config (same weights), the logits move well past the
    tolerance: the prompts are long enough for the window, the softcap bites, and so on."""
    ours = load_model(gemma3_dirs["text"], torch.float32, torch.device("cpu"))
    config = copy.deepcopy(ours.config)
    config.update(FEATURES_OFF[feature])
    plain = model_class(config["model_type"])(config)
    plain.load_state_dict(ours.state_dict())
    plain.tie_weights()
    ids = random_ids(LOGITS_PROMPT_LEN, ours.vocab_size, seed=0)
    diff = (our_logits(plain, ids) - our_logits(ours, ids)).abs().max().item()
    assert diff > FEATURE_EFFECT_MIN, f"{feature}: switching it off changed logits by only {diff}"


def test_released_config_format(gemma3_dirs, tmp_path):
    """The released configs (transformers 4) give RoPE as rope_theta / rope_local_base_freq /
    rope_scaling and the layer pattern as sliding_window_pattern: read the same here and there."""
    path = Path(shutil.copytree(gemma3_dirs["text"], tmp_path / "released"))
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    del config["layer_types"], config["_sliding_window_pattern"]
    config.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling={"rope_type": "linear", "factor": 4.0},
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"], sliding_window_pattern=3)
    (path / "config.json").write_text(json.dumps(config))
    ours = load_model(path, torch.float32, torch.device("cpu"))
    assert ours.settings.layer_types == [LayerType.SLIDING, LayerType.SLIDING, LayerType.FULL] * 2
    hf = HFGemma3ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert hf.config.layer_types == [t.value for t in ours.settings.layer_types]
    ids = random_ids(40, ours.vocab_size, seed=2)
    torch.testing.assert_close(our_logits(ours, ids), hf_logits(hf, ids), atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "RoPE type 'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "per layer type"),
    ({"layer_types": ["sliding_attention"] * 5 + ["chunked_attention"]}, "chunked_attention"),
])
def test_unsupported_configs_are_refused(gemma3_dirs, change, message):
    config = json.loads((gemma3_dirs["text"] / "config.json").read_text())
    config.update(change)
    with pytest.raises(UnsupportedModelError, match=message):
        model_class("gemma3_text")(config)
