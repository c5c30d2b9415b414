"""compressed-tensors pack-quantized checkpoints written by the compressed-tensors library itself:
verispec's dequantized weights equal the library's decompression (through transformers'
CompressedTensorsHfQuantizer), and greedy output equals transformers' on the decompressed model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from verispec.errors import UnsupportedModelError
from verispec.loading.model_loader import load_model
from verispec.quant.layers.float_linear import Float8Linear
from verispec.quant.layers.linear import PackedIntLinear

from tests.quant.conftest import PROMPT, TINY_SHAPE, ct_quantize, decompressed_by_library, verispec_greedy

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (pip install compressed-tensors)")
# transformers notes that the checkpoint's own quantization_config wins over run_compressed=False's; expected
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")

FP8_PRESETS = ("FP8_DYNAMIC", "FP8", "FP8_BLOCK")  # channel, tensor and 128x128 block scales
SCHEMES = {
    "w4-g32-sym": dict(num_bits=4, symmetric=True, strategy="group", group_size=32),
    "w4-g64-asym": dict(num_bits=4, symmetric=False, strategy="group", group_size=64),
    "w8-channel-sym": dict(num_bits=8, symmetric=True, strategy="channel"),
    "w4-channel-asym": dict(num_bits=4, symmetric=False, strategy="channel"),
    # GPTQ's activation order as compressed-tensors 0.20 keeps it (groups stay contiguous)
    "w4-g32-actorder-weight": dict(num_bits=4, symmetric=False, strategy="group", group_size=32, actorder="weight"),
}


@pytest.fixture(scope="module")
def ct_checkpoints(tiny_models, tmp_path_factory) -> dict[str, Path]:
    src = tiny_models.get("quant-qwen3", "qwen3", head_dim=32, **TINY_SHAPE)
    root = tmp_path_factory.mktemp("ct")
    out = {name: ct_quantize(src, root / name, weights) for name, weights in SCHEMES.items()}
    out.update({name: ct_quantize(src, root / name, preset=name) for name in FP8_PRESETS})
    return out


@pytest.mark.parametrize("name", list(SCHEMES))
def test_weights_equal_library_decompression(ct_checkpoints, name):
    ours = load_model(ct_checkpoints[name], torch.float32, torch.device("cpu"))
    theirs = decompressed_by_library(ct_checkpoints[name])
    layers = {path: m for path, m in ours.named_modules() if isinstance(m, PackedIntLinear)}
    assert len(layers) == 7 * TINY_SHAPE["num_hidden_layers"]  # q k v o gate up down; lm_head ignored
    for path, layer in layers.items():
        assert layer.bits == SCHEMES[name]["num_bits"] and layer.symmetric == SCHEMES[name]["symmetric"]
        torch.testing.assert_close(layer.dequantized_weight(torch.float32), theirs.get_submodule(path).weight,
                                   rtol=0, atol=0, msg=lambda m: f"{name} {path}: {m}")


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_fp8_weights_equal_library_decompression(ct_checkpoints, name):
    ours = load_model(ct_checkpoints[name], torch.float32, torch.device("cpu"))
    theirs = decompressed_by_library(ct_checkpoints[name])
    layers = {path: m for path, m in ours.named_modules() if isinstance(m, Float8Linear)}
    assert len(layers) == 7 * TINY_SHAPE["num_hidden_layers"]
    for path, layer in layers.items():
        torch.testing.assert_close(layer.dequantized_weight(torch.float32), theirs.get_submodule(path).weight,
                                   rtol=0, atol=0, msg=lambda m: f"{name} {path}: {m}")


@pytest.mark.parametrize("name", ["w4-g32-sym", "w4-g64-asym", "w4-g32-actorder-weight", "FP8_DYNAMIC", "FP8", "FP8_BLOCK"])
def test_greedy_equals_transformers_on_decompressed(ct_checkpoints, name):
    theirs = decompressed_by_library(ct_checkpoints[name])
    ids = torch.tensor([PROMPT])
    expected = []
    with torch.no_grad():
        for _ in range(16):
            nxt = int(theirs(ids).logits[0, -1].argmax())
            expected.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert verispec_greedy(ct_checkpoints[name], 16) == expected


def library_decompressed(path: Path) -> dict[str, torch.Tensor]:
    """Every pack-quantized module's weight as compressed-tensors' own compressor decompresses it
    (straight from the checkpoint's tensors: transformers' loader cannot decompress embeddings)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    group = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(**group)
    out = {}
    for name in tensors:
        if name.endswith(".weight_packed"):
            prefix = name[: -len(".weight_packed")]
            state = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
            out[prefix] = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    return out


def test_quantized_embedding_equals_library_decompression(tiny_models, tmp_path):
    """An `Embedding` target too: the table loads as stored (PackedIntEmbedding), its rows equal
    the library's decompression, and greedy output equals transformers' on the decompressed weights."""
    from transformers import AutoModelForCausalLM

    from verispec.quant.layers.linear import PackedIntEmbedding

    src = tiny_models.get("quant-qwen3", "qwen3", head_dim=32, **TINY_SHAPE)
    path = ct_quantize(src, tmp_path / "emb", SCHEMES["w4-g64-asym"], targets=("Linear", "Embedding"))
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert isinstance(model.model.embed_tokens, PackedIntEmbedding)
    theirs = library_decompressed(path)
    assert "model.embed_tokens" in theirs
    torch.testing.assert_close(model.model.embed_tokens.dequantized_weight(torch.float32),
                               theirs["model.embed_tokens"].float(), rtol=0, atol=0)
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for prefix, weight in theirs.items():
            params[f"{prefix}.weight"].copy_(weight)
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(PROMPT):].tolist()
    assert verispec_greedy(path, 16) == expected


def test_bfloat16_scales_decode_as_the_library_does(tiny_models, tmp_path):
    src = tiny_models.get("quant-qwen3", "qwen3", head_dim=32, **TINY_SHAPE)
    path = ct_quantize(src, tmp_path / "bf16", SCHEMES["w4-g64-asym"], dtype=torch.bfloat16)
    ours = load_model(path, torch.bfloat16, torch.device("cpu"))
    theirs = decompressed_by_library(path, torch.bfloat16)
    for name, layer in ours.named_modules():
        if isinstance(layer, PackedIntLinear):
            assert torch.equal(layer.dequantized_weight(torch.bfloat16), theirs.get_submodule(name).weight), name


@pytest.mark.parametrize("name,merged_type", [("w4-g64-asym", PackedIntLinear), ("FP8", Float8Linear),
                                               ("FP8_BLOCK", torch.nn.Module)])
def test_merged_projections_keep_the_output(ct_checkpoints, name, merged_type):
    model = load_model(ct_checkpoints[name], torch.float32, torch.device("cpu"))
    ids, pos = torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None]
    before = model.logits(model(ids, pos, model.make_cache(16)).hidden)
    model.fuse_small_ops(compile=False)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, merged_type)
    torch.testing.assert_close(model.logits(model(ids, pos, model.make_cache(16)).hidden), before, rtol=1e-5, atol=1e-5)


def test_unsupported_schemes_are_named(ct_checkpoints, tmp_path):
    def variant(name: str, edit) -> Path:
        out = tmp_path / name
        shutil.copytree(ct_checkpoints["w4-g32-sym"], out)
        config = json.loads((out / "config.json").read_text())
        edit(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
        return out

    group = lambda qc: qc["config_groups"]["group_0"]  # noqa: E731
    cases = [
        (lambda qc: group(qc).update(input_activations={"num_bits": 8, "type": "int", "dynamic": True}),
         "quantized activations"),
        (lambda qc: group(qc)["weights"].update(actorder="group"), "actorder 'group'"),
        (lambda qc: group(qc)["weights"].update(strategy="tensor"),
         r"strategy 'tensor' is not supported \(supported: group, channel\)"),
        (lambda qc: group(qc).update(format="marlin-24"), "format 'marlin-24' is not supported"),
        (lambda qc: qc.update(quantization_status="frozen"), "quantization_status 'frozen'"),
        (lambda qc: group(qc)["weights"].update(num_bits=8), "weight_packed has shape"),
    ]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(UnsupportedModelError, match=message):
            load_model(variant(f"v{i}", edit), torch.float32, torch.device("cpu"))
