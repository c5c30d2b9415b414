"""MLX affine quantization (the mlx-community checkpoints `mlx_lm.convert -q` writes).

config.json carries `quantization: {group_size, bits, mode}` (mlx-lm also copies it to
`quantization_config`), plus per-layer entries keyed by the module path: a dict with that
layer's own `group_size` / `bits`, or `false` for a layer left unquantized. A quantized layer
`P` stores `P.weight` (uint32 [N, K*bits/32], little-endian bitstream), `P.scales` and
`P.biases` ([N, K/group_size], the checkpoint's float dtype); weight = scales * q + biases per
group of `group_size` consecutive input columns. Embeddings are quantized the same way (rows
are token ids), and so are lm_heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.errors import UnsupportedModelError
from verispec.quant.packing import pack_rows, packed_words, unpack_rows

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SUPPORTED_MODES = ("affine", "nvfp4", "mxfp4", "mxfp8")  # the float modes: quant/mlx_float.py
TENSOR_NAMES = ("weight", "scales", "biases")


@dataclass(frozen=True)
class AffineSpec:
    """How one layer is quantized: b-bit values, one scale and bias per `group_size` columns."""

    bits: int
    group_size: int

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise UnsupportedModelError(
                f"MLX affine bits={self.bits} is not supported (supported: {', '.join(map(str, SUPPORTED_BITS))})")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise UnsupportedModelError(
                f"MLX affine group_size={self.group_size} is not supported "
                f"(supported: {', '.join(map(str, SUPPORTED_GROUP_SIZES))})")

    def tensor_shapes(self, out_features: int, in_features: int) -> dict[str, tuple]:
        """The checkpoint shapes of a layer [out_features, in_features] quantized this way."""
        if in_features % self.group_size:
            raise UnsupportedModelError(
                f"{in_features} input features are not a multiple of group_size {self.group_size}")
        groups = (out_features, in_features // self.group_size)
        return {"weight": (out_features, packed_words(in_features, self.bits)), "scales": groups, "biases": groups}


def mode_of(entry: dict | None, default: str) -> str:
    mode = entry.get("mode", default) if isinstance(entry, dict) else default
    if mode not in SUPPORTED_MODES:
        raise UnsupportedModelError(
            f"MLX quantization mode '{mode}' is not supported (supported: {', '.join(SUPPORTED_MODES)})")
    return mode


def layer_spec(path: str, quantization: dict, in_features: int,
               shapes: dict[str, tuple]) -> "AffineSpec | MLXFloatSpec":
    """The spec of checkpoint layer `path`, inferred from its tensors as mlx-lm does (the
    top-level default need not apply to every layer): affine layers have biases, and each float
    mode has its own bits and group size. A per-layer entry in config.json must agree with it."""
    from verispec.quant.mlx_float import MODES, MLXFloatSpec

    entry = quantization.get(path)
    if entry is False:
        raise UnsupportedModelError(f"{path} has quantized tensors but config.json marks it unquantized (false)")
    declared_mode = mode_of(entry, quantization.get("mode", "affine"))
    num_groups = shapes["scales"][-1]
    if in_features % num_groups:
        raise UnsupportedModelError(f"{path}.scales has {num_groups} groups for {in_features} input features")
    bits, group = shapes["weight"][-1] * 32 // in_features, in_features // num_groups
    if "biases" in shapes:
        spec, mode = AffineSpec(bits=bits, group_size=group), "affine"
    else:
        matching = [m for m in MODES.values() if (m.bits, m.group_size) == (bits, group)]
        if not matching:
            raise UnsupportedModelError(
                f"{path}: {bits}-bit group {group} without biases matches no MLX mode (supported: "
                + ", ".join(f"{m.mode} {m.bits}-bit group {m.group_size}" for m in MODES.values()) + ")")
        spec = matching[0]
        mode = spec.mode
    if isinstance(entry, dict):
        declared = (declared_mode, int(entry.get("bits", bits)), int(entry.get("group_size", group)))
        if declared != (mode, bits, group):
            raise UnsupportedModelError(
                f"{path}: config.json declares {declared[0]} {declared[1]}-bit group {declared[2]}, "
                f"its tensors hold {mode} {bits}-bit group {group}")
    return spec


def dequantize(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, spec: AffineSpec,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """packed [N, K*bits/32] int32; scales, biases [N, K/g] -> weight [N, K] in `dtype`
    (default: the scales' dtype), computed as scales * q + biases in that dtype."""
    dtype = dtype or scales.dtype
    n, num_groups = scales.shape
    k = num_groups * spec.group_size
    q = unpack_rows(packed, spec.bits, k).view(n, num_groups, spec.group_size).to(dtype)
    w = q * scales.to(dtype).unsqueeze(-1) + biases.to(dtype).unsqueeze(-1)
    return w.view(n, k)


def quantize(weight: torch.Tensor, spec: AffineSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (packed [N, K*bits/32] int32, scales [N, K/g], biases [N, K/g]) in
    weight's dtype: round-to-nearest over each group's [min, max] range, computed in float32.

    The bias is the group's minimum (so q = 0 decodes to it exactly), and when the range crosses
    zero the scale is nudged so that 0.0 also decodes exactly (padding rows and zeroed weights stay
    zero), in the spirit of mx.quantize.
    """
    n, k = weight.shape
    if k % spec.group_size:
        raise UnsupportedModelError(f"{k} input features are not a multiple of group_size {spec.group_size}")
    levels = (1 << spec.bits) - 1
    w = weight.to(torch.float32).view(n, k // spec.group_size, spec.group_size)
    w_min = w.amin(-1, keepdim=True)
    w_max = w.amax(-1, keepdim=True)
    scale = ((w_max - w_min) / levels).clamp_min(1e-8)
    # make zero representable: shift min onto the grid point nearest zero
    zero_q = torch.round(-w_min / scale)
    crosses_zero = (w_min < 0) & (w_max > 0)
    bias = torch.where(crosses_zero, -zero_q * scale, w_min)
    q = torch.clamp(torch.round((w - bias) / scale), 0, levels)
    out_dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    packed = pack_rows(q.view(n, k).to(torch.int64), spec.bits)
    return packed, scale.squeeze(-1).to(out_dtype), bias.squeeze(-1).to(out_dtype)
