"""Gated MLP (SwiGLU and friends) with HF weight names."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.errors import UnsupportedModelError
from verispec.kernels import stream_mlp
from verispec.models.layers.fused import compiled, merged_linear, silu_mul

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
        self.gated_product = False  # the merged quantized gate/up applies the activation itself
        self.stream = None  # a kernels.stream_mlp.StreamMLP running decode / verify passes (use_stream)

    def merge_projections(self) -> None:
        """gate_proj and up_proj as one GEMM (the separate weights are released)."""
        if self.gate_up_proj is None:
            self.gate_up_proj = merged_linear(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj

    def fuse(self) -> None:
        if self.act is F.silu:
            self.gated = compiled(silu_mul)

    def gate_in_product_reason(self, dtype: torch.dtype) -> str | None:
        """Why SiLU(gate) * up cannot run in the merged gate/up product's kernel (None: it can)."""
        layer = self.gate_up_proj
        if self.act is not F.silu:
            return "an activation other than SiLU"
        if layer is None or not hasattr(layer, "silu_gate_reason"):
            return "no merged quantized gate/up projection"
        return layer.silu_gate_reason(layer.packed_values().device, dtype)

    def gate_in_product(self) -> None:
        """The merged gate/up's rows are interleaved for the tensor-core kernel, which then writes
        SiLU(gate) * up itself (quant_convert.gate_in_products decides)."""
        self.gate_up_proj.interleave_gate_up()
        self.gated_product = True

    def stream_reason(self, dtype: torch.dtype) -> str | None:
        """Why gate_up -> down cannot run as one launch of the streaming kernel (None: it can)."""
        if not self.gated_product:
            return "SiLU(gate) * up outside the gate/up product"
        gate_up, down = self.gate_up_proj, self.down_proj
        frags = [getattr(layer, "frag", None) for layer in (gate_up, down)]
        if any(frag is None for frag in frags):
            return "a gate/up or down projection without a 4-bit fragment-order copy"
        if gate_up.bias is not None or down.bias is not None:
            return "biases"
        if any(frag.terms.dtype != dtype for frag in frags):
            return "fragment-order copies in another dtype than the activations'"
        return stream_mlp.unsupported_reason(*frags, frags[0].words.device, dtype)

    def use_stream(self, dtype: torch.dtype) -> None:
        """Decode and verify passes (up to stream_mlp.MAX_ROWS rows) take the streaming kernel, one
        launch for both products; wider passes keep the two products. Once the weights are final."""
        self.stream = stream_mlp.StreamMLP(self.gate_up_proj.frag, self.down_proj.frag, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, H]
        if self.stream is not None:
            rows = x.numel() // x.shape[-1]
            if rows <= stream_mlp.MAX_ROWS and x.dtype == self.stream.dtype:
                return self.stream(x.reshape(rows, x.shape[-1])).reshape(*x.shape[:-1], -1)
        if self.gated_product:
            return self.down_proj(self.gate_up_proj.silu_gated(x, self.gated))
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.gated(gate, up))
