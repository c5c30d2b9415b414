"""A quantized model decoded to plain layers (quant/dense.py, what exact numerics run for small
quantized models on CUDA) gives the logits its quantized layers give, with its head still tied to
its table; an MLX 4-bit checkpoint written by mlx-lm."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.quant.conftest import mlx_convert, quantized_modules
from tests.spec.conftest import TARGET_SHAPE
from verispec.engine.engine import load_engine
from verispec.quant import dense


@pytest.fixture(scope="module")
def quantized_dir(tiny_models, tmp_path_factory):
    src = tiny_models.get("dense-llama", "llama", tie_word_embeddings=True, **TARGET_SHAPE)
    return mlx_convert(src, tmp_path_factory.mktemp("dense") / "llama-4bit", q_bits=4, q_group_size=32)


def test_decoded_model_gives_the_quantized_logits(quantized_dir):
    engine = load_engine(str(quantized_dir), dtype="float32", device="cpu")
    model = engine.model
    assert quantized_modules(model), "the checkpoint should load quantized"
    ids = torch.tensor([[5, 17, 99, 3, 250, 8]])
    with torch.no_grad():
        table = model.model.embed_tokens(ids)
        quantized = model.logits(table)
    expected_bytes = dense.dense_bytes(model, torch.float32)
    count = len(quantized_modules(model))

    assert dense.decode_to_dense(model, torch.float32) == count
    assert not quantized_modules(model) and not dense.has_decodable_layers(model)
    assert isinstance(model.model.embed_tokens, nn.Embedding) and isinstance(model.lm_head, nn.Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model.model.embed_tokens(ids), table)
        torch.testing.assert_close(model.logits(table), quantized, rtol=1e-6, atol=1e-6)
    params = {id(p): p for p in model.parameters()}
    assert sum(p.numel() * p.element_size() for p in params.values()) == expected_bytes
