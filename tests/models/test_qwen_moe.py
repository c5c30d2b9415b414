"""The Qwen MoE families against Hugging Face transformers, and lossless under speculation and batching.

Tiny random checkpoints saved with `save_pretrained` and loaded from disk by both sides:
- `qwen3_moe`: model_type qwen3_moe (oracle Qwen3MoeForCausalLM), 4 layers, layer 2 dense
  (`mlp_only_layers`), top-2 of 8 experts renormalised (`norm_topk_prob`), experts one linear each
  as transformers saves them;
- `qwen3_5_moe_text`: model_type qwen3_5_moe_text (oracle Qwen3_5MoeForCausalLM), the hybrid
  Gated DeltaNet stack with a routed + gated shared expert MLP in every layer, per-expert names;
- `qwen3_5_moe`: model_type qwen3_5_moe (oracle Qwen3_5MoeForConditionalGeneration), text under
  model.language_model.*, a vision tower to skip, tied lm_head, experts rewritten as the stacked
  tensors the Qwen3.5 / 3.6 releases ship (`mlp.experts.gate_up_proj`).
The oracles run transformers' eager experts (its default grouped_mm sums in another order).
Speculation and batching run in float64 (no argmax near-ties): always-right, always-wrong and
partly-right replays give the plain greedy tokens; a sequence inside a batch gives what it gives alone.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.engine.test_batch_identity import check_identical, proposers
from tests.spec.conftest import ReplayProposer, greedy, spec_engine
from tools.tiny import build_tiny_qwen3_5, random_mtp_head, stack_expert_tensors, write_mtp_sidecar
from verispec.engine.engine import load_engine
from verispec.errors import UnsupportedModelError
from verispec.loading.model_loader import load_model
from verispec.models.layers.moe import FusedExperts
from verispec.models.layers.sparse_moe import SparseMoeBlock
from verispec.models.registry import model_class
from verispec.spec.mtp import MtpProposer, load_mtp_head
from tests.models.family_checks import Loaded, hf_logits, load_case, our_logits, random_ids

# Measured max |verispec - transformers| over a 100-token prompt, float32, one thread: 0.0 for
# qwen3_moe (the same kernels in the same order); 3.4e-6 / 2.3e-6 for the hybrids, whose one-shot
# prefill runs the chunked Gated DeltaNet algorithm as transformers does (test_qwen3_5.py's bound).
LOGITS_ATOL = 2e-5
LOGITS_RTOL = 1e-5
# 16-token prefill chunks run the hybrids' token-by-token recurrence (test_qwen3_5.py's RECURRENT_ATOL).
CHUNKED_ATOL = 5e-4
CHUNKED_RTOL = 1e-4
# bfloat16 on both sides, routing weights rounded to bf16 where transformers rounds them; torch's
# default bf16 tolerance allows another kernel order.
BF16_ATOL = 1e-5
BF16_RTOL = 1.6e-2
FEATURE_EFFECT_MIN = 1e-2

PREFILL_STEP = 16
NEW_TOKENS = 64
SPEC_TOKENS = 32  # speculation and batching: enough rounds for every acceptance pattern
LOGITS_PROMPT_LEN = 100
GREEDY_PROMPT_LENS = (9, 50)

QWEN3_MOE = dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2])
HF_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
              "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
CASES = list(HF_CLASSES)


@pytest.fixture(scope="module")
def moe_dirs(tiny_models, tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen_moe")
    dirs = {"qwen3_moe": tiny_models.get("qwen3_moe", "qwen3_moe", **QWEN3_MOE)}
    build_tiny_qwen3_5(root / "qwen3_5_moe_text", moe=True, seed=31, tokenizer_dir=tokenizer_dir)
    build_tiny_qwen3_5(root / "qwen3_5_moe", moe=True, wrapper=True, seed=32, tokenizer_dir=tokenizer_dir,
                       tie_word_embeddings=True)
    stack_expert_tensors(root / "qwen3_5_moe")
    dirs.update({name: root / name for name in ("qwen3_5_moe_text", "qwen3_5_moe")})
    return dirs


def hf_model(name: str, path: Path, dtype=torch.float32) -> torch.nn.Module:
    cls = getattr(transformers, HF_CLASSES[name])
    hf = cls.from_pretrained(str(path), dtype=dtype, experts_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # run all the new tokens on both sides
    return hf


@pytest.fixture(scope="module", params=CASES)
def loaded(request, moe_dirs) -> Loaded:
    path = moe_dirs[request.param]
    return load_case(request.param, path, hf_model(request.param, path), PREFILL_STEP)


def hf_text_model(loaded: Loaded):
    return loaded.hf.model.language_model if loaded.name == "qwen3_5_moe" else loaded.hf.model


# ---- layout --------------------------------------------------------------------------------------
def test_layout_matches_transformers(loaded):
    """Sparse layers where transformers put them, expert stacks equal to its parameters (loaded from
    per-expert or stacked checkpoint names), the checkpoint in the form the case is about."""
    from safetensors import safe_open

    with safe_open(str(loaded.path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    stacked = loaded.name == "qwen3_5_moe"
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names) == stacked
    assert any(n.endswith("mlp.experts.0.gate_proj.weight") for n in names) != stacked
    for ours, ref in zip(loaded.ours.model.layers, hf_text_model(loaded).layers, strict=True):
        sparse = hasattr(ref.mlp, "experts")
        assert isinstance(ours.mlp, SparseMoeBlock) == sparse
        if sparse:
            assert torch.equal(ours.mlp.experts.gate_up_proj, ref.mlp.experts.gate_up_proj)
            assert torch.equal(ours.mlp.experts.down_proj, ref.mlp.experts.down_proj)
            assert (ours.mlp.shared_expert is not None) == hasattr(ref.mlp, "shared_expert")
    sparse_layers = [isinstance(layer.mlp, SparseMoeBlock) for layer in loaded.ours.model.layers]
    assert sparse_layers == ([True, True, False, True] if loaded.name == "qwen3_moe" else [True] * 4)


@pytest.mark.parametrize("step, dense, expected", [(1, [], [0, 1, 2, 3, 4, 5]), (2, [], [1, 3, 5]),
                                                   (2, [3], [1, 5]), (3, [0, 5], [2])])
def test_sparse_layers_as_transformers_picks_them(step, dense, expected):
    """decoder_sparse_step and mlp_only_layers, against transformers' own layer construction."""
    config = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=6,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=8, decoder_sparse_step=step,
                                         mlp_only_layers=dense)
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(config)
        ours = model_class("qwen3_moe")(config.to_dict())
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")] == expected
    assert sorted(ours.settings.sparse_layers) == expected


# ---- parity with transformers ---------------------------------------------------------------------
def test_logits_match_transformers(loaded):
    ids = random_ids(LOGITS_PROMPT_LEN, loaded.ours.vocab_size, seed=0)
    ref = hf_logits(loaded.hf, ids)
    got = our_logits(loaded.ours, ids)
    assert got.shape == ref.shape == (LOGITS_PROMPT_LEN, loaded.ours.vocab_size)
    torch.testing.assert_close(got, ref, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    torch.testing.assert_close(our_logits(loaded.ours, ids, PREFILL_STEP), ref, atol=CHUNKED_ATOL, rtol=CHUNKED_RTOL)


@pytest.mark.parametrize("prompt_len", GREEDY_PROMPT_LENS)
def test_greedy_matches_transformers(loaded, prompt_len):
    ids = random_ids(prompt_len, loaded.engine.tokenizer.vocab_size, seed=100 + prompt_len)
    with torch.inference_mode():
        ref = loaded.hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 pad_token_id=0)[0, prompt_len:].tolist()
    assert len(ref) == NEW_TOKENS
    assert loaded.engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids == ref


def test_bf16_logits_match_transformers(loaded):
    hf = hf_model(loaded.name, loaded.path, torch.bfloat16)
    ours = load_model(loaded.path, torch.bfloat16, torch.device("cpu"))
    ids = random_ids(LOGITS_PROMPT_LEN, ours.vocab_size, seed=0)
    got, ref = our_logits(ours, ids), hf_logits(hf, ids)
    assert got.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, atol=BF16_ATOL, rtol=BF16_RTOL)


FEATURES_OFF = {
    "top-k routing": ("qwen3_5_moe_text", {"num_experts_per_tok": 1}),
    "norm_topk_prob": ("qwen3_moe", {"norm_topk_prob": False}),
}


@pytest.mark.parametrize("feature", list(FEATURES_OFF))
def test_feature_is_exercised(moe_dirs, feature):
    """Switched off in our config (same weights), the logits move well past the tolerances."""
    name, off = FEATURES_OFF[feature]
    ours = load_model(moe_dirs[name], torch.float32, torch.device("cpu"))
    config = copy.deepcopy(ours.config)
    config.get("text_config", config).update(off)
    plain = model_class(config["model_type"])(config)
    plain.load_state_dict(ours.state_dict())
    plain.tie_weights()
    ids = random_ids(LOGITS_PROMPT_LEN, ours.vocab_size, seed=0)
    diff = (our_logits(plain, ids) - our_logits(ours, ids)).abs().max().item()
    assert diff > FEATURE_EFFECT_MIN, f"{feature}: switching it off changed logits by only {diff}"


def test_bad_routing_config_is_refused(moe_dirs):
    config = json.loads((moe_dirs["qwen3_moe"] / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok 9"):
        model_class("qwen3_moe")(config)


# ---- lossless: speculation and batching (float64) -----------------------------------------------
PROMPTS = ["def fibonacci(n):", "import collections\n\nclass Counter(dict):\n    def __init__(self):", "x"]


@pytest.fixture(scope="module", params=CASES)
def plain(request, moe_dirs):
    engine = load_engine(str(moe_dirs[request.param]), dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outputs = [engine.generate_all(ids, greedy(SPEC_TOKENS)).token_ids for ids in prompts]
    return request.param, engine, prompts, outputs


@pytest.mark.parametrize("pattern", ["always-right", "always-wrong", "every-third-wrong"])
def test_speculation_equals_plain(plain, pattern):
    name, engine, prompts, outputs = plain
    right_at = {"always-right": lambda j: True, "always-wrong": lambda j: False,
                "every-third-wrong": lambda j: j % 3 != 2}[pattern]
    for i, ids in enumerate(prompts):
        proposer = ReplayProposer(outputs[i], engine.model.vocab_size, right_at=right_at)
        result = spec_engine(engine, proposer, 3).generate_all(ids, greedy(SPEC_TOKENS))
        assert result.token_ids == outputs[i], f"{name} {pattern} prompt {i}"
        if pattern == "always-right":
            assert result.stats.accepted == result.stats.drafted > 0
        elif pattern == "always-wrong":
            assert result.stats.accepted == 0


@pytest.mark.parametrize("proposer", ["plain", "right", "wrong"])
def test_sequence_alone_equals_inside_a_batch(plain, proposer):
    """check_identical (tests/engine): mixed requests at once, one cancelled, against each alone;
    plain and with always-right / always-wrong replays."""
    name, engine, prompts, _ = plain
    if proposer != "plain":
        engine = spec_engine(engine, proposers(engine, prompts)[proposer], 3)
    check_identical(engine, prompts, f"{name} {proposer}")


# ---- the MTP head of the Qwen3.5 / 3.6 MoE models -------------------------------------------------
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-expert"])
def test_mtp_head_with_moe_mlp_is_lossless(moe_dirs, tmp_path, stacked):
    """A random MoE MTP head (router, experts, gated shared expert) in a sidecar: its experts load
    from either naming, and --mtp greedy equals plain greedy at depths 1 and 3."""
    import shutil

    path = Path(shutil.copytree(moe_dirs["qwen3_5_moe_text"], tmp_path / "target"))
    text_config = json.loads((path / "config.json").read_text())
    head_tensors = random_mtp_head(text_config, seed=7, stacked_experts=stacked)
    write_mtp_sidecar(path / "mtp.safetensors", head_tensors)
    base = load_engine(str(path), dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP)
    head = load_mtp_head(path, base.model)
    moe_mlp = head.layers[0].mlp
    assert isinstance(moe_mlp, SparseMoeBlock) and isinstance(moe_mlp.experts, FusedExperts)
    e, inter = text_config["num_experts"], text_config["moe_intermediate_size"]
    expected_up = (head_tensors["mtp.layers.0.mlp.experts.gate_up_proj"][e - 1, inter:] if stacked
                   else head_tensors[f"mtp.layers.0.mlp.experts.{e - 1}.up_proj.weight"])
    assert torch.equal(moe_mlp.experts.gate_up_proj[e - 1, inter:], expected_up.double())
    ids = base.tokenizer.encode(PROMPTS[1])
    expected = base.generate_all(ids, greedy(SPEC_TOKENS)).token_ids
    for depth in (1, 3):
        spec = load_engine(str(path), dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP, mtp=True,
                           num_draft_tokens=depth)
        assert isinstance(spec.proposer, MtpProposer)
        result = spec.generate_all(ids, greedy(SPEC_TOKENS))
        assert result.token_ids == expected and result.stats.method == "mtp" and result.stats.drafted > 0
