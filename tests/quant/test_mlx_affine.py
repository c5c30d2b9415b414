"""MLX affine checkpoints against MLX itself: tensors written by mx.quantize / mlx_lm.convert,
dequantized by verispec, must equal mx.dequantize's; greedy output must equal mlx-lm's."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from verispec.errors import UnsupportedModelError
from verispec.loading.model_loader import load_model
from verispec.quant.layers.linear import MLXAffineEmbedding, MLXAffineLinear
from verispec.quant import mlx_affine
from verispec.quant.packing import pack_rows, unpack_rows

from tests.quant.conftest import (PROMPT, TINY_SHAPE, import_mlx, mlx_convert, mlx_greedy, mlx_tensors,
                                  quantized_modules, to_torch, verispec_greedy)

@pytest.mark.parametrize("bits", mlx_affine.SUPPORTED_BITS)
@pytest.mark.parametrize("group", mlx_affine.SUPPORTED_GROUP_SIZES)
def test_dequantize_equals_mx_dequantize(bits, group):
    mx = import_mlx()
    w = mx.random.normal((24, 384), key=mx.random.key(bits * 1000 + group))
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    expected = to_torch(mx.dequantize(packed, scales, biases, group_size=group, bits=bits))
    ours = mlx_affine.dequantize(to_torch(packed), to_torch(scales), to_torch(biases), mlx_affine.AffineSpec(bits, group))
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits", mlx_affine.SUPPORTED_BITS)
def test_packing_round_trip(bits):
    values = torch.randint(0, 1 << bits, (5, 96), generator=torch.Generator().manual_seed(bits))
    packed = pack_rows(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (5, 96 * bits // 32)
    assert torch.equal(unpack_rows(packed, bits, 96).long(), values)


@pytest.mark.parametrize("bits", mlx_affine.SUPPORTED_BITS)
def test_packing_in_row_chunks_gives_mlx_words(bits, monkeypatch):
    """A large table is packed a few rows at a time (bounded temporaries): the words are MLX's."""
    mx = import_mlx()
    w = mx.random.normal((37, 192), key=mx.random.key(bits))
    packed, _, _ = mx.quantize(w, group_size=64, bits=bits)
    words = to_torch(packed).view(torch.int32)
    values = unpack_rows(words, bits, 192)
    monkeypatch.setattr("verispec.quant.packing.PACK_CHUNK_VALUES", 192 * 5)  # 8 chunks, the last short
    assert torch.equal(pack_rows(values, bits), words)
    assert torch.equal(pack_rows(values.reshape(37, 1, 192), bits), words.reshape(37, 1, -1))


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32), (3, 128), (6, 64)])
def test_our_quantize_is_read_by_mx_dequantize(bits, group):
    """What `verispec quantize` writes decodes the same in MLX, and is as accurate as mx.quantize."""
    mx = import_mlx()
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(bits)) * 0.05
    w[0, :group] = 0.0  # an all-zero group stays exactly zero
    spec = mlx_affine.AffineSpec(bits, group)
    packed, scales, biases = mlx_affine.quantize(w, spec)
    words = mx.array(packed.numpy().view(np.uint32))
    theirs = to_torch(mx.dequantize(words, mx.array(scales.numpy()), mx.array(biases.numpy()),
                                    group_size=group, bits=bits))
    ours = mlx_affine.dequantize(packed, scales, biases, spec)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert torch.all(ours[0, :group] == 0)
    mx_error = (to_torch(mx.dequantize(*mx.quantize(mx.array(w.numpy()), group_size=group, bits=bits),
                                       group_size=group, bits=bits)) - w).norm()
    assert float((ours - w).norm()) <= 1.05 * float(mx_error)


def mixed_predicate(path, module):
    """Per-layer overrides as mlx-lm records them: 8-bit group 32 MLPs down, one float layer."""
    if path.endswith("down_proj"):
        return {"group_size": 32, "bits": 8, "mode": "affine"}
    if path == "model.layers.1.self_attn.o_proj":
        return False
    return True


@pytest.fixture(scope="module")
def mlx_checkpoints(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx")
    qwen3 = tiny_models.get("quant-qwen3", "qwen3", head_dim=32, **TINY_SHAPE)
    # mlx-lm 0.32's qwen2 reads rope_theta only at the top level (transformers 5 nests it in
    # rope_parameters) and defaults to 1e6: use that value so both sides run the same model
    qwen2_tied = tiny_models.get("quant-qwen2-tied", "qwen2", tie_word_embeddings=True, rope_theta=1e6, **TINY_SHAPE)
    return {
        "qwen3-4bit-g64": mlx_convert(qwen3, root / "qwen3-4bit-g64", q_bits=4, q_group_size=64),
        "qwen3-8bit-g128": mlx_convert(qwen3, root / "qwen3-8bit-g128", q_bits=8, q_group_size=128),
        "qwen3-mixed": mlx_convert(qwen3, root / "qwen3-mixed", q_bits=4, q_group_size=64,
                                   quant_predicate=mixed_predicate),
        "qwen2-tied-4bit-g32": mlx_convert(qwen2_tied, root / "qwen2-tied", q_bits=4, q_group_size=32),
    }


@pytest.mark.parametrize("name", ["qwen3-4bit-g64", "qwen3-8bit-g128", "qwen3-mixed", "qwen2-tied-4bit-g32"])
def test_weights_equal_mlx_lm_dequantized(mlx_checkpoints, name):
    mx = import_mlx()
    model = load_model(mlx_checkpoints[name], torch.float32, torch.device("cpu"))
    _, theirs = mlx_tensors(mlx_checkpoints[name])
    layers = quantized_modules(model)
    assert "model.embed_tokens" in layers and "lm_head" in layers
    for path, layer in layers.items():
        source = "model.embed_tokens" if path == "lm_head" and f"{path}.scales" not in theirs else path
        expected = to_torch(mx.dequantize(theirs[f"{source}.weight"], theirs[f"{source}.scales"],
                                          theirs[f"{source}.biases"], group_size=layer.group_size, bits=layer.bits))
        torch.testing.assert_close(layer.dequantized_weight(torch.float32), expected, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{name} {path}: {m}")
    if name == "qwen3-mixed":
        layer0 = model.model.layers[0]
        assert (layer0.mlp.down_proj.bits, layer0.mlp.down_proj.group_size) == (8, 32)
        assert (layer0.mlp.up_proj.bits, layer0.mlp.up_proj.group_size) == (4, 64)
        assert isinstance(model.model.layers[1].self_attn.o_proj, torch.nn.Linear)
    if name.startswith("qwen2-tied"):
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("name", ["qwen3-4bit-g64", "qwen3-mixed", "qwen2-tied-4bit-g32"])
def test_greedy_equals_mlx_lm(mlx_checkpoints, name):
    ours = verispec_greedy(mlx_checkpoints[name], 24)
    mlx_model, _ = mlx_tensors(mlx_checkpoints[name])
    assert ours == mlx_greedy(mlx_model, PROMPT, 24)


def test_logits_close_to_mlx_lm(mlx_checkpoints):
    mx = import_mlx()
    path = mlx_checkpoints["qwen3-4bit-g64"]
    model = load_model(path, torch.float32, torch.device("cpu"))
    ids = torch.tensor([PROMPT])
    out = model(ids, torch.arange(len(PROMPT))[None], model.make_cache(16))
    ours = model.logits(out.hidden)
    mlx_model, _ = mlx_tensors(path)
    theirs = torch.from_numpy(np.array(mlx_model(mx.array([PROMPT]))))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_merged_projections_keep_the_output(mlx_checkpoints):
    """fuse_small_ops merges q/k/v and gate/up; quantized layers concatenate their packed rows,
    and layers quantized differently run side by side."""
    for name in ("qwen3-4bit-g64", "qwen3-mixed"):
        model = load_model(mlx_checkpoints[name], torch.float32, torch.device("cpu"))
        ids = torch.tensor([PROMPT])
        before = model.logits(model(ids, torch.arange(len(PROMPT))[None], model.make_cache(16)).hidden)
        model.fuse_small_ops(compile=False)
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, MLXAffineLinear)
        after = model.logits(model(ids, torch.arange(len(PROMPT))[None], model.make_cache(16)).hidden)
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_embedding_rows_match_table(mlx_checkpoints):
    model = load_model(mlx_checkpoints["qwen3-4bit-g64"], torch.float32, torch.device("cpu"))
    table = model.model.embed_tokens
    assert isinstance(table, MLXAffineEmbedding)
    ids = torch.tensor([[5, 0, 77], [3, 3, 200]])
    torch.testing.assert_close(table(ids), table.dequantized_weight(torch.float32)[ids])


def test_unsupported_quantization_is_named(tmp_path, mlx_checkpoints):
    import json
    import shutil

    def variant(name: str, edit) -> Path:
        out = tmp_path / name
        shutil.copytree(mlx_checkpoints["qwen3-4bit-g64"], out)
        config = json.loads((out / "config.json").read_text())
        edit(config)
        (out / "config.json").write_text(json.dumps(config))
        return out

    cases = [
        (lambda c: c["quantization"].update(mode="int2"),
         r"mode 'int2' is not supported \(supported: affine, nvfp4, mxfp4, mxfp8\)"),
        (lambda c: c["quantization"].update({"model.layers.0.mlp.up_proj": {"bits": 8, "group_size": 64}}),
         "declares affine 8-bit group 64, its tensors hold affine 4-bit group 64"),
        (lambda c: c["quantization"].update({"model.layers.0.mlp.up_proj": False}), "marks it unquantized"),
        (lambda c: (c.pop("quantization"), c.update(quantization_config={"quant_method": "gptq", "bits": 4})),
         "quant_method 'gptq' is not supported"),
    ]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(UnsupportedModelError, match=message):
            load_model(variant(f"v{i}", edit), torch.float32, torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match=r"bits=7 is not supported \(supported: 2, 3, 4, 5, 6, 8\)"):
        mlx_affine.AffineSpec(7, 64)
    with pytest.raises(UnsupportedModelError, match=r"group_size=16 is not supported \(supported: 32, 64, 128\)"):
        mlx_affine.AffineSpec(4, 16)
