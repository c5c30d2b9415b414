"""GGUF tensor names -> Hugging Face names, and undoing what llama.cpp's converter changed:
- llama: q and k projection rows permuted (llama.cpp rotates interleaved pairs, HF rotates halves):
  within each head, HF row i (first half) and i + D/2 (second half) were moved next to each other;
- gemma3: norm weights stored as 1 + w (llama.cpp's RMSNorm multiplies by the weight alone).
MoE expert stacks (`ffn_{gate,up,down}_exps`, [E, rows, cols]) keep their layout: gate and up
each fill one half of our fused gate_up_proj (FusedExperts.checkpoint_part), down is down_proj.
"""
from __future__ import annotations

import re

import torch

from verispec.loading.gguf.quants import AffineQuantized

TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_COMMON = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# whole-layer expert stacks: named without the `.weight` suffix, as our fused parameters are
EXPERT_STACKS = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# the same GGUF name means another norm in Gemma's four-norm layer
LAYER_BY_ARCH = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
LAYER_DEFAULT = {"ffn_norm": "post_attention_layernorm"}
LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")


def hf_name(gguf_name: str, architecture: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one our models do not use."""
    if gguf_name in TOP_LEVEL:
        return TOP_LEVEL[gguf_name]
    match = LAYER_NAME.match(gguf_name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    if part in EXPERT_STACKS and kind == "weight":
        return f"model.layers.{layer}.{EXPERT_STACKS[part]}"
    table = LAYER_BY_ARCH.get(architecture, LAYER_DEFAULT)
    module = table.get(part) or LAYER_COMMON.get(part)
    return f"model.layers.{layer}.{module}.{kind}" if module else None


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row index [num_rows] that takes llama.cpp's q/k row order back to Hugging Face's: GGUF row
    (h, i, j) of shape (heads, D/2, 2) holds HF row (h, j, i) of shape (heads, 2, D/2)."""
    head_dim = num_rows // num_heads
    return torch.arange(num_rows).view(num_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def restore(value: torch.Tensor | AffineQuantized, gguf_name: str, architecture: str, config: dict
            ) -> torch.Tensor | AffineQuantized:
    """Undo the converter's changes to one tensor (module docstring)."""
    if architecture == "llama" and gguf_name.split(".")[-2] in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if ".attn_q." in gguf_name else config["num_key_value_heads"]
        index = unpermute_rows(value.shape[0], heads)
        return value.take_rows(index) if isinstance(value, AffineQuantized) else value[index]
    if architecture == "gemma3" and gguf_name.endswith("norm.weight"):
        return value.to(torch.float32) - 1.0
    return value
