"""Llama-family models whose every product runs the CPU integer-dot kernel compute their decoder
layers in one kernel call per pass (kernels/cpu_layers.py) instead of ~80 torch ops a layer.

`install(model)` runs at load on a CPU (quant.prepare, after the copies are made): it gives the
model a `layer_stack` (models/base.py FoldedDecoderLM calls it for every pass it takes) or logs,
under VERISPEC_DEBUG=1, why the torch layers stay. A stack takes passes on the paged cache with
plain K/V pools (`takes`); every pass of an engine's sequences goes the same way, so a row's bits
do not depend on which pass computed it.
"""
from __future__ import annotations

import torch

from verispec import log
from verispec.models.base import FoldedDecoderLM
from verispec.models.layers.attention import AttentionInputs
from verispec.models.layers.mlp import GatedMLP
from verispec.models.layers.parallel import Shard
from verispec.models.llama import Attention, DecoderLayer
from verispec.quant.dispatch import Kernel
from verispec.quant.kernels import cpu_layers
from verispec.quant.layers.linear import QuantizedLinear


def _product(layer, dtype: torch.dtype) -> tuple[cpu_layers.ProductWeights | None, str | None]:
    if not isinstance(layer, QuantizedLinear):
        return None, f"a {type(layer).__name__} product (it takes quantized layers)"
    if layer.qdot_blocks is None or layer.bound is None or layer.bound.kernels[0] is not Kernel.QDOT:
        return None, "a quantized layer without the integer-dot kernel's blocks"
    bias = layer.bias.detach() if layer.bias is not None else None
    if bias is not None and bias.dtype != dtype:
        return None, f"a {bias.dtype} bias"
    return cpu_layers.ProductWeights(layer.qdot_blocks, layer.bits, layer.out_features, layer.in_features, bias), None


def _layer(layer, dtype: torch.dtype) -> tuple[cpu_layers.LayerWeights | None, str | None]:
    if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention:
        return None, f"a {type(layer).__name__} layer"
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, GatedMLP) or mlp.kernel is not None or mlp.gate_up_proj is None:
        return None, "an MLP other than a merged gated MLP"
    if mlp.act is not torch.nn.functional.silu:
        return None, "an activation other than SiLU"
    if attn.qkv_proj is None:
        return None, "unmerged q/k/v projections"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    if any(n.unit_offset or n.weight.dtype != dtype for n in norms):
        return None, "norms with a unit offset or another dtype"
    products = {}
    for name, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                         ("down", mlp.down_proj)):
        products[name], reason = _product(linear, dtype)
        if reason is not None:
            return None, reason
    weight = lambda norm: norm.weight.detach() if norm is not None else None  # noqa: E731
    return cpu_layers.LayerWeights(**products, input_norm=weight(layer.input_layernorm),
                                   post_norm=weight(layer.post_attention_layernorm), q_norm=weight(attn.q_norm),
                                   k_norm=weight(attn.k_norm), window=attn.window), None


def build(model) -> tuple[LayerStack | None, str | None]:
    """The model's stack, or None and why not."""
    if not isinstance(model, FoldedDecoderLM):
        return None, f"{type(model).__name__} is not a Llama-family decoder"
    device, dtype = next(model.parameters()).device, model.model.norm.weight.dtype
    if device.type != "cpu":
        return None, f"device {device.type} (a CPU kernel)"
    if dtype not in cpu_layers.DTYPE_CODES:
        return None, f"activations in {str(dtype).removeprefix('torch.')} (it takes float16 and bfloat16)"
    if any(isinstance(getattr(m, "shard", None), Shard) for m in model.modules()):
        return None, "a tensor-parallel shard (its products are summed across ranks between the ops)"
    s = model.settings
    if s.head_dim > cpu_layers.MAX_HEAD_DIM or s.head_dim % 2:
        return None, f"head dim {s.head_dim}"
    if model.rotary.inv_freq_cpu.numel() * 2 != s.head_dim:
        return None, "partial RoPE"
    layers = []
    for i, layer in enumerate(model.model.layers):
        weights, reason = _layer(layer, dtype)
        if reason is not None:
            return None, f"layer {i}: {reason}"
        layers.append(weights)
    if (reason := cpu_layers.failure()) is not None:
        return None, reason
    first = model.model.layers[0].self_attn
    shape = cpu_layers.Shape(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size,
                             s.rms_norm_eps, first.scale)
    return LayerStack(cpu_layers.Layers(shape, layers, dtype)), None


class LayerStack:
    """A model's decoder layers in the CPU kernel: `takes(inputs)` says whether a pass can run
    there; calling it runs layers start..stop-1 (FoldedDecoderLM's layer contract)."""

    def __init__(self, layers: cpu_layers.Layers):
        self.layers = layers

    def takes(self, inputs: AttentionInputs) -> bool:
        if not inputs.paged:
            return False
        pools = inputs.cache.pools
        return pools.dtype == self.layers.dtype and not pools.fp8 and all(c is None for c in pools.codecs)

    def __call__(self, x: torch.Tensor, update: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 inputs: AttentionInputs, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = inputs.cache
        return self.layers.run(start, stop, x, update, cos, sin, inputs.positions, cache.write_slots,
                               cache.block_tables, cache.block_size, cache.pools.keys, cache.pools.values)


def install(model) -> bool:
    """Gives `model` its layer stack where the kernel takes it (logged either way under debug)."""
    stack, reason = build(model)
    if stack is None:
        log.debug("decoder layers run in torch, not the CPU layer kernel: %s", reason)
        return False
    model.layer_stack = stack
    log.debug("decoder layers run in the CPU layer kernel (%d layers)", len(stack.layers.layers))
    return True
