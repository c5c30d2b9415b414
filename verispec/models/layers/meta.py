"""Building a model's modules on the meta device, without running their initializers.

nn.Linear / nn.Embedding initialize their weights at construction; on meta tensors that goes
through torch's reference ops, which import dynamo (~120 MiB of a process's memory, sympy and
Triton with it) for values the loader overwrites anyway.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.nn import init

_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                 "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")


def _leave(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules made inside get meta tensors, and torch.nn.init leaves them as they are."""
    saved = {name: getattr(init, name) for name in _INITIALIZERS}
    try:
        for name in _INITIALIZERS:
            setattr(init, name, _leave)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def materialize(module: nn.Module, device: torch.device) -> None:
    """module.to_empty(device=device): every parameter and buffer uninitialized on `device` (a
    tensor shared by several modules stays one). torch's own goes through the meta reference of
    empty_like, which imports sympy (~30 MiB)."""
    made: dict[int, torch.Tensor] = {}

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]

    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fresh(t)
