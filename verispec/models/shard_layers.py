"""One layer's share of a tensor-parallel rank (models/sharding.py walks a model and calls these).

Each function rewrites a layer built on the meta device, full size, into this rank's share and
returns parameter name -> the part of its checkpoint tensor it loads. Column-parallel projections
become plain `nn.Linear`s over their rows; row-parallel ones `RowParallelLinear`s (one all-reduce).
"""
from __future__ import annotations

import torch
from torch import nn

from verispec.models.layers.parallel import (RowParallelExperts, RowParallelLinear, Shard, ShardSpec, even_split,
                                             split_parts)


def kv_head_split(num_kv_heads: int, shard: Shard) -> tuple[int, int]:
    """(first KV head, KV heads) of this rank: an equal part, or one head shared by world/kv ranks."""
    if num_kv_heads >= shard.world_size:
        n = num_kv_heads // shard.world_size
        return shard.rank * n, n
    return shard.rank // (shard.world_size // num_kv_heads), 1


def column(prefix: str, parent: nn.Module, name: str, rows: ShardSpec) -> dict[str, ShardSpec]:
    """parent.<name> (an nn.Linear) keeps only `rows` of its outputs."""
    full = getattr(parent, name)
    setattr(parent, name, nn.Linear(full.in_features, rows.size, bias=full.bias is not None))
    specs = {f"{prefix}.{name}.weight": rows}
    if full.bias is not None:
        specs[f"{prefix}.{name}.bias"] = rows
    return specs


def row(prefix: str, parent: nn.Module, name: str, cols: ShardSpec, shard: Shard) -> dict[str, ShardSpec]:
    """parent.<name> (an nn.Linear) reads only `cols` of its inputs; its partial products are summed."""
    full = getattr(parent, name)
    setattr(parent, name, RowParallelLinear(cols.size, full.out_features, full.bias is not None, shard))
    return {f"{prefix}.{name}.weight": cols.along(1)}


def attention(prefix: str, attn: nn.Module, shard: Shard, q_rows_per_head: int = 1) -> dict[str, ShardSpec]:
    """Any of the families' attentions (q/k/v/o_proj, num_heads, num_kv_heads, head_dim): its heads
    and KV heads. q_rows_per_head: 2 where q_proj also gives each head's output gate (Qwen3.5).
    A layer without k_proj (Gemma 4's shared-KV layers) reads another layer's cache, split alike."""
    d = attn.head_dim
    heads = attn.num_heads // shard.world_size
    first_kv, kv_heads = kv_head_split(attn.num_kv_heads, shard)
    q_width = q_rows_per_head * heads * d
    specs = column(prefix, attn, "q_proj", ShardSpec(0, shard.rank * q_width, (shard.rank + 1) * q_width, q_width))
    kv_rows = ShardSpec(0, first_kv * d, (first_kv + kv_heads) * d, kv_heads * d)
    for name in ("k_proj", "v_proj"):
        if hasattr(attn, name):
            specs.update(column(prefix, attn, name, kv_rows))
    specs.update(row(prefix, attn, "o_proj", ShardSpec(0, shard.rank * heads * d, (shard.rank + 1) * heads * d,
                                                        heads * d), shard))
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    return specs


def gated_mlp(prefix: str, mlp: nn.Module, shard: Shard) -> dict[str, ShardSpec]:
    cols = even_split(mlp.gate_proj.out_features, shard)
    specs = {**column(prefix, mlp, "gate_proj", cols), **column(prefix, mlp, "up_proj", cols)}
    specs.update(row(prefix, mlp, "down_proj", cols, shard))
    return specs


def gated_delta_net(prefix: str, gdn: nn.Module, shard: Shard) -> dict[str, ShardSpec]:
    """Its key and value heads (value head h reads key head h // (Hv / Hk), so equal shares of
    both keep each value head with its key head). q|k|v are one projection and one depthwise
    convolution, each part split; z, the b/a gates, A_log and dt_bias per value head; out_proj
    row-parallel; the recurrent state of a rank is its heads' (cache_spec follows)."""
    n = shard.world_size
    qkv = split_parts([gdn.key_dim, gdn.key_dim, gdn.value_dim], shard)
    heads = even_split(gdn.num_value_heads, shard)
    values = even_split(gdn.value_dim, shard)
    specs = {**column(prefix, gdn, "in_proj_qkv", qkv), **column(prefix, gdn, "in_proj_z", values),
             **column(prefix, gdn, "in_proj_b", heads), **column(prefix, gdn, "in_proj_a", heads)}
    specs.update(row(prefix, gdn, "out_proj", values, shard))
    gdn.conv1d = nn.Conv1d(qkv.size, qkv.size, gdn.conv_kernel, groups=qkv.size, bias=False)
    specs[f"{prefix}.conv1d.weight"] = qkv
    for name in ("A_log", "dt_bias"):
        setattr(gdn, name, nn.Parameter(torch.empty(heads.size)))
        specs[f"{prefix}.{name}"] = heads
    gdn.num_key_heads //= n
    gdn.num_value_heads //= n
    gdn.key_dim //= n
    gdn.value_dim //= n
    gdn.conv_dim = qkv.size
    return specs


def fused_experts(prefix: str, parent: nn.Module, name: str, shard: Shard) -> dict[str, ShardSpec]:
    """Every expert's intermediate features split over the ranks (gate and up rows, down columns),
    as a dense MLP is: each rank runs every routed expert on its features, one all-reduce sums them.
    Chosen over expert-parallel (whole experts per rank) because it is exact whatever the routing
    (no rank idles when the routed experts are all one rank's) and needs no token exchange."""
    full = getattr(parent, name)
    inter = full.down_proj.shape[-1]
    hidden = full.down_proj.shape[1]
    feats = even_split(inter, shard)
    setattr(parent, name, RowParallelExperts(full.num_experts, hidden, feats.size, full.act, shard))
    specs = {f"{prefix}.{name}.gate_up_proj": split_parts([inter, inter], shard).along(1),
             f"{prefix}.{name}.down_proj": feats.along(2)}
    # checkpoints with one linear per expert (transformers' Qwen3-MoE layout): each its rows / columns
    for e in range(full.num_experts):
        specs[f"{prefix}.{name}.{e}.gate_proj.weight"] = specs[f"{prefix}.{name}.{e}.up_proj.weight"] = feats
        specs[f"{prefix}.{name}.{e}.down_proj.weight"] = feats.along(1)
    return specs
