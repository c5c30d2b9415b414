"""Fixtures for quantized-weight tests: tiny float checkpoints quantized by the formats' own
libraries (mlx-lm's convert, compressed-tensors), so what verispec reads is what users have."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch

PROMPT = [3, 17, 250, 41, 9, 100, 7]
TINY_SHAPE = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2)


def import_mlx():
    """mlx with its CPU backend: `pip install 'mlx[cpu]' mlx-lm` (Linux wheels exist for x86_64
    and aarch64); skip with the reason where the wheel cannot be installed."""
    mx = pytest.importorskip("mlx.core", reason="mlx[cpu] is not installed (pip install 'mlx[cpu]' mlx-lm)")
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    return mx


def mlx_convert(src: Path, out: Path, **kwargs) -> Path:
    """`mlx_lm.convert(quantize=True)` on a local transformers checkpoint (its progress quietened)."""
    import_mlx()
    from mlx_lm import convert

    if not out.exists():
        with contextlib.redirect_stdout(io.StringIO()):
            convert(str(src), str(out), quantize=True, **kwargs)
    return out


def mlx_tensors(model_dir: Path) -> dict:
    """mlx-lm's own load of a checkpoint: parameter name -> mx.array."""
    import_mlx()
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, _ = load(str(model_dir))
    return model, dict(tree_flatten(model.parameters()))


def mlx_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """mlx-lm's own greedy decoding (generate_step's default sampler is argmax)."""
    mx = import_mlx()
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt_ids), model, max_tokens=num_tokens)
    return [int(token) for token, _ in steps]


def quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from verispec.models.layers.quant_linear import MLXAffineEmbedding, QuantizedLinear

    return {name: m for name, m in model.named_modules() if isinstance(m, (QuantizedLinear, MLXAffineEmbedding))}


def to_torch(a) -> torch.Tensor:
    """An mx.array as a torch tensor: packed uint32 words as int32 (the same bits), floats as float32."""
    import mlx.core as mx

    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32))
    return torch.from_numpy(np.array(a.astype(mx.float32)))
