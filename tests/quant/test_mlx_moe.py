"""Quantized MoE experts as mlx-lm writes them (Gemma 4 26B-A4B's layout at toy size): a tiny
transformers Gemma 4 with routed experts, converted by `mlx_lm.convert`; its expert stacks
(`experts.switch_glu.{gate,up,down}_proj`) must dequantize to exactly `mx.dequantize`'s weights and
the model must decode the same greedy tokens as mlx-lm itself, on every expert path."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tools.tiny import build_tiny_gemma4
from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams
from verispec.loading.model_loader import load_model
from verispec.quant.layers.experts import MLXQuantizedExperts

from tests.quant.conftest import PROMPT, import_mlx, mlx_convert, mlx_greedy, mlx_tensors, verispec_greedy


@pytest.fixture(scope="module")
def moe_float(tmp_path_factory, tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("gemma4-moe") / "float"
    build_tiny_gemma4(out, moe=True, tokenizer_dir=tokenizer_dir, moe_intermediate_size=64)
    # transformers 5 records the full-attention layers' head shape in per_layer_config; mlx-lm
    # reads global_head_dim / num_global_key_value_heads (and defaults them to the 31B's)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    full = next(iter(config["per_layer_config"].values()))
    config.update(global_head_dim=full["head_dim"], num_global_key_value_heads=full["num_key_value_heads"])
    config_path.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def moe_checkpoints(moe_float, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx-moe")
    return {"8bit-g32": mlx_convert(moe_float, root / "8bit-g32", q_bits=8, q_group_size=32),
            "4bit-g64": mlx_convert(moe_float, root / "4bit-g64", q_bits=4, q_group_size=64)}


@pytest.mark.parametrize("name", ["8bit-g32", "4bit-g64"])
def test_expert_stacks_equal_mx_dequantize(moe_checkpoints, name):
    mx = import_mlx()
    model = load_model(moe_checkpoints[name], torch.float32, torch.device("cpu"))
    _, theirs = mlx_tensors(moe_checkpoints[name])
    layers = model.model.layers
    for i, layer in enumerate(layers):
        assert isinstance(layer.experts, MLXQuantizedExperts)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stack = getattr(layer.experts.switch_glu, proj)
            key = f"model.layers.{i}.experts.switch_glu.{proj}"
            expected = mx.dequantize(theirs[f"{key}.weight"], theirs[f"{key}.scales"], theirs[f"{key}.biases"],
                                     group_size=stack.group_size, bits=stack.bits)
            ours = stack.dequantized(torch.arange(stack.num_experts), torch.float32)
            np.testing.assert_array_equal(ours.numpy(), np.array(expected), err_msg=f"{name} {key}")


@pytest.mark.parametrize("name", ["8bit-g32", "4bit-g64"])
def test_greedy_equals_mlx_lm(moe_checkpoints, name):
    ours = verispec_greedy(moe_checkpoints[name], 16)
    mlx_model, _ = mlx_tensors(moe_checkpoints[name])
    assert ours == mlx_greedy(mlx_model, PROMPT, 16)


def test_expert_paths_agree(moe_checkpoints):
    """The gathered path (static shapes, for small passes) against the per-expert loop."""
    model = load_model(moe_checkpoints["8bit-g32"], torch.float32, torch.device("cpu"))
    experts = model.model.layers[0].experts
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    index = torch.randint(0, experts.num_experts, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)
    experts.method = "loop"
    loop = experts(x, index, weights)
    experts.method = "gathered"
    torch.testing.assert_close(experts(x, index, weights), loop, rtol=1e-5, atol=1e-6)


def test_float_switch_glu_fills_the_fused_experts(moe_float, tmp_path):
    """mlx_lm.convert without quantizing (mlx-community's bf16 conversions): the float
    `switch_glu` stacks load into FusedExperts and decode as mlx-lm does."""
    import_mlx()
    from mlx_lm import convert

    from verispec.models.layers.moe import FusedExperts

    out = tmp_path / "float-mlx"
    convert(str(moe_float), str(out), dtype="float32")
    model = load_model(out, torch.float32, torch.device("cpu"))
    assert isinstance(model.model.layers[0].experts, FusedExperts)
    mlx_model, _ = mlx_tensors(out)
    assert verispec_greedy(out, 16) == mlx_greedy(mlx_model, PROMPT, 16)


def test_verispec_quantize_writes_experts_mlx_lm_reads(moe_float, tmp_path):
    from verispec.cli import main

    assert main(["quantize", "-m", str(moe_float), "--format", "mlx-8bit", "--group-size", "32",
                 "--out", str(tmp_path / "q8")]) == 0
    engine = load_engine(str(tmp_path / "q8"), dtype="float32", device="cpu", prefill_step_size=16)
    assert isinstance(engine.model.model.layers[0].experts, MLXQuantizedExperts)
    ours = engine.generate_all(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)).token_ids
    mlx_model, _ = mlx_tensors(tmp_path / "q8")
    assert ours == mlx_greedy(mlx_model, PROMPT, 16)


def test_in_memory_quantization_equals_the_written_checkpoint(moe_float, tmp_path):
    """`bench --quant` quantizes in place: the same experts as `verispec quantize` writes."""
    from verispec.cli import main
    from verispec.quant.in_memory import quantize_model_

    assert main(["quantize", "-m", str(moe_float), "--format", "mlx-4bit", "--group-size", "32",
                 "--out", str(tmp_path / "q4")]) == 0
    written = load_model(tmp_path / "q4", torch.float32, torch.device("cpu"))
    in_place = load_model(moe_float, torch.float32, torch.device("cpu"))
    quantize_model_(in_place, "mlx-4bit", group_size=32)
    for i, layer in enumerate(in_place.model.layers):
        assert isinstance(layer.experts, MLXQuantizedExperts)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            a = getattr(layer.experts.switch_glu, proj)
            b = getattr(written.model.layers[i].experts.switch_glu, proj)
            assert torch.equal(a.weight, b.weight) and torch.equal(a.scales, b.scales), (i, proj)
