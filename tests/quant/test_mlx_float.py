"""MLX's float quantization modes (nvfp4, mxfp4, mxfp8) against MLX itself: checkpoints written by
`mlx_lm.convert --q-mode`, dequantized by verispec, equal mx.dequantize's; greedy output equals
mlx-lm's."""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from verispec.loading.model_loader import load_model
from verispec.quant.layers.float_linear import MLXFloatEmbedding, MLXFloatLinear
from verispec.quant import mlx_float

from tests.quant.conftest import PROMPT, TINY_SHAPE, import_mlx, mlx_convert, mlx_greedy, mlx_tensors, to_torch, verispec_greedy

MODES = list(mlx_float.MODES)


@pytest.mark.parametrize("mode", MODES)
def test_dequantize_equals_mx_dequantize(mode):
    mx = import_mlx()
    spec = mlx_float.MODES[mode]
    w = mx.random.normal((24, 256), key=mx.random.key(7))
    packed, scales = mx.quantize(w, group_size=spec.group_size, bits=spec.bits, mode=mode)
    expected = to_torch(mx.dequantize(packed, scales, group_size=spec.group_size, bits=spec.bits, mode=mode,
                                      dtype=mx.float32))
    ours = mlx_float.dequantize(to_torch(packed), torch.from_numpy(np.array(scales).copy()), spec)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_e8m0_scales_decode_exactly_without_a_torch_warning():
    codes = torch.arange(255, dtype=torch.uint8).view(15, 17)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch deprecates resizing a 0-d output (it once did that here)
        scales = mlx_float.decode_scales(codes, "e8m0")
    expected = torch.tensor([math.ldexp(1.0, c - 127) for c in range(255)], dtype=torch.float32).view(15, 17)
    assert torch.equal(scales, expected)


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory) -> dict[str, Path]:
    src = tiny_models.get("quant-qwen3", "qwen3", head_dim=32, **TINY_SHAPE)
    root = tmp_path_factory.mktemp("mlx-float")
    return {mode: mlx_convert(src, root / mode, q_mode=mode) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_weights_and_greedy_equal_mlx_lm(checkpoints, mode):
    mx = import_mlx()
    spec = mlx_float.MODES[mode]
    model = load_model(checkpoints[mode], torch.float32, torch.device("cpu"))
    mlx_model, theirs = mlx_tensors(checkpoints[mode])
    layers = {p: m for p, m in model.named_modules() if isinstance(m, (MLXFloatLinear, MLXFloatEmbedding))}
    assert "model.embed_tokens" in layers and "lm_head" in layers and len(layers) == 7 * 2 + 2
    for path, layer in layers.items():
        expected = to_torch(mx.dequantize(theirs[f"{path}.weight"], theirs[f"{path}.scales"],
                                          group_size=spec.group_size, bits=spec.bits, mode=mode, dtype=mx.float32))
        torch.testing.assert_close(layer.dequantized_weight(torch.float32), expected, rtol=0, atol=0)
    tokens = verispec_greedy(checkpoints[mode], 20)
    assert tokens == mlx_greedy(mlx_model, PROMPT, 20)
