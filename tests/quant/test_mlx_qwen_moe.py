"""Quantized experts of the Qwen MoE families in mlx-lm's layout (`mlp.switch_mlp.{gate,up,down}_proj`,
the router `mlp.gate` at 8 bits): a tiny Qwen3-MoE converted by `mlx_lm.convert` (as the
mlx-community Qwen3-30B-A3B conversions are made), a tiny Qwen3.5-MoE in the releases' stacked
layout and a tiny Qwen3-MoE with one linear per expert (as transformers saves it) quantized by
`verispec quantize`, must decode the same greedy tokens as mlx-lm itself. Experts quantized one
linear per expert (compressed-tensors' layout) are refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tools.tiny import build_tiny_model, build_tiny_qwen3_5, stack_expert_tensors
from verispec.errors import UnsupportedModelError
from verispec.loading.model_loader import load_model
from verispec.models.registry import model_class
from verispec.quant import loading as quant_loading
from verispec.quant.layers.experts import MLXQuantizedExperts
from verispec.quant.layers.linear import MLXAffineLinear

from tests.quant.conftest import PROMPT, mlx_convert, mlx_greedy, mlx_tensors, verispec_greedy

QWEN3_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def qwen3_moe_float(tmp_path_factory, tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("qwen3-moe") / "float"
    build_tiny_model(out, "qwen3_moe", seed=3, tokenizer_dir=tokenizer_dir, **QWEN3_MOE)
    # mlx-lm reads the releases' config fields: transformers 5 saves num_local_experts and rope_parameters
    config = json.loads((out / "config.json").read_text())
    config.update(num_experts=config["num_local_experts"], rope_theta=config["rope_parameters"]["rope_theta"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_mlx_lm_conversion_of_qwen3_moe(qwen3_moe_float, tmp_path):
    out = mlx_convert(qwen3_moe_float, tmp_path / "4bit-g32", q_bits=4, q_group_size=32)
    model = load_model(out, torch.float32, torch.device("cpu"))
    for i, layer in enumerate(model.model.layers):
        if i in QWEN3_MOE["mlp_only_layers"]:
            assert isinstance(layer.mlp.gate_proj, MLXAffineLinear)
            continue
        assert isinstance(layer.mlp.experts, MLXQuantizedExperts) and layer.mlp.experts.switch_glu.up_proj.bits == 4
        assert isinstance(layer.mlp.gate, MLXAffineLinear) and layer.mlp.gate.bits == 8  # mlx-lm's router bits
    mlx_model, _ = mlx_tensors(out)
    assert verispec_greedy(out, 16) == mlx_greedy(mlx_model, PROMPT, 16)


def test_verispec_quantize_of_qwen3_5_moe_is_read_by_mlx_lm(tmp_path, tokenizer_dir):
    from safetensors import safe_open

    from verispec.cli import main

    src = tmp_path / "float"
    build_tiny_qwen3_5(src, moe=True, wrapper=True, seed=4, tokenizer_dir=tokenizer_dir, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64)
    stack_expert_tensors(src)
    assert main(["quantize", "-m", str(src), "--format", "mlx-8bit", "--group-size", "32",
                 "--out", str(tmp_path / "q8")]) == 0
    with safe_open(str(tmp_path / "q8" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.language_model.layers.0.mlp.switch_mlp.gate_proj.scales" in names
    model = load_model(tmp_path / "q8", torch.float32, torch.device("cpu"))
    assert all(isinstance(layer.mlp.experts, MLXQuantizedExperts) for layer in model.model.layers)
    mlx_model, _ = mlx_tensors(tmp_path / "q8")
    assert verispec_greedy(tmp_path / "q8", 16) == mlx_greedy(mlx_model, PROMPT, 16)


def test_verispec_quantize_stacks_per_expert_weights(qwen3_moe_float, tmp_path):
    """Per-expert float matrices are stacked at conversion, so the experts come out quantized in
    mlx-lm's switch_mlp layout rather than kept in float."""
    from safetensors import safe_open

    from verispec.cli import main

    out = tmp_path / "q4"
    assert main(["quantize", "-m", str(qwen3_moe_float), "--format", "mlx-4bit", "--group-size", "32",
                 "--out", str(out)]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_slice("model.layers.0.mlp.switch_mlp.up_proj.scales").get_shape()) == (8, 64, 2)
    assert not any(".experts." in n for n in names)
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer's MLP, quantized as before
    model = load_model(out, torch.float32, torch.device("cpu"))
    for i, layer in enumerate(model.model.layers):
        if i not in QWEN3_MOE["mlp_only_layers"]:
            assert isinstance(layer.mlp.experts, MLXQuantizedExperts) and layer.mlp.experts.switch_glu.down_proj.bits == 4
    mlx_model, _ = mlx_tensors(out)
    assert verispec_greedy(out, 16) == mlx_greedy(mlx_model, PROMPT, 16)


def test_expert_stacker_places_parts_and_returns_incomplete_ones():
    from verispec.quant.convert import meta_model
    from verispec.quant.expert_stacks import ExpertStacker

    config = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=2, num_experts_per_tok=1,
                  moe_intermediate_size=4)
    stacker = ExpertStacker(meta_model(config))
    prefix = "model.layers.0.mlp.experts"
    parts = {f"{prefix}.{e}.{proj}.weight": torch.full((4, 8), 10.0 * e + i) for e in range(2)
             for i, proj in enumerate(("gate_proj", "up_proj"))}
    assert stacker.add("model.norm.weight", "model.norm.weight", torch.ones(8)) is None
    done = [stacker.add(name, name, t) for name, t in parts.items()]
    assert done[:-1] == [[]] * 3 and [s.our_name for s in done[-1]] == [f"{prefix}.gate_up_proj"]
    stack = done[-1][0].tensor  # [E, 2I, H]: gate rows then up rows, per expert
    assert [stack[e, r, 0].item() for e in range(2) for r in (0, 4)] == [0.0, 1.0, 10.0, 11.0]
    down = f"{prefix}.0.down_proj.weight"
    assert stacker.add(down, down, torch.zeros(8, 4)) == []
    assert [name for name, _ in stacker.leftover()] == [down]


def test_per_expert_quantized_linears_are_refused(qwen3_moe_float):
    config = json.loads((qwen3_moe_float / "config.json").read_text())
    with torch.device("meta"):
        model = model_class("qwen3_moe")(config)
    name = "model.layers.0.mlp.experts.3.gate_proj"
    tensors = {f"{name}.{local}": quant_loading.CheckpointTensor(f"{name}.{local}", (64, 32))
               for local in ("weight_packed", "weight_scale")}
    with pytest.raises(UnsupportedModelError, match=r"experts\.3\.gate_proj: MoE experts quantized one linear"):
        quant_loading.quantized_sites(model, tensors, "weight_scale")
