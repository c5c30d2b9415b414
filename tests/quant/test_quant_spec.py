"""Lossless on quantized targets: speculative greedy == plain greedy, token for token, with an
MLX 4-bit target (quantized embedding and head) and EAGLE3 / oracle proposers, a quantized
Qwen3.5 target speculating with its own (float) MTP head, and a quantized Gemma 4 target with
its (float) assistant drafter reading the target's cache and quantized embedding."""
from __future__ import annotations

import json

import pytest
import torch

from verispec.cli import main
from tools.tiny import (build_tiny_gemma4, build_tiny_gemma4_assistant, build_tiny_qwen3_5, random_mtp_head,
                                write_mtp_sidecar, write_random_eagle3)
from verispec.engine.engine import load_engine
from verispec.spec.gemma4_assistant import AssistantProposer, load_assistant
from verispec.spec.mtp import MtpProposer, load_mtp_head

from tests.quant.conftest import mlx_convert, quantized_modules, to_torch
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


def test_mtp_head_on_quantized_qwen3_5(tmp_path, tokenizer_dir):
    """`verispec quantize` copies the MTP sidecar as it is; the float head drafts for the 4-bit target."""
    src = tmp_path / "float"
    build_tiny_qwen3_5(src, seed=21, tokenizer_dir=tokenizer_dir)
    write_mtp_sidecar(src / "mtp.safetensors", random_mtp_head(json.loads((src / "config.json").read_text()), seed=5))
    assert main(["quantize", "-m", str(src), "--format", "mlx-4bit", "--group-size", "32",
                 "--out", str(tmp_path / "q4")]) == 0
    engine = load_engine(str(tmp_path / "q4"), dtype="float64", device="cpu", prefill_step_size=16)
    assert "model.layers.0.mlp.down_proj" in quantized_modules(engine.model)
    assert_mtp_lossless(engine, load_mtp_head(tmp_path / "q4", engine.model))


def assert_mtp_lossless(engine, head) -> None:
    """Speculative greedy with `head` == plain greedy, at 1 and 3 drafts per round."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    for k in (1, 3):
        spec = spec_engine(engine, MtpProposer(head), k)
        for ids in prompts:
            expected = engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids
            result = spec.generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == expected and result.stats.method == "mtp", f"k={k}"


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_quantized_mtp_sidecar_on_quantized_qwen3_5(tmp_path, tokenizer_dir):
    """An MLX 4-bit MTP sidecar (its linears packed by mx.quantize, the checkpoint's own
    `quantization` section) loads as quantized layers whose weights are mx.dequantize's, and the
    quantized head drafts losslessly for the 4-bit target."""
    import mlx.core as mx
    import numpy as np
    from safetensors.numpy import save_file

    from verispec.quant.layers.linear import MLXAffineLinear

    src = tmp_path / "float"
    build_tiny_qwen3_5(src, seed=23, tokenizer_dir=tokenizer_dir)
    head = random_mtp_head(json.loads((src / "config.json").read_text()), seed=6)
    assert main(["quantize", "-m", str(src), "--format", "mlx-4bit", "--group-size", "32",
                 "--out", str(tmp_path / "q4")]) == 0
    stored, expected = {}, {}
    for name, w in head.items():
        if name.endswith(".weight") and w.ndim == 2 and w.shape[1] % 32 == 0:  # the linears
            packed, scales, biases = mx.quantize(mx.array(w.float().numpy()), group_size=32, bits=4)
            base = name[:-len(".weight")]
            stored.update({name: np.array(packed), f"{base}.scales": np.array(scales), f"{base}.biases": np.array(biases)})
            expected[base] = to_torch(mx.dequantize(packed, scales, biases, group_size=32, bits=4))
        else:
            stored[name] = w.float().numpy()
    save_file(stored, str(tmp_path / "q4" / "mtp.safetensors"))
    engine = load_engine(str(tmp_path / "q4"), dtype="float64", device="cpu", prefill_step_size=16)
    quantized = load_mtp_head(tmp_path / "q4", engine.model)
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, MLXAffineLinear)}
    assert {f"mtp.{n}" for n in layers} == set(expected) and len(layers) >= 8
    for n, m in layers.items():
        assert torch.equal(m.dequantized_weight(torch.float32), expected[f"mtp.{n}"]), n
    assert_mtp_lossless(engine, quantized)


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_gemma4_assistant_on_quantized_gemma4(tmp_path, tokenizer_dir):
    src = tmp_path / "float"
    build_tiny_gemma4(src, seed=41, tokenizer_dir=tokenizer_dir)
    build_tiny_gemma4_assistant(tmp_path / "assistant", json.loads((src / "config.json").read_text()), seed=42)
    assert main(["quantize", "-m", str(src), "--format", "mlx-4bit", "--group-size", "32",
                 "--out", str(tmp_path / "q4")]) == 0
    engine = load_engine(str(tmp_path / "q4"), dtype="float64", device="cpu", prefill_step_size=16)
    assert "model.embed_tokens" in quantized_modules(engine.model)
    drafter = load_assistant(tmp_path / "assistant", engine.model)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    for k in (1, 2):
        spec = spec_engine(engine, AssistantProposer(drafter, engine.model, engine.num_real_tokens), k)
        for ids in prompts:
            expected = engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids
            result = spec.generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == expected and result.stats.method == "assistant", f"k={k}"
            assert result.stats.drafted > 0
