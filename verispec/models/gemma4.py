"""Gemma 4 (see shared/reference/gemma4.md): the dense (31B) and MoE (26B-A4B) text models, and
the small E-series features (per-layer inputs, shared KV, double-wide MLP).

Two model_types share one decoder:
- `gemma4_text` (Gemma4ForCausalLM): text weights at `model.*`;
- `gemma4` (the multimodal Gemma4ForConditionalGeneration): config under `text_config`, text
  weights at `model.language_model.*`; the vision/audio towers and their embedders are skipped
  by the loader (one debug line). Whether lm_head is tied follows the top-level flag there.

Per layer (`layer_types`): sliding layers (window mask over the full cache, RoPE theta 1e4 over the
whole head) and full layers (their own head_dim / kv-head count from `per_layer_config`, or
`global_head_dim` / `num_global_key_value_heads` in the released configs; "proportional" RoPE;
with `attention_k_eq_v` no v_proj: v = v_norm(k_proj x) before k_norm and RoPE). Attention scale
1.0 (q and k are RMS-normed per head). Norms are weight-only RMSNorm (x * w, not 1 + w) in float32.

    x = embed(ids) * sqrt(H)
    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    m = mlp(pre_feedforward_layernorm(h))                      (gelu-tanh(gate) * up)
    MoE: m = post_feedforward_layernorm_1(m)
             + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), router(h)))
    x = h + post_feedforward_layernorm(m)
    per-layer inputs: x = x + post_per_layer_input_norm(proj(act(gate(x)) * ple_i))
    x = x * layer_scalar
    logits = cap * tanh(lm_head(norm(x)) / cap)

The residual stream captured for layer k (`capture`) is x entering layer k, i.e. after layer k-1's
layer_scalar (transformers' hidden_states[k]).
"""
from __future__ import annotations

import functools
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from verispec import log
from verispec.cache.kv import KVCache, LayerCacheSpec
from verispec.errors import UnsupportedModelError
from verispec.kernels import expert_gemv
from verispec.models.base import ForwardOutput, HFLayoutLM
from verispec.models.layers.attention import AttentionInputs, attend, attend_cached
from verispec.models.layers.fused import compiled, compiled_rows, merged_linear
from verispec.models.layers.mlp import GatedMLP, activation
from verispec.models.layers.moe import FusedExperts
from verispec.models.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_pair

# The multimodal checkpoints keep the text weights under `model.language_model.*`.
TEXT_PREFIX_MAP = {"model.language_model.": "model."}
IGNORED_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


class LayerType(str, Enum):
    SLIDING = "sliding_attention"
    FULL = "full_attention"


# transformers' Gemma4TextConfig defaults
DEFAULT_ROPE = {
    LayerType.SLIDING.value: {"rope_type": "default", "rope_theta": 10_000.0},
    LayerType.FULL.value: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
SUPPORTED_ROPE_TYPES = ("default", "proportional")
PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


class Gemma4Settings:
    """The text-config fields Gemma 4 reads; defaults are those of transformers' Gemma4TextConfig."""

    def __init__(self, c: dict, tie_word_embeddings: bool | None = None, kv_sources: list[int | None] | None = None):
        """`kv_sources` overrides which cache layer each layer attends over (None: its own K/V),
        for drafters whose layers all read a backbone's cache (the Gemma 4 assistant)."""
        self.hidden_size = int(c.get("hidden_size", 2304))
        self.num_layers = int(c.get("num_hidden_layers", 30))
        self.num_heads = int(c.get("num_attention_heads", 8))
        self.intermediate_size = int(c.get("intermediate_size", 9216))
        self.vocab_size = int(c.get("vocab_size", 262_144))
        self.rms_norm_eps = float(c.get("rms_norm_eps", 1e-6))
        self.hidden_act = c.get("hidden_activation") or "gelu_pytorch_tanh"
        self.max_position_embeddings = int(c.get("max_position_embeddings", 131_072))
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(c.get("tie_word_embeddings", True))
        self.tie_word_embeddings = tie_word_embeddings
        self.attention_bias = bool(c.get("attention_bias", False))
        self.sliding_window = int(c.get("sliding_window", 512))
        cap = c.get("final_logit_softcapping")
        self.final_logit_softcapping = float(cap) if cap else None
        self.attention_k_eq_v = bool(c.get("attention_k_eq_v", False))
        if c.get("use_bidirectional_attention") == "all":
            raise UnsupportedModelError("use_bidirectional_attention: 'all' (non-causal text attention) is not "
                                        "supported for Gemma 4 (supported: null, 'vision')")
        self.layer_types = self._layer_types(c)
        self.windows = [self.sliding_window if t is LayerType.SLIDING else None for t in self.layer_types]
        self.num_kv_heads, self.head_dims = self._attention_shapes(c)
        self.rope = {t: self._rope(c, t) for t in dict.fromkeys(self.layer_types)}
        # Mixture of experts, in every layer beside the dense MLP
        self.enable_moe = bool(c.get("enable_moe_block", False))
        if self.enable_moe:
            missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not c.get(k)]
            if missing:
                raise UnsupportedModelError(f"enable_moe_block is set but {', '.join(missing)} is missing")
            self.num_experts = int(c["num_experts"])
            self.top_k_experts = int(c["top_k_experts"])
            self.moe_intermediate_size = int(c["moe_intermediate_size"])
        # Per-layer inputs (E-series): a second embedding feeding every layer
        self.per_layer_input_size = int(c.get("hidden_size_per_layer_input", 256) or 0)
        self.per_layer_vocab_size = int(c.get("vocab_size_per_layer_input", 262_144))
        # Shared KV (E-series): the last num_kv_shared_layers layers read the K/V of the last
        # earlier layer of their type instead of computing their own
        num_shared = int(c.get("num_kv_shared_layers", 0) or 0)
        first_shared = self.num_layers - num_shared
        if kv_sources is not None and len(kv_sources) != self.num_layers:
            raise ValueError(f"kv_sources has {len(kv_sources)} entries for {self.num_layers} layers")
        self.kv_sources = list(kv_sources) if kv_sources is not None else self._kv_sources(first_shared)
        double_wide = bool(c.get("use_double_wide_mlp", False))
        self.mlp_sizes = [self.intermediate_size * (2 if double_wide and i >= first_shared > 0 else 1)
                          for i in range(self.num_layers)]

    def _layer_types(self, c: dict) -> list[LayerType]:
        names = c.get("layer_types")
        if not names:  # 5 sliding then 1 full, repeated
            names = [LayerType.FULL.value if (i + 1) % 6 == 0 else LayerType.SLIDING.value
                     for i in range(self.num_layers)]
        if len(names) != self.num_layers:
            raise UnsupportedModelError(f"layer_types has {len(names)} entries for {self.num_layers} layers")
        out = []
        for name in names:
            try:
                out.append(LayerType(name))
            except ValueError:
                raise UnsupportedModelError(f"layer type '{name}' is not supported for Gemma 4 "
                                            f"(supported: {', '.join(t.value for t in LayerType)})") from None
        if out[-1] is not LayerType.FULL:
            log.warning("Gemma 4: the last layer must be full attention; treating it as such, as transformers does")
            out[-1] = LayerType.FULL
        return out

    def _attention_shapes(self, c: dict) -> tuple[list[int], list[int]]:
        """Per layer (kv heads, head_dim): the global values, overridden for full layers."""
        kv_heads, head_dim = int(c.get("num_key_value_heads", 4)), int(c.get("head_dim", 256))
        if "per_layer_config" in c:  # what transformers >= 5.17 saves: sparse per-layer overrides
            overrides = {}
            for key, fields in (c["per_layer_config"] or {}).items():
                unknown = sorted(set(fields) - set(PER_LAYER_FIELDS))
                if unknown:
                    raise UnsupportedModelError(f"per_layer_config overrides {', '.join(unknown)} for layer {key}; "
                                                f"Gemma 4 supports per-layer {', '.join(PER_LAYER_FIELDS)} only")
                overrides[int(key)] = fields
        else:  # the released configs: global_head_dim / num_global_key_value_heads for full layers
            full = {"head_dim": int(c.get("global_head_dim", 512))}
            if self.attention_k_eq_v and c.get("num_global_key_value_heads") is not None:
                full["num_key_value_heads"] = int(c["num_global_key_value_heads"])
            overrides = {i: full for i, t in enumerate(self.layer_types) if t is LayerType.FULL}
        kv = [int(overrides.get(i, {}).get("num_key_value_heads", kv_heads)) for i in range(self.num_layers)]
        dims = [int(overrides.get(i, {}).get("head_dim", head_dim)) for i in range(self.num_layers)]
        for t in LayerType:
            type_dims = {d for d, lt in zip(dims, self.layer_types) if lt is t}
            if len(type_dims) > 1:
                raise UnsupportedModelError(f"Gemma 4 {t.value} layers with different head dims {sorted(type_dims)} "
                                            "are not supported (one RoPE per layer type)")
        return kv, dims

    def head_dim_of(self, layer_type: LayerType) -> int:
        return self.head_dims[self.layer_types.index(layer_type)]

    def _rope(self, c: dict, layer_type: LayerType) -> dict:
        params = c.get("rope_parameters") or DEFAULT_ROPE
        if "rope_type" in params or "rope_theta" in params:
            raise UnsupportedModelError("Gemma 4 rope_parameters must be given per layer type "
                                        "({'sliding_attention': {...}, 'full_attention': {...}})")
        p = params.get(layer_type.value)
        if not p:
            raise UnsupportedModelError(f"Gemma 4 rope_parameters has no entry for {layer_type.value} layers")
        p = dict(p)
        p.setdefault("rope_type", "default")
        if p["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"RoPE type '{p['rope_type']}' on Gemma 4 {layer_type.value} layers is not "
                                        f"supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        p.setdefault("rope_theta", 10_000.0)
        return p

    def _kv_sources(self, first_shared: int) -> list[int | None]:
        """Per layer: None (own K/V) or the layer whose cache rows it attends over."""
        if not 0 <= first_shared < self.num_layers:
            return [None] * self.num_layers
        owners = self.layer_types[:first_shared]
        sources: list[int | None] = [None] * first_shared
        for i in range(first_shared, self.num_layers):
            t = self.layer_types[i]
            if t not in owners:
                raise UnsupportedModelError(f"Gemma 4 layer {i} shares the K/V of an earlier {t.value} layer, "
                                            f"but none of layers 0..{first_shared - 1} is one")
            sources.append(len(owners) - 1 - owners[::-1].index(t))
        return sources


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] -> x * (mean(x^2) + eps)^-0.5 [* w], in float32 (float64 stays), as transformers'
    Gemma4RMSNorm computes it (the weight applied in float32 before casting back)."""
    dtype = x.dtype
    h = x.float() if dtype != torch.float64 else x
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        h = h * weight.to(h.dtype)
    return h.to(dtype)


class Gemma4RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.eps = eps
        self.impl = gemma_rms_norm

    def fuse(self) -> None:
        self.impl = compiled_rows(gemma_rms_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return self.impl(x, self.weight, self.eps)


def scaled_embedding(table: nn.Embedding, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Gemma's scaled embedding: the scale is a float32 value rounded to the table's dtype first
    (bf16: sqrt(5376) -> 73.5). A Python number, not a tensor: no host-to-device copy per step.
    The rows' dtype, not the table's: a quantized table holds packed integers."""
    rows = table(ids)
    return rows * _rounded(scale, rows.dtype)


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


class Gemma4Attention(nn.Module):
    def __init__(self, s: Gemma4Settings, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = s.layer_types[layer_idx]
        self.window = s.windows[layer_idx]
        self.num_heads, self.num_kv_heads = s.num_heads, s.num_kv_heads[layer_idx]
        self.head_dim = s.head_dims[layer_idx]
        self.kv_source = s.kv_sources[layer_idx]
        self.eps = s.rms_norm_eps
        h, d, bias = s.hidden_size, self.head_dim, s.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.q_norm = Gemma4RMSNorm(d, s.rms_norm_eps)
        # full layers with attention_k_eq_v have no v_proj: v is the k projection (normed apart)
        self.k_eq_v = s.attention_k_eq_v and self.layer_type is LayerType.FULL
        if self.kv_source is None:
            self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
            self.k_norm = Gemma4RMSNorm(d, s.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(d, s.rms_norm_eps, with_scale=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.rotary_pair = apply_rotary_pair
        self.qkv_proj: nn.Linear | None = None  # set by merge_projections()
        self.qkv_sizes: list[int] = []

    def merge_projections(self) -> None:
        """q, k (and v) projections as one GEMM (the separate weights are released)."""
        if self.qkv_proj is None and self.kv_source is None:
            parts = [self.q_proj, self.k_proj] + ([] if self.k_eq_v else [self.v_proj])
            self.qkv_sizes = [p.out_features for p in parts]
            self.qkv_proj = merged_linear(*parts)
            del self.q_proj, self.k_proj
            if not self.k_eq_v:
                del self.v_proj

    def fuse(self) -> None:
        self.rotary_pair = compiled(apply_rotary_pair)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                inputs: AttentionInputs) -> torch.Tensor:  # x: [B, T, H]; cos/sin [B, T, D]
        b, t, _ = x.shape
        if self.kv_source is not None:
            q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
            q = apply_rotary(q, cos, sin)
            out = attend_cached(q, inputs, self.kv_source, self.window, 1.0)
        else:
            if self.qkv_proj is not None:
                q, k, *v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
                v = v[0] if v else k
            else:
                q, k = self.q_proj(x), self.k_proj(x)
                v = k if self.k_eq_v else self.v_proj(x)
            q = self.q_norm(q.view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
            k = self.k_norm(k.view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
            v = self.v_norm(v.view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
            q, k = self.rotary_pair(q, k, cos, sin)
            out = attend(q, k, v, inputs, self.layer_idx, self.window, 1.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def cache_spec(self) -> LayerCacheSpec:
        # a layer reading another layer's K/V keeps none of its own (zero heads: no memory)
        return LayerCacheSpec(0 if self.kv_source is not None else self.num_kv_heads, self.head_dim)


class Gemma4Router(nn.Module):
    """proj(rmsnorm(h) * scale * H^-0.5) -> softmax (float32) -> top-k -> renormalised -> times
    per_expert_scale of the chosen experts."""

    def __init__(self, s: Gemma4Settings):
        super().__init__()
        self.top_k = s.top_k_experts
        self.eps = s.rms_norm_eps
        self.root_size = s.hidden_size ** -0.5
        self.proj = nn.Linear(s.hidden_size, s.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(s.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(s.num_experts))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, H] -> (weights [N, K] float32 (or wider), expert ids [N, K])."""
        x = gemma_rms_norm(h, None, self.eps) * self.scale * self.root_size
        logits = self.proj(x)
        if expert_gemv.available(logits.device) and logits.dtype != torch.float64:  # one kernel on CUDA
            return expert_gemv.softmax_top_k(logits, self.top_k, True, self.per_expert_scale, torch.float32)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, s: Gemma4Settings, layer_idx: int):
        super().__init__()
        h, eps = s.hidden_size, s.rms_norm_eps
        self.self_attn = Gemma4Attention(s, layer_idx)
        self.mlp = GatedMLP(h, s.mlp_sizes[layer_idx], s.hidden_act)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.enable_moe = s.enable_moe
        if s.enable_moe:
            self.router = Gemma4Router(s)
            self.experts = FusedExperts(s.num_experts, h, s.moe_intermediate_size, s.hidden_act)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
        self.has_per_layer_input = bool(s.per_layer_input_size)
        if self.has_per_layer_input:
            self.act = activation(s.hidden_act)
            self.per_layer_input_gate = nn.Linear(h, s.per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(s.per_layer_input_size, h, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                inputs: AttentionInputs) -> torch.Tensor:  # x: [B, T, H]; per_layer_input [B, T, P]
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, inputs))
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.enable_moe:
            flat = h.reshape(-1, h.shape[-1])
            weights, index = self.router(flat)  # routed on h itself, not on a normed copy
            routed = self.experts(self.pre_feedforward_layernorm_2(flat), index, weights).reshape(h.shape)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(routed)
        x = h + self.post_feedforward_layernorm(m)
        if self.has_per_layer_input:
            g = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4TextModel(nn.Module):
    def __init__(self, s: Gemma4Settings):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(s, i) for i in range(s.num_layers))
        self.norm = Gemma4RMSNorm(s.hidden_size, s.rms_norm_eps)
        if s.per_layer_input_size:
            p = s.per_layer_input_size
            self.embed_tokens_per_layer = nn.Embedding(s.per_layer_vocab_size, s.num_layers * p)
            self.per_layer_model_projection = nn.Linear(s.hidden_size, s.num_layers * p, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(p, s.rms_norm_eps)


class Gemma4ForCausalLM(HFLayoutLM):
    """model_type `gemma4_text`."""

    checkpoint_prefix_map = TEXT_PREFIX_MAP
    ignored_prefixes = IGNORED_PREFIXES

    def __init__(self, config: dict):
        super().__init__()
        s = self._settings(config)
        self.config, self.settings = config, s
        self.vocab_size = s.vocab_size
        self.num_layers = s.num_layers
        self.max_position_embeddings = s.max_position_embeddings
        self.model = Gemma4TextModel(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.rotary = nn.ModuleDict({t.value: RotaryEmbedding(s.rope[t], s.head_dim_of(t)) for t in s.rope})
        self.embed_scale = s.hidden_size ** 0.5

    @staticmethod
    def _settings(config: dict) -> Gemma4Settings:
        return Gemma4Settings(config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled embedding the first layer sees: [B, T] -> [B, T, H] (input_embeddings() is
        the raw table)."""
        return scaled_embedding(self.model.embed_tokens, input_ids, self.embed_scale)

    def cache_specs(self) -> list[LayerCacheSpec]:
        return [layer.self_attn.cache_spec() for layer in self.model.layers]

    def kv_owner_layer(self, layer_type: LayerType | str) -> int:
        """The last layer of this type that computes its own K/V (31B: 58 sliding, 59 full): whose
        cache rows the Gemma 4 assistant drafter reads."""
        t = LayerType(layer_type)
        s = self.settings
        owners = [i for i, lt in enumerate(s.layer_types) if lt is t and s.kv_sources[i] is None]
        if not owners:
            raise UnsupportedModelError(f"this Gemma 4 model has no {t.value} layer with its own K/V")
        return owners[-1]

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[B, T] ids and their scaled embeddings [B, T, H] -> [B, T, L, P]: a per-layer token
        embedding (scaled by sqrt(P)) plus a normed projection of the embedding, times 2^-0.5."""
        m, s = self.model, self.settings
        p = s.per_layer_input_size
        tokens = scaled_embedding(m.embed_tokens_per_layer, input_ids, p ** 0.5).reshape(*input_ids.shape, s.num_layers, p)
        proj = m.per_layer_model_projection(embeds) * s.hidden_size ** -0.5
        proj = m.per_layer_projection_norm(proj.reshape(*embeds.shape[:-1], s.num_layers, p))
        return (proj + tokens) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                capture: tuple[int, ...] = ()) -> ForwardOutput:
        """input_ids, positions: [B, T]; returns final hidden [B, T, H] and captured streams."""
        x = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x) if self.settings.per_layer_input_size else None
        rope = {t: self.rotary[t](positions, x.dtype) for t in self.rotary}
        inputs = AttentionInputs(positions, cache)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture:
                captured[i] = x
            cos, sin = rope[layer.self_attn.layer_type.value]
            x = layer(x, per_layer[:, :, i] if per_layer is not None else None, cos, sin, inputs)
        return ForwardOutput(self.model.norm(x), [captured[i] for i in capture], pre_norm=x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.settings.final_logit_softcapping
        if cap is not None and logits is not None:  # None: a tensor-parallel worker (rank 0 has the logits)
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """model_type `gemma4`: the text model of the multimodal checkpoint."""

    @staticmethod
    def _settings(config: dict) -> Gemma4Settings:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedModelError("a gemma4 config needs a `text_config` object (the language model's config)")
        return Gemma4Settings(text, tie_word_embeddings=bool(config.get("tie_word_embeddings", True)))
