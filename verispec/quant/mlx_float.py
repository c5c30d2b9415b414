"""MLX's floating-point quantization modes (`mlx_lm.convert -q --q-mode nvfp4 | mxfp4 | mxfp8`).

config.json: `quantization: {group_size, bits, mode}`. A layer `P` stores `P.weight` (uint32, the
codes as a little-endian byte stream: two E2M1 codes per byte, low nibble first, or one E4M3 code
per byte) and `P.scales` (uint8, one per group): no biases. w = value(code) * scale(group).

| mode  | values | group | scale |
|---|---|---|---|
| nvfp4 | E2M1   | 16    | E4M3 |
| mxfp4 | E2M1   | 32    | E8M0 (2 ** (s - 127)) |
| mxfp8 | E4M3   | 32    | E8M0 |
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.quant import nvfp4


@dataclass(frozen=True)
class MLXFloatSpec:
    mode: str
    bits: int
    group_size: int
    scale_code: str  # "e4m3" | "e8m0"

    def tensor_shapes(self, out_features: int, in_features: int) -> dict[str, tuple]:
        return {"weight": (out_features, in_features * self.bits // 32),
                "scales": (out_features, in_features // self.group_size)}


MODES = {s.mode: s for s in (MLXFloatSpec("nvfp4", 4, 16, "e4m3"), MLXFloatSpec("mxfp4", 4, 32, "e8m0"),
                             MLXFloatSpec("mxfp8", 8, 32, "e8m0"))}


def decode_scales(scales: torch.Tensor, code: str) -> torch.Tensor:
    """scales [..., G] uint8 -> float32."""
    if code == "e4m3":
        return scales.view(torch.float8_e4m3fn).to(torch.float32)
    # ones of the scales' shape: a 0-d base made ldexp resize its output, which torch deprecates
    return torch.ldexp(torch.ones_like(scales, dtype=torch.float32), scales.to(torch.int32) - 127)


def decode_values(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed [..., W] int32 (the uint32 words) -> values [..., W * 32 / bits] float32."""
    codes = packed.contiguous().view(torch.uint8)  # little-endian: the byte stream MLX wrote
    if bits == 4:
        return nvfp4.unpack_e2m1(codes)
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, spec: MLXFloatSpec) -> torch.Tensor:
    """packed [N, K*bits/32] int32, scales [N, K/g] uint8 -> weight [N, K] float32."""
    values = decode_values(packed, spec.bits)
    n, k = values.shape
    s = decode_scales(scales, spec.scale_code)
    return (values.view(n, k // spec.group_size, spec.group_size) * s.unsqueeze(-1)).view(n, k)
