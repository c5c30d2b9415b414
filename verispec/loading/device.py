"""The --device and --dtype flags as torch values, checked. A module of its own (torch and nothing of
ours) so that checking flags imports no model code: `serve` starts its engine process sooner."""
from __future__ import annotations

import torch

from verispec.errors import VerispecError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64, "fp64": torch.float64}


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise VerispecError(f"--dtype '{name}' is not supported (accepted: {', '.join(DTYPES)})", param="dtype")
    return DTYPES[name]


def parse_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise VerispecError(f"--device '{name}' is not a valid device (accepted: cpu, cuda, cuda:N, mps)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise VerispecError("--device cuda was asked for but CUDA is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise VerispecError("--device mps was asked for but MPS is not available on this machine")
    return device
