"""NVFP4 against reference implementations of the format on the CPU: MLX's own nvfp4 mode
(mx.quantize / mx.dequantize) for the E2M1 / E4M3 decoding, and compressed-tensors' NVFP4A16
checkpoints (written and decompressed by that library). The modelopt layout is the same bits
under modelopt's names, with weight_scale_2 = 1 / compressed-tensors' global scale."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from verispec.errors import UnsupportedModelError
from verispec.loading.model_loader import load_model
from verispec.quant.layers.float_linear import NVFP4Linear
from verispec.quant import nvfp4

from tests.quant.conftest import PROMPT, TINY_SHAPE, ct_quantize, decompressed_by_library, import_mlx, to_torch, verispec_greedy

pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")


def test_e2m1_table_matches_the_spec():
    """sign | exponent (2 bits) | mantissa (1 bit), bias 1; exponent 0 is subnormal (m * 0.5)."""
    for code in range(16):
        sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
        magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa * 0.5) * 2.0 ** (exponent - 1)
        assert nvfp4.E2M1_VALUES[code] == (-magnitude if sign else magnitude)


@pytest.mark.parametrize("global_scale", [1.0, 0.0123])
def test_dequantize_equals_mlx_nvfp4(global_scale):
    """MLX packs 8 E2M1 codes per uint32 little-endian (= 2 per byte, low nibble first) and keeps
    E4M3 scales as uint8: the same bits modelopt stores as uint8 [N, K/2] and float8 [N, K/16]."""
    mx = import_mlx()
    w = mx.random.normal((32, 256), key=mx.random.key(3))
    words, scales = mx.quantize(w, group_size=16, bits=4, mode="nvfp4")
    expected = to_torch(mx.dequantize(words, scales, group_size=16, bits=4, mode="nvfp4", dtype=mx.float32))
    packed = torch.from_numpy(np.array(words).view(np.uint8).copy())
    block_scales = torch.from_numpy(np.array(scales).copy())
    ours = nvfp4.dequantize(packed, block_scales, torch.tensor(global_scale), divide_by_global=False)
    torch.testing.assert_close(ours, expected * global_scale, rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def nvfp4_checkpoints(tiny_models, tmp_path_factory) -> dict[str, Path]:
    src = tiny_models.get("quant-qwen3", "qwen3", head_dim=32, **TINY_SHAPE)
    root = tmp_path_factory.mktemp("nvfp4")
    ct = ct_quantize(src, root / "ct-nvfp4a16", preset="NVFP4A16")
    return {"compressed-tensors": ct, "modelopt": as_modelopt(ct, root / "modelopt")}


def as_modelopt(ct_dir: Path, out: Path, algo: str = "NVFP4") -> Path:
    """The compressed-tensors checkpoint under modelopt's names and hf_quant_config.json."""
    out.mkdir()
    tensors = {}
    for name, t in load_file(str(ct_dir / "model.safetensors")).items():
        if algo == "FP8" and name.endswith((".weight_scale", ".input_scale")):
            tensors[name] = t.reshape(())  # modelopt keeps per-tensor scales as scalars
        elif name.endswith(".weight_packed"):
            tensors[name.replace(".weight_packed", ".weight")] = t
        elif name.endswith(".weight_global_scale"):
            tensors[name.replace(".weight_global_scale", ".weight_scale_2")] = (1.0 / t).reshape(())
            tensors[name.replace(".weight_global_scale", ".input_scale")] = torch.tensor(1.0)
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((ct_dir / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    (out / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": algo, "group_size": 16, "exclude_modules": ["lm_head"]}}))
    for f in ct_dir.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "chat_template")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_weights_equal_library_decompression(nvfp4_checkpoints, layout):
    ours = load_model(nvfp4_checkpoints[layout], torch.float32, torch.device("cpu"))
    theirs = decompressed_by_library(nvfp4_checkpoints["compressed-tensors"])
    layers = {p: m for p, m in ours.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(layers) == 7 * TINY_SHAPE["num_hidden_layers"] and all(m.layout == layout for m in layers.values())
    for path, layer in layers.items():
        expected = theirs.get_submodule(path).weight
        assert expected.dtype == torch.bfloat16  # compressed-tensors decodes NVFP4 into bf16
        # modelopt multiplies by 1/global where compressed-tensors divides by it: one rounding apart
        tol = dict(rtol=0, atol=0) if layout == "compressed-tensors" else dict(rtol=8e-3, atol=0)
        torch.testing.assert_close(layer.dequantized_weight(torch.bfloat16), expected, **tol)


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_greedy_equals_transformers_on_decompressed(nvfp4_checkpoints, layout):
    """The library's decoded weights (bf16) in an otherwise float32 transformers model."""
    theirs = decompressed_by_library(nvfp4_checkpoints["compressed-tensors"])
    for module in theirs.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.bfloat16:
            module.weight.data = module.weight.data.float()
    ids = torch.tensor([PROMPT])
    expected = []
    with torch.no_grad():
        for _ in range(16):
            nxt = int(theirs(ids).logits[0, -1].argmax())
            expected.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert verispec_greedy(nvfp4_checkpoints[layout], 16) == expected


def test_modelopt_fp8(tiny_models, tmp_path):
    """modelopt FP8: per-tensor FP8 weights and static FP8 activations, the compressed-tensors FP8
    scheme under modelopt's names; outputs equal the library's model (activations rounded too)."""
    src = tiny_models.get("quant-qwen3", "qwen3", head_dim=32, **TINY_SHAPE)
    ct = ct_quantize(src, tmp_path / "ct-fp8", preset="FP8")
    path = as_modelopt(ct, tmp_path / "modelopt-fp8", algo="FP8")
    ours = load_model(path, torch.float32, torch.device("cpu"))
    theirs = decompressed_by_library(ct)
    layer = ours.model.layers[1].self_attn.k_proj
    assert layer.activations == "static" and layer.input_scale.shape == ()
    torch.testing.assert_close(layer.dequantized_weight(torch.float32), theirs.model.layers[1].self_attn.k_proj.weight,
                               rtol=0, atol=0)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours.logits(ours(ids, torch.arange(len(PROMPT))[None], ours.make_cache(16)).hidden)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_unsupported_modelopt_algorithms_are_named(nvfp4_checkpoints, tmp_path):
    import shutil

    out = tmp_path / "w4a8"
    shutil.copytree(nvfp4_checkpoints["modelopt"], out)
    (out / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(UnsupportedModelError, match=r"quant_algo 'W4A8_AWQ' is not supported \(supported: NVFP4, FP8\)"):
        load_model(out, torch.float32, torch.device("cpu"))
