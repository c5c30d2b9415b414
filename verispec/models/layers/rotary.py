"""Rotary position embeddings: default, linear, llama3 and proportional (Gemma 4) frequencies."""
from __future__ import annotations

import math

import torch
from torch import nn

from verispec.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional")


def rope_parameters(config: dict) -> dict:
    """Normalise the two config spellings (v4 `rope_scaling` + `rope_theta`, v5 `rope_parameters`)."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def inverse_frequencies(params: dict, rotary_dim: int) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies, computed as transformers does, then divided by
    `frequency_factors` when given (GGUF files carry Llama 3.x's RoPE scaling that way: llama.cpp's
    per-frequency factors, the `rope_freqs` tensor, applied to default frequencies)."""
    inv_freq = _inverse_frequencies(params, rotary_dim)
    factors = params.get("frequency_factors")
    if factors is None:
        return inv_freq
    factors = torch.as_tensor(factors, dtype=torch.float32, device="cpu")
    if factors.shape != inv_freq.shape:
        raise UnsupportedModelError(f"RoPE frequency_factors has {factors.numel()} entries for "
                                    f"{inv_freq.numel()} frequencies (rotary dim {rotary_dim})")
    return inv_freq / factors


def _inverse_frequencies(params: dict, rotary_dim: int) -> torch.Tensor:
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type '{rope_type}' is not supported yet (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    base = float(params["rope_theta"])
    if rope_type == "proportional":
        return _proportional_inverse_frequencies(params, base, rotary_dim)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / rotary_dim))
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _proportional_inverse_frequencies(params: dict, base: float, head_dim: int) -> torch.Tensor:
    """Gemma 4's full-attention RoPE: the first partial_rotary_factor of the head_dim / 2 frequency
    pairs get theta^(-2i / head_dim) (exponent over the whole head), the rest frequency 0 (cos 1,
    sin 0), so rotate-half runs over the whole head. [head_dim // 2], as transformers computes it."""
    angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = torch.cat((1.0 / (base ** exponents), torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device="cpu")))
    return inv_freq / float(params.get("factor", 1.0))


class RotaryEmbedding(nn.Module):
    """Holds no parameters or buffers: frequencies are computed once per device on first use,
    so models can be built on the meta device and loaded without re-initialising buffers."""

    def __init__(self, params: dict, rotary_dim: int):
        super().__init__()
        self.inv_freq_cpu = inverse_frequencies(params, rotary_dim)  # validates the RoPE type now
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = self.inv_freq_cpu.to(device)
        return self._inv_freq[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> (cos, sin) [B, T, rotary_dim] in `dtype` (computed in float32)."""
        freqs = positions[..., None].to(torch.float32) * self.inv_freq(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on queries and keys together (one fused kernel when compiled)."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D] (D may be a prefix of the head dim: partial RoPE)."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
