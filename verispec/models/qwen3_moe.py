"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder (q/k norms, GQA) with a sparse
MoE MLP (layers/sparse_moe.py: softmax top-k routing, `norm_topk_prob` renormalisation, no shared
expert) in the layers `decoder_sparse_step` and `mlp_only_layers` pick, as transformers'
Qwen3MoeDecoderLayer does: layer i is sparse when i is not in mlp_only_layers and
(i + 1) % decoder_sparse_step == 0; the others keep a dense MLP of `intermediate_size`.

Checkpoints name the experts one linear each (`mlp.experts.{e}.gate_proj.weight`, as the releases
and transformers' save_pretrained write them) or stacked (`mlp.experts.gate_up_proj`); both load
into the same stacks. `use_sliding_window` windows every layer (transformers ignores
`max_window_layers` here).
"""
from __future__ import annotations

from verispec.models.layers.sparse_moe import MLX_SWITCH_MLP_RENAMES, MoeSettings
from verispec.models.llama import DecoderSettings, LlamaForCausalLM

# transformers' Qwen3MoeConfig defaults (the 30B-A3B's, except norm_topk_prob: true there)
QWEN3_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": False}


class Qwen3MoeSettings(DecoderSettings):
    def __init__(self, config: dict):
        super().__init__(config)
        self.qk_norm = True
        num_layers = self.num_layers
        if int(config.get("num_experts", config.get("num_local_experts", 1)) or 0) > 0:
            self.moe = MoeSettings.from_config(config, "qwen3_moe", QWEN3_MOE_DEFAULTS)
            step = int(config.get("decoder_sparse_step") or 1)
            dense = {int(i) for i in config.get("mlp_only_layers") or ()}
            self.sparse_layers = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)

    def _layer_windows(self, config: dict) -> list[int | None]:
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        return [window] * self.num_layers


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """model_type `qwen3_moe`."""

    checkpoint_renames = MLX_SWITCH_MLP_RENAMES

    @staticmethod
    def _settings(config: dict) -> Qwen3MoeSettings:
        return Qwen3MoeSettings(config)
