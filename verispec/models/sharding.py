"""Splitting a model over a tensor-parallel group (Megatron's layout, as nano-vllm and vLLM use):
attention heads and the MLP's intermediate features are split over the ranks; q/k/v and gate/up
are column-parallel (each rank computes its heads' / features' outputs), o_proj and down_proj
row-parallel (one all-reduce each), the embedding and the head split by vocabulary rows. KV heads
are split too, or replicated when there are fewer of them than ranks. Norms are replicated.

`check_shardable` reads only the config, so a bad `--tensor-parallel-size` is refused before the
weights load; `shard_model` rewrites a model built on the meta device and says which part of each
checkpoint tensor every parameter loads.
"""
from __future__ import annotations

from torch import nn

from verispec.errors import VerispecError
from verispec.models.layers.parallel import (RowParallelLinear, Shard, ShardSpec, VocabParallelEmbedding,
                                             VocabParallelHead, even_split)

# the dense Llama family (models/llama.py); the others are next steps (docs/multi-gpu.md)
SHARDABLE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_shardable(config: dict, world_size: int) -> None:
    """Raise a one-line error unless a checkpoint with this config.json splits over `world_size` ranks."""
    flag = f"--tensor-parallel-size {world_size}"
    model_type = config.get("model_type")
    if model_type not in SHARDABLE_TYPES:
        raise VerispecError(f"{flag}: model_type '{model_type}' is not split over GPUs yet "
                            f"(supported: {', '.join(SHARDABLE_TYPES)})")
    if "quantization_config" in config or "quantization" in config:
        raise VerispecError(f"{flag}: quantized checkpoints are not split over GPUs yet; load the bf16 checkpoint")
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    intermediate = int(config["intermediate_size"])
    if heads % world_size:
        raise VerispecError(f"{flag} must divide the model's {heads} attention heads")
    if kv_heads % world_size and world_size % kv_heads:
        raise VerispecError(f"{flag} must divide the model's {kv_heads} KV heads or be a multiple of them")
    if intermediate % world_size:
        raise VerispecError(f"{flag} must divide the model's MLP width ({intermediate})")


def kv_head_split(num_kv_heads: int, shard: Shard) -> tuple[int, int]:
    """(first KV head, KV heads) of this rank: an equal part, or one head shared by world/kv ranks."""
    if num_kv_heads >= shard.world_size:
        n = num_kv_heads // shard.world_size
        return shard.rank * n, n
    return shard.rank // (shard.world_size // num_kv_heads), 1


def shard_model(model: nn.Module, shard: Shard) -> dict[str, ShardSpec]:
    """Rewrite a Llama-family model (built on the meta device, full size) into this rank's share;
    returns parameter name -> the part of its checkpoint tensor it loads (parameters not named
    load whole). The model's settings then describe this rank's attention (heads, KV heads), which
    is what its KV cache holds."""
    from verispec.models.layers.mlp import GatedMLP
    from verispec.models.llama import Attention, LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise VerispecError(f"{type(model).__name__} is not split over GPUs yet")
    s = model.settings
    specs: dict[str, ShardSpec] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, Attention):
            specs.update(_shard_attention(name, module, shard))
        elif isinstance(module, GatedMLP):
            specs.update(_shard_mlp(name, module, shard))
    model.model.embed_tokens = VocabParallelEmbedding(s.vocab_size, s.hidden_size, shard)
    model.lm_head = VocabParallelHead(s.hidden_size, s.vocab_size, shard)
    specs["model.embed_tokens.weight"] = specs["lm_head.weight"] = model.lm_head.part
    s.num_heads //= shard.world_size
    s.num_kv_heads = kv_head_split(s.num_kv_heads, shard)[1]
    s.intermediate_size //= shard.world_size
    model.shard = shard
    return specs


def _shard_attention(prefix: str, attn: nn.Module, shard: Shard) -> dict[str, ShardSpec]:
    d = attn.head_dim
    heads = attn.num_heads // shard.world_size
    first_kv, kv_heads = kv_head_split(attn.num_kv_heads, shard)
    q_rows = ShardSpec(0, shard.rank * heads * d, (shard.rank + 1) * heads * d, heads * d)
    kv_rows = ShardSpec(0, first_kv * d, (first_kv + kv_heads) * d, kv_heads * d)
    specs = {}
    for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        full = getattr(attn, name)
        setattr(attn, name, nn.Linear(full.in_features, rows.size, bias=full.bias is not None))
        specs[f"{prefix}.{name}.weight"] = rows
        if full.bias is not None:
            specs[f"{prefix}.{name}.bias"] = rows
    o = attn.o_proj
    attn.o_proj = RowParallelLinear(q_rows.size, o.out_features, o.bias is not None, shard)
    specs[f"{prefix}.o_proj.weight"] = ShardSpec(1, q_rows.start, q_rows.stop, q_rows.size)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    return specs


def _shard_mlp(prefix: str, mlp: nn.Module, shard: Shard) -> dict[str, ShardSpec]:
    cols = even_split(mlp.gate_proj.out_features, shard)
    specs = {}
    for name in ("gate_proj", "up_proj"):
        full = getattr(mlp, name)
        setattr(mlp, name, nn.Linear(full.in_features, cols.size, bias=full.bias is not None))
        specs[f"{prefix}.{name}.weight"] = cols
        if full.bias is not None:
            specs[f"{prefix}.{name}.bias"] = cols
    down = mlp.down_proj
    mlp.down_proj = RowParallelLinear(cols.size, down.out_features, down.bias is not None, shard)
    specs[f"{prefix}.down_proj.weight"] = ShardSpec(1, cols.start, cols.stop, cols.size)
    return specs
