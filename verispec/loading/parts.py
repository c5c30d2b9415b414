"""Checkpoint names -> our parameters, beyond a plain rename.

- `checkpoint_renames` (a model's class attribute, applied by models/base.py `renamed`): infix
  substitutions after the prefix map, for formats that place a module elsewhere (mlx-lm's
  `mlp.switch_mlp` for our `mlp.experts`);
- parts: a checkpoint tensor that fills a slice of one of our parameters, as transformers'
  per-expert MoE weights fill the fused expert stacks. A module that takes parts has
  `checkpoint_part(local_name) -> (its parameter, index) | None` (models/layers/moe.py).
"""
from __future__ import annotations

import torch
from torch import nn

from verispec.errors import VerispecError

# a part's local name has at most this many dot-separated pieces (`3.gate_proj.weight`)
MAX_PART_DEPTH = 3


def part_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Our module paths whose modules take checkpoint parts."""
    return {path: m for path, m in model.named_modules() if hasattr(m, "checkpoint_part")}


def find_part(modules: dict[str, nn.Module], name: str) -> tuple[str, tuple] | None:
    """(our parameter name, index into it) for a checkpoint tensor (by our name) that fills part
    of a parameter; None when no module takes it."""
    pieces = name.split(".")
    for depth in range(1, min(MAX_PART_DEPTH, len(pieces) - 1) + 1):
        path = ".".join(pieces[:-depth])
        module = modules.get(path)
        if module is not None:
            part = module.checkpoint_part(".".join(pieces[-depth:]))
            if part is not None:
                return f"{path}.{part[0]}", part[1]
    return None


def check_part_shape(name: str, tensor: torch.Tensor, slot: torch.Tensor) -> None:
    if tuple(slot.shape) != tuple(tensor.shape):
        raise VerispecError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies {tuple(slot.shape)}")


def stack_parts(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (by our names) with complete sets of parts assembled into their parameters'
    shapes; parts of a parameter that stays incomplete are dropped (so it shows as missing)."""
    modules = part_modules(model)
    if not modules:
        return tensors
    params = dict(model.named_parameters())
    out, stacked, covered = {}, {}, {}
    for name, t in tensors.items():
        part = find_part(modules, name)
        if part is None:
            out[name] = t
            continue
        target, index = part
        if target not in stacked:
            stacked[target] = torch.zeros(params[target].shape, dtype=t.dtype)
            covered[target] = 0
        slot = stacked[target][index]
        check_part_shape(name, t, slot)
        slot.copy_(t)
        covered[target] += t.numel()
    out.update({k: v for k, v in stacked.items() if covered[k] == v.numel()})
    return out
