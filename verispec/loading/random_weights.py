"""Random weights in place of a checkpoint (`verispec bench --shape`): a model of a config.json,
created directly on the device (meta -> to_empty -> normal_), so an 8B model never passes through
host memory; decode speed does not depend on the values. Under tensor parallelism each rank draws
its own share (engine/tp_worker.py gets a `RandomWeights` where it would get a directory)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from verispec.models.base import CausalLM
from verispec.models.layers.meta import on_meta
from verispec.models.layers.parallel import Shard
from verispec.models.registry import model_class
from verispec.models.sharding import check_shardable, shard_model


@dataclass(frozen=True)
class RandomWeights:
    """A model to build from `config` (config.json's fields) with weights drawn from `seed`."""

    name: str
    config: dict
    seed: int = 0


def random_model(source: RandomWeights, device: torch.device, dtype: torch.dtype,
                 shard: Shard | None = None) -> CausalLM:
    """The model (this rank's share of it, with `shard`) with random weights on `device`."""
    cls = model_class(source.config.get("model_type"))
    with on_meta():
        model = cls(dict(source.config))
        if shard is not None:
            check_shardable(source.config, shard.world_size)
            shard_model(model, shard)
    model.to(dtype)  # on meta: the device memory is then allocated once, in the target dtype
    model.to_empty(device=device)
    init_random_(model, source.seed)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def init_random_(module: nn.Module, seed: int = 0) -> None:
    """Fill every floating-point parameter with N(0, 0.02), norm weights with 1 (stable activations)."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for sub in module.modules():
            is_norm = "Norm" in type(sub).__name__
            for p in sub.parameters(recurse=False):
                if not p.is_floating_point():
                    continue
                if is_norm:
                    p.fill_(1.0)
                    continue
                if p.device not in generators:
                    generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
                p.normal_(0.0, 0.02, generator=generators[p.device])
