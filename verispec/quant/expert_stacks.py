"""Per-expert checkpoint matrices -> whole expert stacks, for `verispec quantize`.

transformers saves Qwen3-MoE (and the original releases ship it) with one linear per expert
(`mlp.experts.{e}.gate_proj.weight`); the MLX formats store each projection of all experts as one
stack (mlx-lm's `switch_mlp`). `ExpertStacker` collects the parts of each FusedExperts stack
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) as the checkpoint streams by and hands back a
stack once every expert's part has arrived, so at most the stacks in progress are held.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from verispec.models.layers.moe import FusedExperts

# `{e}.gate_proj.weight`: the local name of a per-expert part below its FusedExperts module
PART_DEPTH = 3


@dataclass
class _Stack:
    shape: tuple[int, ...]
    parts: list[tuple[str, tuple, torch.Tensor]] = field(default_factory=list)  # (checkpoint name, index, tensor)
    covered: int = 0


@dataclass
class CompletedStack:
    checkpoint_name: str  # the stack's name in the checkpoint's own prefix (`....mlp.experts.gate_up_proj`)
    our_name: str  # its name in our model (`model.layers.0.mlp.experts.gate_up_proj`)
    tensor: torch.Tensor  # [E, 2I, H] or [E, H, I], in the parts' dtype
    parts: list[tuple[str, torch.Tensor]]  # (checkpoint name, tensor) it was built from


class ExpertStacker:
    def __init__(self, model: nn.Module):
        """`model`: our model of the architecture (on the meta device: only shapes are read)."""
        self.modules = {path: m for path, m in model.named_modules() if isinstance(m, FusedExperts)}
        self.pending: dict[str, _Stack] = {}

    def add(self, checkpoint_name: str, our_name: str, tensor: torch.Tensor) -> list[CompletedStack] | None:
        """None when `our_name` is not a per-expert part; otherwise the stacks this part completed
        (an empty list while its stack is still missing experts)."""
        pieces = our_name.split(".")
        if len(pieces) <= PART_DEPTH:
            return None
        path, local = ".".join(pieces[:-PART_DEPTH]), ".".join(pieces[-PART_DEPTH:])
        module = self.modules.get(path)
        part = module.checkpoint_part(local) if module is not None else None
        if part is None:
            return None
        param_name, index = part
        target = f"{path}.{param_name}"
        stack = self.pending.setdefault(target, _Stack(tuple(getattr(module, param_name).shape)))
        stack.parts.append((checkpoint_name, index, tensor))
        stack.covered += tensor.numel()
        if stack.covered < math.prod(stack.shape):
            return []
        del self.pending[target]
        # the module's path in the checkpoint's own prefix: this part's name less its local name
        checkpoint_prefix = checkpoint_name[: len(checkpoint_name) - len(local)]
        out = torch.zeros(stack.shape, dtype=tensor.dtype)
        for _, idx, t in stack.parts:
            out[idx] = t
        return [CompletedStack(checkpoint_prefix + param_name, target, out, [(n, t) for n, _, t in stack.parts])]

    def leftover(self) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) of every part whose stack never completed, in arrival order."""
        out = [(name, t) for stack in self.pending.values() for name, _, t in stack.parts]
        self.pending.clear()
        return out

