"""Bytes one batch-1 decode step must move, and the bandwidth roofline they imply.

Each decoded token streams every weight once, except the input embedding, of which one row is
read; plus the KV cache it attends to (a sliding-window layer reads at most its window) and the
state of recurrent layers (read and written). roofline tok/s = bandwidth / bytes per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.cache.kv import LayerCacheSpec, RecurrentLayerSpec
from verispec.cache.paged import kv_bytes_per_token
from verispec.models.base import CausalLM


@dataclass(frozen=True)
class TokenBytes:
    weights: int  # every weight tensor, minus the input embedding (plus one of its rows)
    kv: int  # K and V rows attended to, recurrent state read and written

    @property
    def total(self) -> int:
        return self.weights + self.kv


def weight_bytes(model: CausalLM, tokens: int = 1) -> int:
    """Parameters and buffers, each counted once (a tied lm_head is the embedding's own Parameter,
    which parameters() yields once), the untied input embedding replaced by one of its rows; routed
    experts as many as a step of `tokens` tokens reads (`inactive_expert_bytes`)."""
    table = model.input_embeddings()
    embedding = getattr(table, "weight", None)  # a compressed-tensors quantized table has weight_packed
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    total -= inactive_expert_bytes(model, tokens)
    if head is not embedding:
        # the table's own tensors (a quantized table has scales and biases beside its packed rows)
        table_bytes = sum(t.numel() * t.element_size() for t in list(table.parameters()) + list(table.buffers()))
        total -= table_bytes
        total += table_bytes // table.num_embeddings
    # a layer given a copy in a kernel's layout beside its checkpoint words (tinygemm's, the
    # fragment-order one of quant/kernels/frag.py, the CPU integer-dot kernel's blocks) reads only
    # the copy in a decode step (verispec/quant/dispatch.py); released words count nothing already
    copies = ("int4_packed", "frag_words", "qdot_blocks")
    for module in model.modules():
        if any(getattr(module, name, None) is not None for name in copies):
            total -= module.checkpoint_bytes()
    return total


def routing(settings) -> tuple[int, int] | None:
    """(experts per MoE layer, experts routed to per token), None for a dense model: the Qwen MoE
    families' `moe` settings or Gemma 4's fields."""
    moe = getattr(settings, "moe", None)
    if moe is not None:
        return moe.num_experts, moe.top_k
    if getattr(settings, "enable_moe", False):
        return settings.num_experts, settings.top_k_experts
    return None


def inactive_expert_bytes(model: CausalLM, tokens: int = 1) -> int:
    """Mixture-of-experts weights a decode step of `tokens` tokens does not read: each layer reads
    the union of its tokens' top_k of E routed experts once, E * (1 - (1 - top_k/E)^tokens) of them
    expected where routings are independent and uniform (as random weights route; one token: top_k).
    The router, a shared expert, dense MLPs and attention are all read."""
    routed = routing(getattr(model, "settings", None))
    if routed is None:
        return 0
    num_experts, top_k = routed
    expert_bytes = 0
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.dim() == 3 and p.shape[0] == num_experts:  # stacked expert weights [E, ...] (packed words too)
            expert_bytes += p.numel() * p.element_size()
    unread = (1 - top_k / num_experts) ** tokens
    return int(expert_bytes * unread) if tokens > 1 else expert_bytes * (num_experts - top_k) // num_experts


def kv_bytes(model: CausalLM, context: int, kv_cache_dtype: str = "auto") -> int:
    """Cache bytes one decode step reads with `context` tokens before it, as the cache stores them
    (`kv_cache_dtype` "fp8": one byte a value and a scale a row)."""
    dtype = next(model.parameters()).dtype
    item = torch.empty((), dtype=dtype).element_size()
    specs = model.cache_specs()
    windows = getattr(getattr(model, "settings", None), "windows", None) or [None] * len(specs)
    total = 0
    for spec, window in zip(specs, windows):
        if isinstance(spec, LayerCacheSpec):
            rows = context if window is None else min(context, window)
            total += kv_bytes_per_token([spec], dtype, kv_cache_dtype) * rows
        elif isinstance(spec, RecurrentLayerSpec):
            conv = spec.conv_dim * (spec.conv_kernel - 1) * item
            ssm = spec.num_heads * spec.key_dim * spec.value_dim * 4  # float32 state
            total += 2 * (conv + ssm)
    return total


def token_bytes(model: CausalLM, context: int, kv_cache_dtype: str = "auto") -> TokenBytes:
    return TokenBytes(weight_bytes(model), kv_bytes(model, context, kv_cache_dtype))


def mean_decode_context(context: int, gen_tokens: int) -> int:
    """The average number of tokens a measured decode step attends to: the prompt plus, on
    average, half of the generated tokens."""
    return context + gen_tokens // 2


def roofline_tok_s(bandwidth_bytes_s: float | None, bytes_per_token: int) -> float | None:
    if not bandwidth_bytes_s or bytes_per_token <= 0:
        return None
    return bandwidth_bytes_s / bytes_per_token
