"""RMSNorm as Hugging Face computes it (float32 statistics, weight applied in the input dtype)."""
from __future__ import annotations

import torch
from torch import nn

from verispec.models.layers.fused import fast_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # Some families (Gemma, Qwen3.5) store w and scale by (1 + w).
        self.unit_offset = unit_offset
        self.impl = rms_norm

    def fuse(self) -> None:
        """One kernel a norm (CUDA): kernels/rms_norm.py's, where it takes the rows."""
        self.impl = fast_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        return self.impl(x, self.weight, self.eps, self.unit_offset)
