"""The Llama family: llama, mistral, qwen2, qwen3 (one decoder, switched by config).

Differences handled here: GQA, tied/untied embeddings, Qwen2's q/k/v bias, Qwen3's per-head
q/k RMSNorm, Mistral's sliding window, per-layer `layer_types`, RoPE default/linear/llama3.
"""
from __future__ import annotations

import torch
from torch import nn

from verispec.cache.kv import LayerCacheSpec
from verispec.errors import UnsupportedModelError
from verispec.models.base import FoldedDecoderLM
from verispec.models.layers.attention import AttentionInputs, attend
from verispec.models.layers.mlp import GatedMLP
from verispec.models.layers.sparse_moe import MoeSettings
from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.fused import add_rms_norm, fast_add_rms_norm, fast_prepare_qk, merged_linear, prepare_qk
from verispec.models.layers.rotary import RotaryEmbedding, rope_parameters


class DecoderSettings:
    """The config fields the Llama family reads, with each family's defaults."""

    def __init__(self, config: dict):
        model_type = config.get("model_type", "llama")
        self.model_type = model_type
        self.hidden_size = int(config["hidden_size"])
        self.num_layers = int(config["num_hidden_layers"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(config.get("head_dim") or self.hidden_size // self.num_heads)
        self.intermediate_size = int(config["intermediate_size"])
        self.vocab_size = int(config["vocab_size"])
        self.rms_norm_eps = float(config.get("rms_norm_eps", 1e-6))
        self.hidden_act = config.get("hidden_act", "silu")
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.max_position_embeddings = int(config.get("max_position_embeddings", 4096))
        self.qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias", False))
        self.o_bias = model_type != "qwen2" and bool(config.get("attention_bias", False))
        self.mlp_bias = bool(config.get("mlp_bias", False))
        self.qk_norm = model_type == "qwen3"
        self.rope = rope_parameters(config)
        self.windows = self._layer_windows(config)
        # mixture-of-experts families (qwen3_moe.py): which layers have a sparse MoE MLP
        self.moe: MoeSettings | None = None
        self.sparse_layers: frozenset[int] = frozenset()

    def _layer_windows(self, config: dict) -> list[int | None]:
        window = config.get("sliding_window")
        layer_types = config.get("layer_types")
        if self.model_type == "mistral":
            return [window] * self.num_layers
        if layer_types:
            if len(layer_types) != self.num_layers:
                raise UnsupportedModelError(
                    f"layer_types has {len(layer_types)} entries for {self.num_layers} layers")
            for t in layer_types:
                if t not in ("full_attention", "sliding_attention"):
                    raise UnsupportedModelError(
                        f"layer type '{t}' is not supported for {self.model_type} "
                        "(supported: full_attention, sliding_attention)")
            return [window if t == "sliding_attention" else None for t in layer_types]
        if config.get("use_sliding_window") and window:
            first = int(config.get("max_window_layers", 0))
            return [window if i >= first else None for i in range(self.num_layers)]
        return [None] * self.num_layers


class Attention(nn.Module):
    def __init__(self, s: DecoderSettings, layer_idx: int, input_size: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        d_in = input_size or s.hidden_size  # EAGLE3's drafter attends from [embedding, hidden] (2H)
        self.q_proj = nn.Linear(d_in, s.num_heads * s.head_dim, bias=s.qkv_bias)
        self.k_proj = nn.Linear(d_in, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.v_proj = nn.Linear(d_in, s.num_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=s.o_bias)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = s.head_dim ** -0.5
        self.window = s.windows[layer_idx] if layer_idx < len(s.windows) else None
        self.prepare_qk = prepare_qk
        self.qkv_proj: nn.Linear | None = None  # set by merge_projections()
        self.eps = s.rms_norm_eps

    def merge_projections(self) -> None:
        """q, k and v projections as one GEMM (the separate weights are released)."""
        if self.qkv_proj is None:
            self.qkv_proj = merged_linear(self.q_proj, self.k_proj, self.v_proj)
            del self.q_proj, self.k_proj, self.v_proj

    def fuse(self) -> None:
        self.prepare_qk = fast_prepare_qk

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                inputs: AttentionInputs) -> torch.Tensor:  # x: [B, T, H]
        b, t, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        if self.prepare_qk is fast_prepare_qk and (rows := inputs.kv_destination(self.layer_idx)) is not None:
            # the keys and values go into the cache in the same launch (one kernel a layer fewer)
            q, k = fast_prepare_qk(q, k, cos, sin, *norms, self.eps, False, v=v, cache_rows=rows)
            out = attend(q, k, v, inputs, self.layer_idx, self.window, self.scale, written=True)
        else:
            q, k = self.prepare_qk(q, k, cos, sin, *norms, self.eps, False)
            out = attend(q, k, v, inputs, self.layer_idx, self.window, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, s: DecoderSettings, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s, layer_idx)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        if layer_idx in s.sparse_layers:
            self.mlp = s.moe.block(s.hidden_size, s.hidden_act)
        else:
            self.mlp = GatedMLP(s.hidden_size, s.intermediate_size, s.hidden_act, s.mlp_bias)
        self.add_norm = add_rms_norm

    def fuse(self) -> None:
        self.add_norm = fast_add_rms_norm

    def forward(self, x: torch.Tensor, update: torch.Tensor | None, cos, sin, inputs: AttentionInputs
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: residual stream [B, T, H]; update: the previous layer's MLP output, not yet added
        (None for the first layer) — adding it here, fused with this layer's input norm, saves a
        kernel per layer. Returns (residual stream, this layer's MLP output, not yet added)."""
        n = self.input_layernorm
        if update is None:
            h = n(x)
        else:
            x, h = self.add_norm(x, update, n.weight, n.eps, n.unit_offset)
        p = self.post_attention_layernorm
        x, h = self.add_norm(x, self.self_attn(h, cos, sin, inputs), p.weight, p.eps, p.unit_offset)
        return x, self.mlp(h)


class DecoderModel(nn.Module):
    def __init__(self, s: DecoderSettings):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class LlamaForCausalLM(FoldedDecoderLM):
    def __init__(self, config: dict):
        super().__init__()
        s = self._settings(config)
        self.config, self.settings = config, s
        self.vocab_size = s.vocab_size
        self.max_position_embeddings = s.max_position_embeddings
        self.model = DecoderModel(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(s.rope, s.head_dim)
        self.num_layers = s.num_layers

    @staticmethod
    def _settings(config: dict) -> DecoderSettings:
        return DecoderSettings(config)

    def cache_specs(self) -> list[LayerCacheSpec]:
        s = self.settings
        return [LayerCacheSpec(s.num_kv_heads, s.head_dim) for _ in range(s.num_layers)]
