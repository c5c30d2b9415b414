"""RMSNorm as Hugging Face computes it (float32 statistics, weight applied in the input dtype)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # Some families (Gemma, Qwen3.5) store w and scale by (1 + w).
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        dtype = x.dtype
        h = x.to(torch.float32) if dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.to(h.dtype))).to(dtype)
        return self.weight * h.to(dtype)
