"""`verispec quantize`: what it writes is read by mlx-lm itself, decodes to the same weights
there as in verispec, and both generate the same greedy tokens."""
from __future__ import annotations

import json

import pytest
import torch

from verispec.cli import main
from verispec.loading.model_loader import load_model

from verispec.quant.layers.float_linear import Float8Linear, NVFP4Linear

from tests.quant.conftest import (PROMPT, TINY_SHAPE, decompressed_by_library, import_mlx, mlx_convert, mlx_greedy,
                                  mlx_tensors, quantized_modules, to_torch, verispec_greedy)


@pytest.fixture(scope="module")
def float_models(tiny_models):
    return {"qwen3": tiny_models.get("quant-qwen3", "qwen3", head_dim=32, **TINY_SHAPE),
            # rope_theta: see test_mlx_affine.mlx_checkpoints
            "qwen2-tied": tiny_models.get("quant-qwen2-tied", "qwen2", tie_word_embeddings=True, rope_theta=1e6,
                                          **TINY_SHAPE)}


@pytest.mark.parametrize("model,fmt,group", [("qwen3", "mlx-4bit", 64), ("qwen3", "mlx-8bit", 32),
                                             ("qwen2-tied", "mlx-4bit", 128)])
def test_mlx_lm_reads_what_we_write(float_models, tmp_path, capsys, model, fmt, group):
    mx = import_mlx()
    out = tmp_path / "out"
    assert main(["quantize", "-m", str(float_models[model]), "--format", fmt, "--out", str(out),
                 "--group-size", str(group)]) == 0
    assert "tensors quantized" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": group, "bits": int(fmt[4]), "mode": "affine"}
    ours = load_model(out, torch.float32, torch.device("cpu"))
    mlx_model, theirs = mlx_tensors(out)
    layers = quantized_modules(ours)
    assert "model.embed_tokens" in layers and "model.layers.1.mlp.down_proj" in layers
    for path, layer in layers.items():
        source = "model.embed_tokens" if path == "lm_head" and f"{path}.scales" not in theirs else path
        expected = to_torch(mx.dequantize(theirs[f"{source}.weight"], theirs[f"{source}.scales"],
                                          theirs[f"{source}.biases"], group_size=group, bits=layer.bits))
        torch.testing.assert_close(layer.dequantized_weight(torch.float32), expected, rtol=1e-6, atol=1e-7)
    tokens = verispec_greedy(out, 20)
    assert tokens == mlx_greedy(mlx_model, PROMPT, 20)


def test_same_weights_as_mlx_lm_convert_up_to_rounding(float_models, tmp_path):
    """Our round-to-nearest and mlx's pick grids differently in detail; the decoded weights must
    be as close to the float ones as mlx_lm.convert's."""
    ours_dir = tmp_path / "ours"
    main(["quantize", "-m", str(float_models["qwen3"]), "--format", "mlx-4bit", "--out", str(ours_dir)])
    theirs_dir = mlx_convert(float_models["qwen3"], tmp_path / "theirs", q_bits=4, q_group_size=64)
    reference = load_model(float_models["qwen3"], torch.float32, torch.device("cpu"))
    ours, theirs = (quantized_modules(load_model(d, torch.float32, torch.device("cpu"))) for d in (ours_dir, theirs_dir))
    assert ours.keys() == theirs.keys()
    for path in ours:
        w = reference.get_submodule(path).weight
        our_error = (ours[path].dequantized_weight(torch.float32) - w).norm()
        their_error = (theirs[path].dequantized_weight(torch.float32) - w).norm()
        assert our_error <= 1.05 * their_error, path


@pytest.mark.parametrize("fmt,layer_type,max_error", [("fp8", Float8Linear, 0.04), ("nvfp4", NVFP4Linear, 0.15)])
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_compressed_tensors_reads_what_we_write(float_models, tmp_path, fmt, layer_type, max_error):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install compressed-tensors)")
    out = tmp_path / fmt
    assert main(["quantize", "-m", str(float_models["qwen3"]), "--format", fmt, "--out", str(out)]) == 0
    ours = load_model(out, torch.float32, torch.device("cpu"))
    reference = load_model(float_models["qwen3"], torch.float32, torch.device("cpu"))
    theirs = decompressed_by_library(out)
    layers = {p: m for p, m in ours.named_modules() if isinstance(m, layer_type)}
    assert len(layers) == 7 * TINY_SHAPE["num_hidden_layers"] and isinstance(ours.lm_head, torch.nn.Linear)
    for path, layer in layers.items():
        expected = theirs.get_submodule(path).weight  # NVFP4: compressed-tensors decodes into bf16
        assert torch.equal(layer.dequantized_weight(expected.dtype), expected), path
        w = reference.get_submodule(path).weight
        assert float((layer.dequantized_weight(torch.float32) - w).norm() / w.norm()) < max_error, path


def test_refuses_bad_input(float_models, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "-m", str(float_models["qwen3"]), "--format", "gguf-q4", "--out", str(out)]) == 2
    assert "--format 'gguf-q4' is not supported (supported: mlx-4bit, mlx-8bit" in capsys.readouterr().err
    main(["quantize", "-m", str(float_models["qwen3"]), "--format", "mlx-4bit", "--out", str(out)])
    assert main(["quantize", "-m", str(float_models["qwen3"]), "--format", "mlx-4bit", "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["quantize", "-m", str(out), "--format", "mlx-8bit", "--out", str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert main(["quantize", "-m", str(float_models["qwen3"]), "--format", "fp8", "--group-size", "64",
                 "--out", str(tmp_path / "fp8")]) == 2
    assert "--group-size does not apply to --format fp8" in capsys.readouterr().err
