"""Speculative greedy == plain greedy on CUDA, token for token, in bfloat16 as in float32.

Llama and Qwen3 (q/k norm) targets, unquantized and MLX 8-/4-bit (`verispec quantize`: the GEMV,
the fragment-order kernel and, with a 2,048-wide MLP, the streaming MLP), CUDA graphs on. A verify
pass over k+1 tokens must give each row the bits a one-token decode step gives it, or bf16 near-ties
flip: every kernel on a generated token's path computes a row the same way whatever the pass's
width. Proposers: a random EAGLE3 drafter (rejections), replays of the plain output always right
(k = 3, 5) and wrong at every third slot (partial acceptance). Long prompts (8,150 tokens) cross
8,192 keys, where split-K attention's shares per row grow, during the generation.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.replay import KeyedReplay, first_divergence
from tools.tiny import build_tiny_model, corpus_text, write_random_eagle3
from verispec.cli import main as cli_main
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
NEW_TOKENS = 128
LONG_PROMPT_TOKENS = 8150  # + 128 new tokens crosses 8,192 keys (64 splits of 128-key blocks)
# 8 layers of 8 query / 2 kv heads; intermediate 2,048 (32 blocks of 64): whole steps of the 4-bit
# MLP's streaming kernel
SHAPE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=LONG_PROMPT_TOKENS + NEW_TOKENS + 64)
QUANTS = ["none", "mlx-8bit", "mlx-4bit"]
# (name, drafts a round)
PROPOSERS = [("eagle3-random", 3), ("replay-right", 3), ("replay-right", 5), ("replay-partial", 4)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict:
    """{(model type, quant): (target directory, random EAGLE3 drafter directory)}"""
    root = tmp_path_factory.mktemp("gpu-spec-identity")
    out = {}
    for model_type in ("llama", "qwen3"):
        target = root / model_type
        build_tiny_model(target, model_type, tokenizer_dir=tokenizer_dir, **SHAPE,
                         **({"head_dim": 64} if model_type == "qwen3" else {}))
        drafter = write_random_eagle3(root / f"{model_type}-eagle3", json.loads((target / "config.json").read_text()))
        out[(model_type, "none")] = (target, drafter)
        for quant in QUANTS[1:]:
            quantized = root / f"{model_type}-{quant}"
            assert cli_main(["quantize", "-m", str(target), "--format", quant, "--out", str(quantized)]) == 0
            out[(model_type, quant)] = (quantized, drafter)
    return out


def proposer_for(name: str, plain: Engine, drafter, continuations: dict):
    vocab = plain.model.vocab_size
    if name == "eagle3-random":
        return Eagle3Proposer(load_eagle3(drafter, plain.model), vocab)
    if name == "replay-right":
        return KeyedReplay(continuations, vocab)
    return KeyedReplay(continuations, vocab, wrong_at=lambda i: i % 3 == 0)


def check_identity(model_dir, drafter, dtype: str, prompts_of) -> None:
    """Every proposer's greedy output == the plain engine's on every prompt (prompts_of(tokenizer))."""
    plain = load_engine(str(model_dir), dtype=dtype, device=DEVICE, max_num_seqs=4, kv_cache_gb=0.5)
    plain.capture_graphs()
    prompts = prompts_of(plain.tokenizer)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    expected = {tuple(ids): plain.generate_all(ids, params).token_ids for ids in prompts}
    failures = []
    for name, k in PROPOSERS:
        spec = Engine(plain.model, plain.tokenizer, plain.config, plain.model_dir,
                      proposer=proposer_for(name, plain, drafter, expected), num_drafts=k)
        spec.capture_graphs()
        accepted = 0
        for i, ids in enumerate(prompts):
            result = spec.generate_all(ids, params)
            accepted += result.stats.accepted
            at = first_divergence(expected[tuple(ids)], result.token_ids)
            if at is not None:
                failures.append(f"{name} k={k} prompt {i}: first divergence at token {at}")
        if name == "replay-right":  # the replay really ran: everything it drafted was accepted
            assert accepted > 0, (name, k)
    assert not failures, failures


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_speculative_greedy_is_plain_greedy(checkpoints, model_type, quant, dtype):
    text = corpus_text()
    model_dir, drafter = checkpoints[(model_type, quant)]
    check_identity(model_dir, drafter, dtype,
                   lambda tokenizer: [tokenizer.encode(text[i * 997: i * 997 + 400]) for i in range(4)])


@pytest.mark.parametrize("quant", ["none", "mlx-4bit"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_identity_holds_across_the_split_k_share_boundary(checkpoints, model_type, quant):
    text = corpus_text()
    model_dir, drafter = checkpoints[(model_type, quant)]

    def prompts_of(tokenizer):
        prompts = [tokenizer.encode(text[i * 997: i * 997 + 12 * LONG_PROMPT_TOKENS])[:LONG_PROMPT_TOKENS]
                   for i in range(4)]
        assert all(len(p) == LONG_PROMPT_TOKENS for p in prompts), "corpus too short for the long prompts"
        return prompts

    check_identity(model_dir, drafter, "bfloat16", prompts_of)
