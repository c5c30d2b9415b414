"""EAGLE3 speculation on a Gemma 3 target: lossless (speculative greedy == plain greedy, float64),
and the drafter fed the right target features.

Targets (`build_tiny_gemma3`): `text` (gemma3_text, tied) and `wrapper` (gemma3, text weights
under language_model.model.*, untied). Both have an 8-token sliding window on 5 of 6 layers, so
every verify pass past the first few tokens rolls back K/V rows of layers whose window has slid.
EAGLE3 aux id k is the residual stream entering target layer k: transformers' `hidden_states[k]`
(index 0 = the sqrt(H)-scaled embeddings).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM
from transformers import Gemma3ForConditionalGeneration as HFGemma3ForConditionalGeneration

from tools.tiny import build_tiny_gemma3, write_random_eagle3
from verispec.engine.engine import load_engine
from verispec.loading.model_loader import load_model
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3

from tests.spec.conftest import PROMPTS, ReplayProposer, greedy, spec_engine

NEW_TOKENS = 64
TARGETS = {
    "text": dict(wrapper=False),
    "wrapper": dict(wrapper=True, tie_word_embeddings=False),
}
# float32 on both sides: measured 0.0 between ForwardOutput.aux and transformers' hidden_states.
AUX_ATOL = 1e-5
AUX_RTOL = 1e-5


@pytest.fixture(scope="module")
def gemma3_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3-spec")
    for i, (name, case) in enumerate(TARGETS.items()):
        build_tiny_gemma3(root / name, seed=51 + i, tokenizer_dir=tokenizer_dir, **case)
    return {name: root / name for name in TARGETS}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, gemma3_dirs):
    """(name, float64 engine, prompt ids, plain greedy continuations)."""
    engine = load_engine(str(gemma3_dirs[request.param]), dtype="float64", device="cpu", prefill_step_size=16)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 16  # one prompt spans several prefill chunks
    plain = [engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompts]
    return request.param, engine, prompts, plain


def text_config(engine) -> dict:
    config = json.loads((engine.model_dir / "config.json").read_text())
    return config.get("text_config", config)


@pytest.mark.parametrize("name", list(TARGETS))
def test_aux_features_are_transformers_hidden_states(gemma3_dirs, name):
    path = gemma3_dirs[name]
    cls = HFGemma3ForConditionalGeneration if TARGETS[name]["wrapper"] else HFGemma3ForCausalLM
    hf = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = load_model(path, torch.float32, torch.device("cpu"))
    n = ours.num_layers
    ids = torch.randint(0, ours.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = hf(ids, output_hidden_states=True).hidden_states
        out = ours(ids, torch.arange(30)[None], ours.make_cache(30), tuple(range(n)))
    torch.testing.assert_close(out.aux[0], ours.embed(ids), atol=0, rtol=0)  # the scaled embeddings
    for k in range(n):
        torch.testing.assert_close(out.aux[k], ref[k], atol=AUX_ATOL, rtol=AUX_RTOL, msg=lambda m: f"aux {k}: {m}")
    torch.testing.assert_close(out.hidden, ref[n], atol=AUX_ATOL, rtol=AUX_RTOL)


def test_eagle3_random_drafter_identity(target, tmp_path):
    """Random drafters, one with its own embedding and full draft vocabulary, one sharing the
    target's (unscaled) embedding with every 3rd id (non-trivial d2t offsets) and a qwen3 layer."""
    _, engine, prompts, plain = target
    cfg = text_config(engine)
    drafters = [
        write_random_eagle3(tmp_path / "full", cfg, seed=1, aux_layer_ids=[1, 2, 4]),
        write_random_eagle3(tmp_path / "offset", cfg, seed=2, d2t_offset_stride=3, with_embedding=False,
                            layer_type="qwen3", norm_before_residual=False),
    ]
    for drafter_dir in drafters:
        drafter = load_eagle3(drafter_dir, engine.model)
        proposer = Eagle3Proposer(drafter, engine.model.vocab_size)
        for k in range(1, 5):
            spec = spec_engine(engine, proposer, k)
            for i, ids in enumerate(prompts):
                result = spec.generate_all(ids, greedy(NEW_TOKENS))
                assert result.token_ids == plain[i], f"{drafter_dir.name} k={k} prompt {i}"
                assert result.stats.method == "eagle3" and result.stats.drafted > 0


@pytest.mark.parametrize("k", [1, 3])
def test_always_right_and_partly_right_proposers(target, k):
    """All k drafts accepted each round, then rejections at every depth of the chain."""
    _, engine, prompts, plain = target
    for i, ids in enumerate(prompts):
        result = spec_engine(engine, ReplayProposer(plain[i], engine.model.vocab_size), k).generate_all(
            ids, greedy(NEW_TOKENS))
        assert result.token_ids == plain[i] and result.stats.accepted == result.stats.drafted
        for reject_at in range(k + 2):
            proposer = ReplayProposer(plain[i], engine.model.vocab_size, right_at=lambda j: j % (k + 2) != reject_at)
            result = spec_engine(engine, proposer, k).generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == plain[i], f"reject_at={reject_at} prompt {i}"
            assert 0 < result.stats.accepted < result.stats.drafted
