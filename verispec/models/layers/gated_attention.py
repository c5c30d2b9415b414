"""Gated full attention (Qwen3.5 / Qwen3-Next): o_proj(attn * sigmoid(gate)), with HF weight names.

q_proj gives [.., heads, 2 * head_dim]: per head, the first half is the query and the second the
output gate. q_norm/k_norm are per-head (1 + w) RMSNorms; RoPE may cover only the first dims of a
head (partial rotary: cos/sin narrower than the head).
"""
from __future__ import annotations

import torch
from torch import nn

from verispec.cache.kv import LayerCacheSpec
from verispec.models.layers.attention import AttentionInputs, attend
from verispec.models.layers.fused import compiled_rows, fast_prepare_qk, merged_linear, prepare_qk, sigmoid_gate
from verispec.models.layers.norm import RMSNorm


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
        self.eps = eps
        self.qkv_proj: nn.Linear | None = None  # set by merge_projections()
        self.prepare_qk = prepare_qk
        self.gate = sigmoid_gate

    def cache_spec(self) -> LayerCacheSpec:
        return LayerCacheSpec(self.num_kv_heads, self.head_dim)

    def merge_projections(self) -> None:
        """q(+gate), k and v projections as one GEMM (the separate weights are released)."""
        if self.qkv_proj is None:
            self.qkv_proj = merged_linear(self.q_proj, self.k_proj, self.v_proj)
            del self.q_proj, self.k_proj, self.v_proj

    def fuse(self) -> None:
        self.prepare_qk = fast_prepare_qk
        self.gate = compiled_rows(sigmoid_gate)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                inputs: AttentionInputs) -> torch.Tensor:  # x: [B, T, H]; cos/sin: [B, T, rotary_dim]
        b, t, _ = x.shape
        hd = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([2 * hd, kv, kv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = q.view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(b, t, hd)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.prepare_qk(q, k, cos, sin, self.q_norm.weight, self.k_norm.weight, self.eps,
                                self.q_norm.unit_offset)  # (1 + w), unless an MLX-converted head stores 1 + w
        out = attend(q, k, v, inputs, self.layer_idx, None, self.scale)
        return self.o_proj(self.gate(out.transpose(1, 2).reshape(b, t, hd), gate))
