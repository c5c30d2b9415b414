"""config.json + safetensors -> a verispec model on the chosen device and dtype."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from verispec import log
from verispec.errors import VerispecError
from verispec.loading.gguf import GGUFCheckpoint, is_gguf
from verispec.loading.weights import checkpoint_files, iter_tensors
from verispec.models.base import CausalLM
from verispec.models.registry import model_class

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


def read_config(model_dir: Path) -> dict:
    """config.json of a checkpoint directory, or the config built from a GGUF file's metadata."""
    if is_gguf(model_dir):
        return GGUFCheckpoint(model_dir).config
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise VerispecError(f"could not read {path}: {exc}") from exc


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """A checkpoint directory (config.json + safetensors) or a GGUF file (see resolve_model)."""
    if is_gguf(model_dir):
        gguf = GGUFCheckpoint(model_dir)
        log.debug("%s", gguf.describe())
        config, tensors = gguf.config, gguf.tensors()
    else:
        config, tensors = read_config(model_dir), iter_tensors(checkpoint_files(model_dir))
    cls = model_class(config.get("model_type"))
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device=device)
    model.to(dtype)
    _load_weights(model, tensors, dtype, device)
    model.tie_weights()
    model.eval()
    model.requires_grad_(False)
    return model


def _load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                  device: torch.device) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    ignored: list[str] = []
    for ckpt_name, tensor in tensors:
        name = ckpt_name
        for src, dst in model.checkpoint_prefix_map.items():
            if name.startswith(src):
                name = dst + name[len(src):]
                break
        if name not in params:
            ignored.append(ckpt_name)
            continue
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise VerispecError(
                f"weight {ckpt_name} has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(device=device, dtype=dtype))
        loaded.add(name)
    tied = {"lm_head.weight"} if getattr(getattr(model, "settings", None), "tie_word_embeddings", False) else set()
    missing = sorted(set(params) - loaded - tied)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise VerispecError(f"checkpoint is missing weights: {shown}")
    if ignored:
        log.debug("ignored %d checkpoint tensors not used by %s (e.g. %s)", len(ignored),
                  type(model).__name__, ", ".join(ignored[:3]))
