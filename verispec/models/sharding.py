"""Splitting a model over a tensor-parallel group (Megatron's layout, as nano-vllm and vLLM use):
attention heads, Gated DeltaNet heads and the MLPs' (and every expert's) intermediate features are
split over the ranks; the projections into them are column-parallel (each rank computes its
heads' / features' outputs), the projections out of them row-parallel (one all-reduce each), the
embedding and the head split by vocabulary rows. KV heads are split too, or replicated when there
are fewer of them than ranks. Norms, routers and Gemma 4's per-layer inputs are replicated.

`check_shardable` reads only the config, so a bad `--tensor-parallel-size` is refused before the
weights load; `shard_model` rewrites a model built on the meta device and says which part of each
checkpoint tensor every parameter loads (models/shard_layers.py, one layer kind each).
"""
from __future__ import annotations

from torch import nn

from verispec.errors import VerispecError
from verispec.models import shard_layers
from verispec.models.layers.parallel import Shard, ShardSpec, VocabParallelEmbedding, VocabParallelHead
from verispec.models.shard_layers import kv_head_split

SHARDABLE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                   "qwen3_5_moe_text", "gemma3", "gemma3_text", "gemma4", "gemma4_text")
# configs whose text model sits under `text_config` (the multimodal checkpoints)
WRAPPED_TYPES = ("qwen3_5", "qwen3_5_moe", "gemma3", "gemma4")


def check_shardable(config: dict, world_size: int) -> None:
    """Raise a one-line error unless a checkpoint with this config.json splits over `world_size` ranks."""
    flag = f"--tensor-parallel-size {world_size}"
    model_type = config.get("model_type")
    if model_type not in SHARDABLE_TYPES:
        raise VerispecError(f"{flag}: model_type '{model_type}' is not split over GPUs yet "
                            f"(supported: {', '.join(SHARDABLE_TYPES)})")
    mlx = isinstance(config.get("quantization"), dict)  # MLX's section (loading/quantized_shards.py splits it)
    if "quantization_config" in config and not mlx:
        method = config["quantization_config"].get("quant_method", "this format's")
        raise VerispecError(f"{flag}: {method} quantized checkpoints are not split over GPUs yet (MLX 4/8-bit ones "
                            "are); load the bf16 checkpoint")
    text = (config.get("text_config") or {}) if model_type in WRAPPED_TYPES else config
    heads, kv_heads, widths = _split_sizes(model_type, text)
    if heads % world_size:
        raise VerispecError(f"{flag} must divide the model's {heads} attention heads")
    for kv in kv_heads:
        if kv % world_size and world_size % kv:
            raise VerispecError(f"{flag} must divide the model's {kv} KV heads or be a multiple of them")
    for what, n in widths:
        if n % world_size:
            raise VerispecError(f"{flag} must divide the model's {what} ({n})")


def _split_sizes(model_type: str, c: dict) -> tuple[int, list[int], list[tuple[str, int]]]:
    """(attention heads, each KV-head count, [(what, count)] the ranks must also divide)."""
    if model_type.startswith("gemma4"):
        from verispec.models.gemma4 import Gemma4Settings

        s = Gemma4Settings(c)
        widths = [("MLP width", n) for n in sorted(set(s.mlp_sizes))]
        if s.enable_moe:
            widths.append(("expert MLP width", s.moe_intermediate_size))
        return s.num_heads, sorted(set(s.num_kv_heads)), widths
    heads = int(c.get("num_attention_heads", 16 if model_type.startswith("qwen3_5") else 8))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    widths = [("MLP width", int(c.get("intermediate_size", 0)))]
    if model_type.startswith("qwen3_5"):
        widths.append(("Gated DeltaNet key heads", int(c.get("linear_num_key_heads", 16))))
    if model_type in ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text"):
        widths.append(("expert MLP width", int(c.get("moe_intermediate_size", 0))))
        if c.get("shared_expert_intermediate_size"):
            widths.append(("shared expert MLP width", int(c["shared_expert_intermediate_size"])))
    return heads, [kv_heads], [(what, n) for what, n in widths if n]


def shard_model(model: nn.Module, shard: Shard) -> dict[str, ShardSpec]:
    """Rewrite a model (built on the meta device, full size) into this rank's share; returns
    parameter name -> the part of its checkpoint tensor it loads (parameters not named load
    whole). The layers then describe this rank's attention (heads, KV heads) and recurrent heads,
    which is what its cache holds."""
    from verispec.models.gemma3 import Gemma3Attention, Gemma3ForCausalLM
    from verispec.models.gemma4 import Gemma4Attention, Gemma4ForCausalLM
    from verispec.models.layers.gated_attention import GatedAttention
    from verispec.models.layers.gated_delta_net import GatedDeltaNet
    from verispec.models.layers.mlp import GatedMLP
    from verispec.models.layers.moe import FusedExperts
    from verispec.models.llama import Attention, LlamaForCausalLM
    from verispec.models.qwen3_5 import Qwen3_5ForCausalLM

    if not isinstance(model, (LlamaForCausalLM, Qwen3_5ForCausalLM, Gemma3ForCausalLM, Gemma4ForCausalLM)):
        raise VerispecError(f"{type(model).__name__} is not split over GPUs yet")
    specs: dict[str, ShardSpec] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, (Attention, Gemma3Attention, Gemma4Attention)):
            specs.update(shard_layers.attention(name, module, shard))
        elif isinstance(module, GatedAttention):
            specs.update(shard_layers.attention(name, module, shard, q_rows_per_head=2))
        elif isinstance(module, GatedMLP):
            specs.update(shard_layers.gated_mlp(name, module, shard))
        elif isinstance(module, GatedDeltaNet):
            specs.update(shard_layers.gated_delta_net(name, module, shard))
        for child, sub in module.named_children():
            if isinstance(sub, FusedExperts):
                specs.update(shard_layers.fused_experts(name, module, child, shard))
    s = model.settings
    model.model.embed_tokens = VocabParallelEmbedding(s.vocab_size, s.hidden_size, shard)
    model.lm_head = VocabParallelHead(s.hidden_size, s.vocab_size, shard)
    specs["model.embed_tokens.weight"] = specs["lm_head.weight"] = model.lm_head.part
    if isinstance(model, (LlamaForCausalLM, Gemma3ForCausalLM)):  # their cache_specs() read the settings
        s.num_kv_heads = kv_head_split(s.num_kv_heads, shard)[1]
        s.num_heads //= shard.world_size
    model.shard = shard
    return specs
