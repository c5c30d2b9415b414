"""model_type -> implementing class ("module:Class"), imported on demand."""
from __future__ import annotations

import importlib

from verispec.errors import UnsupportedModelError

MODEL_REGISTRY: dict[str, str] = {
    "gemma3": "verispec.models.gemma3:Gemma3ForConditionalGeneration",
    "gemma3_text": "verispec.models.gemma3:Gemma3ForCausalLM",
    "gemma4": "verispec.models.gemma4:Gemma4ForConditionalGeneration",
    "gemma4_text": "verispec.models.gemma4:Gemma4ForCausalLM",
    "llama": "verispec.models.llama:LlamaForCausalLM",
    "mistral": "verispec.models.llama:LlamaForCausalLM",
    "qwen2": "verispec.models.llama:LlamaForCausalLM",
    "qwen3": "verispec.models.llama:LlamaForCausalLM",
    "qwen3_moe": "verispec.models.qwen3_moe:Qwen3MoeForCausalLM",
    "qwen3_5": "verispec.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "qwen3_5_text": "verispec.models.qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_5_moe": "verispec.models.qwen3_5:Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_moe_text": "verispec.models.qwen3_5:Qwen3_5MoeForCausalLM",
}


def model_class(model_type: str | None):
    if model_type not in MODEL_REGISTRY:
        raise UnsupportedModelError(
            f"model_type '{model_type}' is not supported (supported: {', '.join(sorted(MODEL_REGISTRY))})")
    module_name, cls_name = MODEL_REGISTRY[model_type].split(":")
    return getattr(importlib.import_module(module_name), cls_name)
