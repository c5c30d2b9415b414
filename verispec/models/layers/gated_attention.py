"""Gated full attention (Qwen3.5 / Qwen3-Next): o_proj(attn * sigmoid(gate)), with HF weight names.

q_proj gives [.., heads, 2 * head_dim]: per head, the first half is the query and the second the
output gate. q_norm/k_norm are per-head (1 + w) RMSNorms; RoPE may cover only the first dims of a
head (partial rotary: cos/sin narrower than the head).
"""
from __future__ import annotations

import torch
from torch import nn

from verispec.cache.kv import KVCache, LayerCacheSpec
from verispec.models.layers.attention import cached_attention
from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.rotary import apply_rotary


class GatedAttention(nn.Module):
    """`layer_idx` is the layer's index in the cache it is given."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 layer_idx: int, bias: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps, unit_offset=True)
        self.k_norm = RMSNorm(head_dim, eps, unit_offset=True)
        self.scale = head_dim ** -0.5

    def cache_spec(self) -> LayerCacheSpec:
        return LayerCacheSpec(self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None) -> torch.Tensor:  # x: [B, T, H]; cos/sin: [B, T, rotary_dim]
        b, t, _ = x.shape
        q, gate = self.q_proj(x).view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(b, t, self.num_heads * self.head_dim)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = cached_attention(q, k, v, cache, self.layer_idx, mask, self.scale)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out * torch.sigmoid(gate))
