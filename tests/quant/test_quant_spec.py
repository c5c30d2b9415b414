"""Lossless on quantized targets: speculative greedy == plain greedy, token for token, with an
MLX 4-bit target (quantized embedding and head) and EAGLE3 / oracle proposers."""
from __future__ import annotations

import json

import pytest

from verispec.demo.tiny import write_random_eagle3
from verispec.engine.engine import load_engine

from tests.quant.conftest import mlx_convert, quantized_modules
from tests.spec.conftest import TARGET_SHAPE, PROMPTS, ReplayProposer, eagle3_proposer, greedy, spec_engine

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def quantized_target(tiny_models, tmp_path_factory):
    src = tiny_models.get("spec-quant-llama", "llama", **TARGET_SHAPE)
    path = mlx_convert(src, tmp_path_factory.mktemp("spec-quant") / "llama-4bit", q_bits=4, q_group_size=32)
    engine = load_engine(str(path), dtype="float64", device="cpu", prefill_step_size=16)
    assert "lm_head" in quantized_modules(engine.model)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    plain = [engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompts]
    return engine, prompts, plain


@pytest.mark.parametrize("k", [1, 3])
def test_oracle_proposers(quantized_target, k):
    engine, prompts, plain = quantized_target
    vocab = engine.model.vocab_size
    for ids, cont in zip(prompts, plain):
        right = spec_engine(engine, ReplayProposer(cont, vocab), k).generate_all(ids, greedy(NEW_TOKENS))
        assert right.token_ids == cont and right.stats.accepted == right.stats.drafted
        wrong = spec_engine(engine, ReplayProposer(cont, vocab, right_at=lambda j: False), k)
        result = wrong.generate_all(ids, greedy(NEW_TOKENS))
        assert result.token_ids == cont and result.stats.accepted == 0
        partial = spec_engine(engine, ReplayProposer(cont, vocab, right_at=lambda j: j % 3 != 1), k)
        assert partial.generate_all(ids, greedy(NEW_TOKENS)).token_ids == cont


def test_eagle3_drafter_on_quantized_target(quantized_target, tmp_path):
    engine, prompts, plain = quantized_target
    config = json.loads((engine.model_dir / "config.json").read_text())
    drafter_dir = write_random_eagle3(tmp_path / "eagle3", config, seed=1, with_embedding=False)
    proposer = eagle3_proposer(engine, drafter_dir)  # shares the target's quantized embedding
    for k in (1, 2, 4):
        spec = spec_engine(engine, proposer, k)
        for ids, cont in zip(prompts, plain):
            assert spec.generate_all(ids, greedy(NEW_TOKENS)).token_ids == cont, f"k={k}"
