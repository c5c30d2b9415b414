"""Qwen3.5 / Qwen3.6: hybrid Gated DeltaNet + gated full attention (see shared/reference/qwen3_5-mtp.md).

Four model_types share one decoder:
- `qwen3_5_text` (Qwen3_5ForCausalLM): text weights at `model.*`, `lm_head.*`;
- `qwen3_5` (the multimodal Qwen3_5ForConditionalGeneration): config under `text_config`, text
  weights at `model.language_model.*`, `lm_head.*`; the vision tower (`model.visual.*`) and the
  MTP head (`mtp.*`) are not used here and are skipped by the loader (one debug line);
- `qwen3_5_moe_text`, `qwen3_5_moe` (35B-A3B and the like): the same two layouts with a sparse MoE
  MLP in every layer, MTP head included (layers/sparse_moe.py: softmax top-k renormalised, plus a
  shared expert gated by sigmoid(shared_expert_gate)); experts stacked (`mlp.experts.gate_up_proj`,
  as the releases ship them) or one linear each (as transformers' save_pretrained writes them).

mlx-lm's conversions of all four (mlx-community's Qwen3.5 / 3.6, float or quantized) load as they
are: its names (`language_model.model.*`, experts as `mlp.switch_mlp.*`), its (1 + w) norms stored
with the 1 added, its conv1d kernels as [C, K, 1] (`checkpoint_tensor` undoes the last two).

Layer i is Gated DeltaNet ("linear_attention") or gated full attention per `layer_types`
(older configs: `full_attention_interval`, full attention when (i + 1) % interval == 0). Every
RMSNorm except the GDN output norm scales by (1 + w). RoPE covers the first
partial_rotary_factor * head_dim dims; `mrope_section` only matters for vision positions, and for
text (equal t/h/w positions) it is plain 1-D RoPE.
"""
from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from verispec.cache.kv import LayerCacheSpec, RecurrentLayerSpec
from verispec.errors import UnsupportedModelError
from verispec.models.base import FoldedDecoderLM
from verispec.models.layers.attention import AttentionInputs
from verispec.models.layers.fused import add_rms_norm, fast_add_rms_norm
from verispec.models.layers.gated_attention import GatedAttention
from verispec.models.layers.gated_delta_net import GatedDeltaNet
from verispec.models.layers.mlp import GatedMLP
from verispec.models.layers.norm import RMSNorm
from verispec.models.layers.rotary import RotaryEmbedding, rope_parameters
from verispec.models.layers.sparse_moe import MLX_SWITCH_MLP_RENAMES, MoeSettings

# The multimodal checkpoints (Qwen/Qwen3.5-*, and what transformers saves) keep the text weights
# under `model.language_model.*`; text-only ones under `model.*`, which needs no mapping; mlx-lm's
# conversions (mlx-community's Qwen3.5 / 3.6) under its own module path `language_model.model.*`.
MLX_PREFIX = "language_model."
TEXT_PREFIX_MAP = {"model.language_model.": "model.", "language_model.model.": "model.",
                   "language_model.lm_head.": "lm_head."}
# mlx-lm's RMSNorm multiplies by its weight alone, so its conversions store these (1 + w) norms
# with the 1 added (mlx_lm qwen3_5 `sanitize`); the GDN output norm is a plain w in both.
MLX_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".model.norm.weight",
                     ".q_norm.weight", ".k_norm.weight")
# Not part of the text model: the vision tower and the MTP head (loaded by the MTP proposer).
IGNORED_PREFIXES = ("model.visual.", "mtp.")


class LayerType(str, Enum):
    FULL_ATTENTION = "full_attention"
    LINEAR_ATTENTION = "linear_attention"


# transformers' Qwen3_5MoeTextConfig defaults (Qwen3.5-35B-A3B's)
QWEN3_5_MOE_DEFAULTS = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                        "shared_expert_intermediate_size": 512}

# transformers' legacy layer-type spellings
_LEGACY_LAYER_TYPES = {"attention": LayerType.FULL_ATTENTION, "mamba": LayerType.LINEAR_ATTENTION}


class Qwen3_5Settings:
    """The text-config fields Qwen3.5 reads. Defaults are those of transformers' Qwen3_5TextConfig."""

    def __init__(self, text_config: dict, tie_word_embeddings: bool | None = None, moe: bool = False):
        """`moe`: the *_moe model types, a sparse MoE MLP with a shared expert in every layer."""
        c = text_config
        self.hidden_size = int(c["hidden_size"])
        self.num_layers = int(c["num_hidden_layers"])
        self.num_heads = int(c.get("num_attention_heads", 16))
        self.num_kv_heads = int(c.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(c.get("head_dim") or 256)
        # routing always renormalised (transformers' Qwen3_5MoeTopKRouter has no norm_topk_prob)
        self.moe = MoeSettings.from_config(c, "qwen3_5_moe", QWEN3_5_MOE_DEFAULTS, renormalize=True,
                                           shared=True) if moe else None
        self.intermediate_size = int(c.get("intermediate_size") or 0) if moe else int(c["intermediate_size"])
        self.vocab_size = int(c["vocab_size"])
        self.rms_norm_eps = float(c.get("rms_norm_eps", 1e-6))
        self.hidden_act = c.get("hidden_act", "silu")
        self.attention_bias = bool(c.get("attention_bias", False))
        self.max_position_embeddings = int(c.get("max_position_embeddings", 32768))
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(c.get("tie_word_embeddings", False))
        self.tie_word_embeddings = tie_word_embeddings
        if not c.get("attn_output_gate", True):
            raise UnsupportedModelError("attn_output_gate: false is not supported for Qwen3.5 "
                                        "(its full-attention layers always gate their output)")
        # Gated DeltaNet
        self.linear_num_key_heads = int(c.get("linear_num_key_heads", 16))
        self.linear_num_value_heads = int(c.get("linear_num_value_heads", 32))
        self.linear_key_head_dim = int(c.get("linear_key_head_dim", 128))
        self.linear_value_head_dim = int(c.get("linear_value_head_dim", 128))
        self.linear_conv_kernel_dim = int(c.get("linear_conv_kernel_dim", 4))
        # RoPE: partial_rotary_factor lives in rope_parameters (v5) or at the top level (older)
        rope = rope_parameters(c)
        if rope["rope_type"] == "mrope":  # Qwen2-VL's spelling; text positions make it 1-D RoPE
            rope["rope_type"] = "default"
        self.rope = rope
        partial = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
        self.rotary_dim = int(self.head_dim * partial)
        self.layer_types = self._layer_types(c)

    def _layer_types(self, c: dict) -> list[LayerType]:
        names = c.get("layer_types")
        if not names:
            interval = int(c.get("full_attention_interval", 4))
            return [LayerType.FULL_ATTENTION if (i + 1) % interval == 0 else LayerType.LINEAR_ATTENTION
                    for i in range(self.num_layers)]
        if len(names) != self.num_layers:
            raise UnsupportedModelError(f"layer_types has {len(names)} entries for {self.num_layers} layers")
        out = []
        for name in names:
            try:
                out.append(_LEGACY_LAYER_TYPES.get(name) or LayerType(name))
            except ValueError:
                raise UnsupportedModelError(
                    f"layer type '{name}' is not supported for Qwen3.5 "
                    f"(supported: {', '.join(t.value for t in LayerType)})") from None
        return out


class Qwen3_5DecoderLayer(nn.Module):
    """x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(.)).

    `layer_idx` is the layer's index in the cache passed to forward; `layer_type` overrides the
    config's type for that index, so a standalone full-attention layer (the MTP head's) can be
    built as Qwen3_5DecoderLayer(settings, 0, LayerType.FULL_ATTENTION) and run on its own cache.
    """

    def __init__(self, s: Qwen3_5Settings, layer_idx: int, layer_type: LayerType | str | None = None):
        super().__init__()
        self.layer_type = LayerType(layer_type) if layer_type is not None else s.layer_types[layer_idx]
        if self.layer_type is LayerType.LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(s.hidden_size, s.linear_num_key_heads, s.linear_num_value_heads,
                                             s.linear_key_head_dim, s.linear_value_head_dim,
                                             s.linear_conv_kernel_dim, s.rms_norm_eps, layer_idx, s.hidden_act)
        else:
            self.self_attn = GatedAttention(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
                                            s.rms_norm_eps, layer_idx, bias=s.attention_bias)
        if s.moe is not None:
            self.mlp = s.moe.block(s.hidden_size, s.hidden_act)
        else:
            self.mlp = GatedMLP(s.hidden_size, s.intermediate_size, s.hidden_act)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, unit_offset=True)
        self.add_norm = add_rms_norm

    def cache_spec(self) -> LayerCacheSpec | RecurrentLayerSpec:
        mixer = self.linear_attn if self.layer_type is LayerType.LINEAR_ATTENTION else self.self_attn
        return mixer.cache_spec()

    def fuse(self) -> None:
        self.add_norm = fast_add_rms_norm

    def forward(self, x: torch.Tensor, update: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """x: residual stream [B, T, H]; update: the previous layer's MLP output, not yet added
        (None for the first layer), added here fused with this layer's input norm. Returns
        (residual stream, this layer's MLP output, not yet added)."""
        n = self.input_layernorm
        if update is None:
            h = n(x)
        else:
            x, h = self.add_norm(x, update, n.weight, n.eps, n.unit_offset)
        if self.layer_type is LayerType.LINEAR_ATTENTION:
            h = self.linear_attn(h, inputs.cache)
        else:
            h = self.self_attn(h, cos, sin, inputs)
        p = self.post_attention_layernorm
        x, h = self.add_norm(x, h, p.weight, p.eps, p.unit_offset)
        return x, self.mlp(h)


class Qwen3_5TextModel(nn.Module):
    def __init__(self, s: Qwen3_5Settings):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(s, i) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, unit_offset=True)


class Qwen3_5ForCausalLM(FoldedDecoderLM):
    """model_type `qwen3_5_text`."""

    checkpoint_prefix_map = TEXT_PREFIX_MAP
    ignored_prefixes = IGNORED_PREFIXES
    mixture_of_experts = False  # the *_moe subclasses below

    def __init__(self, config: dict):
        super().__init__()
        s = self._settings(config)
        self.config, self.settings = config, s
        self.vocab_size = s.vocab_size
        self.num_layers = s.num_layers
        self.max_position_embeddings = s.max_position_embeddings
        self.model = Qwen3_5TextModel(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(s.rope, s.rotary_dim)

    @classmethod
    def _settings(cls, config: dict) -> Qwen3_5Settings:
        return Qwen3_5Settings(config, moe=cls.mixture_of_experts)

    def checkpoint_tensor(self, ckpt_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """mlx-lm's layout (names under `language_model.`) back to Hugging Face's conventions."""
        if not ckpt_name.startswith(MLX_PREFIX):
            return tensor
        if ckpt_name.endswith(MLX_SHIFTED_NORMS) and tensor.dim() == 1:
            return tensor.to(torch.float32) - 1.0
        if ckpt_name.endswith(".conv1d.weight") and tensor.dim() == 3:
            return tensor.transpose(1, 2)  # [C, K, 1] -> torch's [C, 1, K]
        return tensor

    def cache_specs(self) -> list[LayerCacheSpec | RecurrentLayerSpec]:
        return [layer.cache_spec() for layer in self.model.layers]


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """model_type `qwen3_5`: the text model of the multimodal checkpoint (config in `text_config`;
    whether lm_head is tied follows the top-level `tie_word_embeddings`, as in transformers)."""

    @classmethod
    def _settings(cls, config: dict) -> Qwen3_5Settings:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedModelError(f"a {config.get('model_type')} config needs a `text_config` object "
                                        "(the language model's config)")
        return Qwen3_5Settings(text, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                               moe=cls.mixture_of_experts)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """model_type `qwen3_5_moe_text` (Qwen3.5 / Qwen3.6 MoE, e.g. 35B-A3B)."""

    mixture_of_experts = True
    checkpoint_renames = MLX_SWITCH_MLP_RENAMES


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """model_type `qwen3_5_moe`: the text model of the multimodal MoE checkpoint."""

    mixture_of_experts = True
    checkpoint_renames = MLX_SWITCH_MLP_RENAMES
