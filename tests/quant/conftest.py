"""Fixtures for quantized-weight tests: tiny float checkpoints quantized by the formats' own
libraries (mlx-lm's convert, compressed-tensors), so what verispec reads is what users have."""
from __future__ import annotations

import contextlib
import io
import shutil
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


def verispec_greedy(model_dir: Path, num_tokens: int) -> list[int]:
    """verispec's own greedy decoding of PROMPT (float32, CPU, eos ignored)."""
    from verispec.engine.engine import load_engine
    from verispec.sampling.params import SamplingParams

    engine = load_engine(str(model_dir), dtype="float32", device="cpu", prefill_step_size=16)
    return engine.generate_all(PROMPT, SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                                      ignore_eos=True)).token_ids


def quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from verispec.quant.layers.linear import MLXAffineEmbedding, QuantizedLinear

    return {name: m for name, m in model.named_modules() if isinstance(m, (QuantizedLinear, MLXAffineEmbedding))}


def to_torch(a) -> torch.Tensor:
    """An mx.array as a torch tensor: packed uint32 words as int32 (the same bits), floats as float32."""
    import mlx.core as mx

    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32))
    return torch.from_numpy(np.array(a.astype(mx.float32)))


def ct_quantize(src: Path, out: Path, weights: dict | None = None, dtype=torch.float32, preset: str | None = None,
                targets: tuple[str, ...] = ("Linear",)) -> Path:
    """Round-to-nearest quantization with compressed-tensors' own qparams (integer `weights`
    arguments, or a preset scheme such as FP8_DYNAMIC), compressed by its ModelCompressor and
    saved as llm-compressor saves."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    if out.exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype)
    if preset is not None:
        scheme = preset_name_to_scheme(preset, ["Linear"])
    else:
        scheme = QuantizationScheme(targets=list(targets), weights=QuantizationArgs(type="int", **weights))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            args = module.quantization_scheme.weights
            low, high = weight_ranges(module.weight, args)
            global_scale = None
            if args.strategy == "tensor_group":  # NVFP4: a float32 scale over the tensor, then per 16
                global_scale = generate_gparam(module.weight.amin(), module.weight.amax())
                module.weight_global_scale.copy_(global_scale)
            scale, zero = calculate_qparams(low, high, args, global_scale=global_scale)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):  # static activation scale (not used weights-only)
                module.input_scale.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model, None)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def weight_ranges(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-scale minimum and maximum of w [N, K] for the scheme's strategy."""
    n, k = w.shape
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if args.strategy in ("group", "tensor_group"):
        grouped = w.view(n, -1, args.group_size)
        return grouped.amin(-1), grouped.amax(-1)
    rows, cols = args.block_structure  # edge blocks may be partial (k_proj is [64, 128] here)
    starts = [(r, c) for r in range(0, n, rows) for c in range(0, k, cols)]
    shape = (-(-n // rows), -(-k // cols))
    low = torch.stack([w[r:r + rows, c:c + cols].amin() for r, c in starts]).view(shape)
    high = torch.stack([w[r:r + rows, c:c + cols].amax() for r, c in starts]).view(shape)
    return low, high


def decompressed_by_library(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                quantization_config=CompressedTensorsConfig(run_compressed=False))
