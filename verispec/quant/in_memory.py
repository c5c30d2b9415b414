"""Quantizing a loaded float model in place: what `verispec bench --quant` measures (random
weights of a real model's shape, quantized on the device), with the same layers and the same
choice of layers as a checkpoint written by `verispec quantize` would load into."""
from __future__ import annotations

import torch
from torch import nn

from verispec import log
from verispec.errors import VerispecError
from verispec.models.layers.moe import FusedExperts
from verispec.quant.layers.experts import MLXQuantizedExperts, QuantizedExpertStack
from verispec.quant.layers.linear import MLXAffineEmbedding, MLXAffineLinear
from verispec.quant import mlx_affine
from verispec.quant.loading import replace_module

IN_MEMORY_FORMATS = {"mlx-4bit": 4, "mlx-8bit": 8, "mlx-3bit": 3, "mlx-6bit": 6}
ROWS_PER_CHUNK = 8192  # bounds the float32 / int64 temporaries of quantizing a vocabulary-sized table


def quantize_model_(model: nn.Module, format_name: str, group_size: int = 64) -> int:
    """Replace the model's linear and embedding layers (input width a multiple of `group_size`)
    by MLX affine layers holding their quantized weights; returns how many were replaced. A tied
    lm_head becomes the quantized table's own head."""
    if format_name not in IN_MEMORY_FORMATS:
        raise VerispecError(f"--quant '{format_name}' is not supported (supported: {', '.join(IN_MEMORY_FORMATS)})",
                            param="quant")
    spec = mlx_affine.AffineSpec(IN_MEMORY_FORMATS[format_name], group_size)
    if any(hasattr(m, "checkpoint_buffers") for m in model.modules()):
        raise VerispecError(f"--quant {format_name}: the model's weights are already quantized", param="quant")
    settings = getattr(model, "settings", None)
    tied = bool(getattr(settings, "tie_word_embeddings", False))
    count = 0
    for path, module in list(model.named_modules()):
        if tied and path == "lm_head":
            continue
        if isinstance(module, FusedExperts):
            count += _quantize_experts(model, path, module, spec)
            continue
        with torch.device("meta"):  # _fill replaces every tensor
            if type(module) is nn.Linear:
                new = MLXAffineLinear(module.in_features, module.out_features, spec.bits, spec.group_size,
                                      bias=module.bias is not None)
            elif isinstance(module, nn.Embedding):
                new = MLXAffineEmbedding(module.num_embeddings, module.embedding_dim, spec.bits, spec.group_size)
            else:
                continue
        if module.weight.shape[-1] % spec.group_size:
            log.debug("quantize_model_: kept %s in float (width %d, group %d)", path, module.weight.shape[-1],
                      spec.group_size)
            continue
        _fill(new, module.weight, spec)
        if getattr(module, "bias", None) is not None:
            new.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
        replace_module(model, path, new)
        count += 1
    if tied and isinstance(model.input_embeddings(), MLXAffineEmbedding):
        model.lm_head = model.input_embeddings().as_linear()
    return count


def _quantize_experts(model: nn.Module, path: str, module: FusedExperts, spec: mlx_affine.AffineSpec) -> int:
    """FusedExperts -> MLXQuantizedExperts (mlx-lm's SwitchGLU stacks, as a checkpoint loads them)."""
    num_experts, two_i, hidden = module.gate_up_proj.shape
    if hidden % spec.group_size or (two_i // 2) % spec.group_size:
        log.debug("quantize_model_: kept %s in float (widths %d / %d, group %d)", path, hidden, two_i // 2,
                  spec.group_size)
        return 0
    gate, up = module.gate_up_proj.detach().chunk(2, dim=1)
    stacks = {}
    for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", module.down_proj.detach())):
        e, n, k = w.shape
        with torch.device("meta"):
            stack = QuantizedExpertStack(e, k, n, spec.bits, spec.group_size)
        _fill(stack, w.reshape(e * n, k), spec)
        stack.weight = stack.weight.view(e, n, -1)
        stack.scales = nn.Parameter(stack.scales.view(e, n, -1), requires_grad=False)
        stack.biases = nn.Parameter(stack.biases.view(e, n, -1), requires_grad=False)
        stacks[name] = stack
    replace_module(model, path, MLXQuantizedExperts(num_experts, module.act, **stacks))
    return 3


def _fill(layer: nn.Module, weight: torch.Tensor, spec: mlx_affine.AffineSpec) -> None:
    """Quantize `weight` [N, K] into the layer's weight / scales / biases, a chunk of rows at a time."""
    packed, scales, biases = [], [], []
    with torch.no_grad():
        for start in range(0, weight.shape[0], ROWS_PER_CHUNK):
            p, s, b = mlx_affine.quantize(weight[start:start + ROWS_PER_CHUNK], spec)
            packed.append(p)
            scales.append(s)
            biases.append(b)
        layer.weight = torch.cat(packed)
        layer.scales = nn.Parameter(torch.cat(scales), requires_grad=False)
        layer.biases = nn.Parameter(torch.cat(biases), requires_grad=False)
