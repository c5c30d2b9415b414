"""Gated MLP (SwiGLU and friends) with HF weight names."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import UnsupportedModelError
from verispec.models.layers.fused import fast_silu_mul, merged_linear, silu_mul

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
        self.gated = lambda gate, up: self.act(gate) * up
        self.gate_up_proj: nn.Linear | None = None  # set by merge_projections()
        # the whole MLP's forward where a kernel computes it, set once at load (the quantized
        # gate/up with SiLU in its epilogue: verispec/quant/layers/mlp.py)
        self.kernel = None

    def merge_projections(self) -> None:
        """gate_proj and up_proj as one GEMM (the separate weights are released)."""
        if self.gate_up_proj is None:
            self.gate_up_proj = merged_linear(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj

    def fuse(self) -> None:
        if self.act is F.silu:
            self.gated = fast_silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H]
        if self.kernel is not None:
            return self.kernel(x)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.gated(gate, up))
