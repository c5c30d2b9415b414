"""Gated MLP (SwiGLU and friends) with HF weight names."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import UnsupportedModelError
from verispec.models.layers.fused import compiled, silu_mul

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"activation '{name}' is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)
        self.act_name = act
        self.gated = lambda gate, up: self.act(gate) * up

    def fuse(self) -> None:
        if self.act is F.silu:
            self.gated = compiled(silu_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H]
        return self.down_proj(self.gated(self.gate_proj(x), self.up_proj(x)))
