"""NVFP4 weights: FP4 E2M1 values, one FP8 E4M3 scale per 16 consecutive input columns, and one
float32 scale per tensor.

Two checkpoint layouts carry it:
- NVIDIA modelopt (`hf_quant_config.json` or `quantization_config.quant_method: modelopt`,
  `quant_algo: NVFP4`): `P.weight` uint8 [N, K/2], `P.weight_scale` float8_e4m3fn [N, K/16],
  `P.weight_scale_2` float32 [] and `P.input_scale`; w = e2m1 * weight_scale * weight_scale_2.
- compressed-tensors `nvfp4-pack-quantized`: `P.weight_packed` uint8 [N, K/2], `P.weight_scale`
  float8_e4m3fn [N, K/16], `P.weight_global_scale` float32 [1]; w = e2m1 * (weight_scale / global).
Two values per byte, the first in the low nibble; E2M1 nibble = sign | exponent (2) | mantissa (1).

Activations are not rounded to FP4 here: weights-only (W4A16), as engines run NVFP4 on GPUs
without FP4 tensor cores (everything before Blackwell). modelopt's `FP8` algorithm (per-tensor
FP8 weights and static FP8 activations) is read by the same loader (Float8Linear).
"""
from __future__ import annotations

import torch
from torch import nn

from verispec.errors import UnsupportedModelError

GROUP_SIZE = 16
SUPPORTED_ALGOS = ("NVFP4", "FP8")
# the 16 E2M1 codes: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """packed [..., K/2] uint8 -> values [..., K] float32 (low nibble first)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    low = (packed & 0x0F).long()
    high = (packed >> 4).long()
    return table[torch.stack([low, high], dim=-1).flatten(-2)]


def dequantize(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
               divide_by_global: bool) -> torch.Tensor:
    """packed [N, K/2] uint8; block_scales [N, K/16] (float8_e4m3fn, or its uint8 bits);
    global_scale float32 (one element) -> weight [N, K] float32. modelopt multiplies by its
    weight_scale_2; compressed-tensors divides the block scales by its global scale."""
    if block_scales.dtype == torch.uint8:
        block_scales = block_scales.view(torch.float8_e4m3fn)
    scales = block_scales.to(torch.float32)
    g = global_scale.to(torch.float32).reshape(())
    scales = scales / g if divide_by_global else scales * g
    values = unpack_e2m1(packed)
    n, k = values.shape
    return (values.view(n, k // GROUP_SIZE, GROUP_SIZE) * scales.unsqueeze(-1)).view(n, k)


def modelopt_config(config: dict, hf_quant_config: dict | None) -> dict | None:
    """The modelopt quantization section, from config.json's quantization_config
    (quant_method: modelopt) or the hf_quant_config.json modelopt writes beside it."""
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") == "modelopt":
        return qc
    if hf_quant_config is not None:
        return dict(hf_quant_config.get("quantization", {}), quant_method="modelopt")
    return None


def check_modelopt(quant: dict) -> str:
    algo = quant.get("quant_algo")
    if algo not in SUPPORTED_ALGOS:
        raise UnsupportedModelError(
            f"modelopt quant_algo '{algo}' is not supported (supported: {', '.join(SUPPORTED_ALGOS)})")
    if algo == "NVFP4" and int(quant.get("group_size", GROUP_SIZE)) != GROUP_SIZE:
        raise UnsupportedModelError(f"modelopt NVFP4 group_size {quant.get('group_size')} is not supported "
                                    f"(supported: {GROUP_SIZE})")
    return algo


def prepare_modelopt(model: nn.Module, quant: dict, tensors: dict) -> None:
    """Swap modelopt-quantized linears in (see quant/loading.py)."""
    from verispec.quant.layers.float_linear import Float8Linear, NVFP4Linear
    from verispec.quant.loading import expect_shapes, quantized_sites, replace_module

    algo = check_modelopt(quant)
    for site in quantized_sites(model, tensors, "weight_scale"):
        n, k, bias = site.module.out_features, site.module.in_features, site.module.bias is not None
        if algo == "NVFP4":
            if k % GROUP_SIZE:
                raise UnsupportedModelError(f"{site.checkpoint_path}: {k} input features are not a multiple of "
                                            f"{GROUP_SIZE}")
            expected = {"weight": (n, k // 2), "weight_scale": (n, k // GROUP_SIZE), "weight_scale_2": ()}
            new = NVFP4Linear(k, n, layout="modelopt", bias=bias)
        else:
            expected = {"weight": (n, k), "weight_scale": (), "input_scale": ()}
            new = Float8Linear(k, n, (), None, bias=bias, activations="static", input_scale_shape=())
        expect_shapes(site, expected, f"modelopt {algo} over [{n}, {k}]")
        replace_module(model, site.path, new)


E2M1_MAX = 6.0
E4M3_MAX = 448.0


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x (float32, already scaled into [-6, 6]) -> the nearest E2M1 code (uint8; ties to the even
    code, as IEEE rounding does)."""
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    distance = (x.abs().clamp(max=E2M1_MAX).unsqueeze(-1) - magnitudes).abs()  # [..., 8]
    # argmin takes the first minimum; among two equally near codes prefer the even one
    ties_to_even = distance + (torch.arange(8, device=x.device) % 2) * 1e-7
    code = ties_to_even.argmin(-1).to(torch.uint8)
    return torch.where(x < 0, code | 8, code)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (packed uint8 [N, K/2], block scales float8_e4m3fn [N, K/16], global
    scale float32 [1]) in compressed-tensors' convention (w ~ e2m1 * block / global): the global
    scale maps the tensor's largest magnitude to 448 * 6, each block's scale its own to 6."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise UnsupportedModelError(f"NVFP4: {k} input features are not a multiple of {GROUP_SIZE}")
    w = weight.to(torch.float32)
    amax = w.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    global_scale = (E4M3_MAX * E2M1_MAX / amax).reshape(1)
    blocks = w.view(n, k // GROUP_SIZE, GROUP_SIZE)
    block_scale = (blocks.abs().amax(-1) / E2M1_MAX * global_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    effective = block_scale.to(torch.float32) / global_scale  # [N, K/16]
    effective = torch.where(effective == 0, torch.ones_like(effective), effective)  # all-zero blocks
    codes = round_to_e2m1(blocks / effective.unsqueeze(-1)).view(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, block_scale, global_scale
