"""A gated MLP's passes when its merged 4-bit gate/up applies SiLU(gate) * up in the product's
epilogue (rows interleaved: QuantizedLinear.interleave_gate_up), and its decode and verify passes
may run gate/up -> down as one launch of the streaming kernel (quant/kernels/stream_mlp.py).

`quant.dispatch.gate_in_products` sets a `GatedProduct` as the MLP's `kernel`, which its forward
then calls (models/layers/mlp.py): the model itself knows nothing of quantization.
"""
from __future__ import annotations

import torch
from torch import nn

from verispec.models.layers.mlp import GatedMLP
from verispec.quant.kernels import stream_mlp


class GatedProduct:
    """The whole MLP for a GatedMLP whose gate/up rows are interleaved. Not a module: the MLP
    holds it, and it reads the MLP's own projections and activation at call time."""

    def __init__(self, mlp: GatedMLP):
        self.mlp = mlp
        self.stream = None  # a stream_mlp.StreamMLP for passes of up to stream_mlp.MAX_ROWS rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., H]
        if self.stream is not None:
            rows = x.numel() // x.shape[-1]
            if rows <= stream_mlp.MAX_ROWS and x.dtype == self.stream.dtype:
                return self.stream(x.reshape(rows, x.shape[-1])).reshape(*x.shape[:-1], -1)
        mlp = self.mlp
        return mlp.down_proj(mlp.gate_up_proj.silu_gated(x, mlp.gated))


def gated_mlps(root: nn.Module) -> list[GatedMLP]:
    """The gated MLPs under `root`."""
    return [m for m in root.modules() if isinstance(m, GatedMLP)]
