"""Gemma 3: the text models (1B-27B) and the text part of the multimodal checkpoints.

Two model_types share one decoder:
- `gemma3_text` (Gemma3ForCausalLM): weights at `model.*`;
- `gemma3` (Gemma3ForConditionalGeneration): config under `text_config`, text weights at
  `model.language_model.*` (transformers 5) or `language_model.model.*` (the released files); the
  vision tower and the multimodal projector are skipped by the loader (one debug line).

Per layer (`layer_types`, default 5 sliding then 1 full): sliding layers attend to the last
`sliding_window` positions with their own RoPE base (`rope_local_base_freq`, 1e4), full layers to
everything with theta 1e6 (and linear scaling x8 on the 4B-27B). Norms are RMSNorm applied as
(1 + w) in float32; q and k are RMS-normed per head; the attention scale is
query_pre_attn_scalar^-0.5 (not head_dim^-0.5: they differ on the 27B).

    x = embed(ids) * sqrt(H)                           (the scale rounded to the weights' dtype)
    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    x = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))   (gelu-tanh(gate) * up)
    logits = lm_head(norm(x)), capped as cap * tanh(logits / cap) when final_logit_softcapping is set

The residual stream captured for layer k (`capture`, EAGLE3's aux features) is x entering layer k
(transformers' hidden_states[k]).
"""
from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from verispec.cache.kv import KVCache, LayerCacheSpec
from verispec.errors import UnsupportedModelError
from verispec.models.base import ForwardOutput, HFLayoutLM
from verispec.models.gemma4 import scaled_embedding
from verispec.models.layers.attention import AttentionInputs, attend
from verispec.models.layers.fused import fast_prepare_qk, merged_linear, prepare_qk
from verispec.models.layers.mlp import GatedMLP
from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.rotary import RotaryEmbedding

# transformers 5 keeps the text weights of the multimodal model under model.language_model.*; the
# released (transformers 4) files under language_model.model.* with lm_head beside it.
TEXT_PREFIX_MAP = {"model.language_model.": "model.", "language_model.model.": "model.",
                   "language_model.lm_head.": "lm_head."}
IGNORED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


class LayerType(str, Enum):
    SLIDING = "sliding_attention"
    FULL = "full_attention"


SUPPORTED_ROPE_TYPES = ("default", "linear")
# transformers' Gemma3TextConfig: theta of full layers (rope_theta) and of sliding ones (rope_local_base_freq)
DEFAULT_THETA = {LayerType.FULL: 1_000_000.0, LayerType.SLIDING: 10_000.0}
DEFAULT_SLIDING_WINDOW_PATTERN = 6


class Gemma3Settings:
    """The text-config fields Gemma 3 reads; defaults are those of transformers' Gemma3TextConfig
    (the released multimodal configs leave most of them out)."""

    def __init__(self, c: dict, tie_word_embeddings: bool | None = None):
        self.hidden_size = int(c.get("hidden_size", 2304))
        self.num_layers = int(c.get("num_hidden_layers", 26))
        self.num_heads = int(c.get("num_attention_heads", 8))
        self.num_kv_heads = int(c.get("num_key_value_heads", 4))
        self.head_dim = int(c.get("head_dim", 256))
        self.intermediate_size = int(c.get("intermediate_size", 9216))
        self.vocab_size = int(c.get("vocab_size", 262_208))
        self.rms_norm_eps = float(c.get("rms_norm_eps", 1e-6))
        self.hidden_act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        self.max_position_embeddings = int(c.get("max_position_embeddings", 131_072))
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(c.get("tie_word_embeddings", True))
        self.tie_word_embeddings = tie_word_embeddings
        self.attention_bias = bool(c.get("attention_bias", False))
        self.query_pre_attn_scalar = float(c.get("query_pre_attn_scalar", 256))
        cap = c.get("final_logit_softcapping")
        self.final_logit_softcapping = float(cap) if cap else None
        if c.get("attn_logit_softcapping"):
            raise UnsupportedModelError("Gemma 3 attn_logit_softcapping is not supported (the released Gemma 3 "
                                        "configs have null; supported: null)")
        if c.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention (non-causal text attention) is not supported "
                                        "for Gemma 3 (supported: false)")
        self.sliding_window = int(c.get("sliding_window") or 4096)
        self.layer_types = self._layer_types(c)
        self.windows = [self.sliding_window if t is LayerType.SLIDING else None for t in self.layer_types]
        self.rope = {t: self._rope(c, t) for t in dict.fromkeys(self.layer_types)}

    def _layer_types(self, c: dict) -> list[LayerType]:
        names = c.get("layer_types")
        if not names:
            pattern = int(c.get("sliding_window_pattern") or DEFAULT_SLIDING_WINDOW_PATTERN)
            names = [LayerType.FULL.value if (i + 1) % pattern == 0 else LayerType.SLIDING.value
                     for i in range(self.num_layers)]
        if len(names) != self.num_layers:
            raise UnsupportedModelError(f"layer_types has {len(names)} entries for {self.num_layers} layers")
        out = []
        for name in names:
            try:
                out.append(LayerType(name))
            except ValueError:
                raise UnsupportedModelError(f"layer type '{name}' is not supported for Gemma 3 "
                                            f"(supported: {', '.join(t.value for t in LayerType)})") from None
        return out

    def _rope(self, c: dict, layer_type: LayerType) -> dict:
        """The RoPE parameters of one layer type, from either config spelling: transformers 5's
        `rope_parameters` per layer type, or the released configs' `rope_theta` (full layers),
        `rope_local_base_freq` (sliding layers) and `rope_scaling` (full layers only)."""
        params = c.get("rope_parameters") or {}
        if layer_type.value in params:
            p = dict(params[layer_type.value] or {})
        elif params and ("rope_type" in params or "rope_theta" in params):
            raise UnsupportedModelError("Gemma 3 rope_parameters must be given per layer type "
                                        "({'sliding_attention': {...}, 'full_attention': {...}})")
        else:
            p = {}
            if layer_type is LayerType.FULL:
                p.update(c.get("rope_scaling") or {})
                if "rope_theta" in c:
                    p["rope_theta"] = c["rope_theta"]
            elif "rope_local_base_freq" in c:
                p["rope_theta"] = c["rope_local_base_freq"]
        if "type" in p and "rope_type" not in p:
            p["rope_type"] = p.pop("type")
        p.setdefault("rope_type", "default")
        p.setdefault("rope_theta", DEFAULT_THETA[layer_type])
        if p["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"RoPE type '{p['rope_type']}' on Gemma 3 {layer_type.value} layers is not "
                                        f"supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        return p


class Gemma3Attention(nn.Module):
    def __init__(self, s: Gemma3Settings, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = s.layer_types[layer_idx]
        self.window = s.windows[layer_idx]
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        h, d, bias = s.hidden_size, s.head_dim, s.attention_bias
        self.q_proj = nn.Linear(h, s.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, s.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, s.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(s.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, s.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(d, s.rms_norm_eps, unit_offset=True)
        self.scale = s.query_pre_attn_scalar ** -0.5
        self.eps = s.rms_norm_eps
        self.prepare_qk = prepare_qk
        self.qkv_proj: nn.Linear | None = None  # set by merge_projections()

    def merge_projections(self) -> None:
        """q, k and v projections as one GEMM (the separate weights are released)."""
        if self.qkv_proj is None:
            self.qkv_proj = merged_linear(self.q_proj, self.k_proj, self.v_proj)
            del self.q_proj, self.k_proj, self.v_proj

    def fuse(self) -> None:
        self.prepare_qk = fast_prepare_qk

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                inputs: AttentionInputs) -> torch.Tensor:  # x: [B, T, H]; cos/sin [B, T, D]
        b, t, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.prepare_qk(q, k, cos, sin, self.q_norm.weight, self.k_norm.weight, self.eps, True)
        out = attend(q, k, v, inputs, self.layer_idx, self.window, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, s: Gemma3Settings, layer_idx: int):
        super().__init__()
        h, eps = s.hidden_size, s.rms_norm_eps
        self.self_attn = Gemma3Attention(s, layer_idx)
        self.mlp = GatedMLP(h, s.intermediate_size, s.hidden_act)
        self.input_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                inputs: AttentionInputs) -> torch.Tensor:  # x: [B, T, H]
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, inputs))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3TextModel(nn.Module):
    def __init__(self, s: Gemma3Settings):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(s, i) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, unit_offset=True)


class Gemma3ForCausalLM(HFLayoutLM):
    """model_type `gemma3_text`."""

    checkpoint_prefix_map = TEXT_PREFIX_MAP
    ignored_prefixes = IGNORED_PREFIXES

    def __init__(self, config: dict):
        super().__init__()
        s = self._settings(config)
        self.config, self.settings = config, s
        self.vocab_size = s.vocab_size
        self.num_layers = s.num_layers
        self.max_position_embeddings = s.max_position_embeddings
        self.model = Gemma3TextModel(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.rotary = nn.ModuleDict({t.value: RotaryEmbedding(p, s.head_dim) for t, p in s.rope.items()})
        self.embed_scale = s.hidden_size ** 0.5

    @staticmethod
    def _settings(config: dict) -> Gemma3Settings:
        return Gemma3Settings(config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled embedding the first layer sees: [B, T] -> [B, T, H] (input_embeddings() is
        the raw table, which EAGLE3 drafters share unscaled)."""
        return scaled_embedding(self.model.embed_tokens, input_ids, self.embed_scale)

    def cache_specs(self) -> list[LayerCacheSpec]:
        s = self.settings
        return [LayerCacheSpec(s.num_kv_heads, s.head_dim) for _ in range(s.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                capture: tuple[int, ...] = ()) -> ForwardOutput:
        """input_ids, positions: [B, T]; returns final hidden [B, T, H] and captured streams."""
        x = self.embed(input_ids)
        rope = {t: self.rotary[t](positions, x.dtype) for t in self.rotary}
        inputs = AttentionInputs(positions, cache)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture:
                captured[i] = x
            cos, sin = rope[layer.self_attn.layer_type.value]
            x = layer(x, cos, sin, inputs)
        return ForwardOutput(self.model.norm(x), [captured[i] for i in capture], pre_norm=x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.settings.final_logit_softcapping
        if cap is not None and logits is not None:  # None: a tensor-parallel worker (rank 0 has the logits)
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """model_type `gemma3`: the text model of the multimodal checkpoint (vision tower ignored)."""

    @staticmethod
    def _settings(config: dict) -> Gemma3Settings:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedModelError("a gemma3 config needs a `text_config` object (the language model's config)")
        return Gemma3Settings(text, tie_word_embeddings=bool(config.get("tie_word_embeddings", True)))
