"""torch's built-in int4 matrix product for 4-bit group-quantized weights: tinygemm
(`torch._weight_int4pack_mm` on CUDA, `torch._weight_int4pack_mm_for_cpu` on CPU), the kernel
torchao's int4 weight-only quantization runs. It reads the 4-bit weights once, dequantizes them
in registers straight into tensor-core operands, and is tuned by PyTorch for every M; our Triton
kernel (matmul.py) decodes through shared memory and is bound by instructions per value.

tinygemm's dequantization is w = (q - 8) * scale + zero per group (group sizes 32..256), with
scale and zero stored together as bfloat16 [K/group, N, 2]. Both of our layouts map onto it:
  affine (MLX):              q*s + o        = (q - 8)*s + (o + 8s)
  zero point (compressed-tensors): (q - z)*s = (q - 8)*s + (8 - z)s
The zero is computed in float32 and rounded once to bfloat16 (as MLX's own half-precision
dequantization rounds): within half a bfloat16 ulp of the group's zero, against the exact
reference in matmul.dequantize_reference.

The packed layout is tinygemm's own (built once at load by `_convert_weight_to_int4pack`);
QuantizedLinear.use_builtin_int4 converts a layer (its checkpoint words kept for wider passes). Its rows
are computed independently of the pass's width (row 0 alone == row 0 of 4 or 16, bitwise, on the
H200), as the Triton kernel's are, so speculative verify and plain decode agree row by row.
"""
from __future__ import annotations

import torch

SUPPORTED_GROUPS = (32, 64, 128, 256)
# Widest pass given to tinygemm when the layer also has our kernel: on the H200 (Qwen3-8B layers,
# one decode step's sum) tinygemm is 3.16x our Triton kernel at 1 row, 2.15x at 4, 0.79x at 16
# (docs/benchmarks.md; its CUDA packing: tests/gpu/test_gpu_int4_builtin.py)
MAX_ROWS = 8
INNER_K_TILES = (8, 4, 2)  # the largest that divides K (in units of 16 columns) is used


def unsupported_reason(device: torch.device, dtype: torch.dtype, bits: int, group_size: int, out_features: int,
                       in_features: int) -> str | None:
    """Why this layer cannot take the built-in kernel (None: it can)."""
    if device.type != "cuda":
        return f"device {device.type} (the built-in int4 product is used on CUDA)"
    if dtype != torch.bfloat16:
        return f"activations in {str(dtype).removeprefix('torch.')} (tinygemm takes bfloat16)"
    if bits != 4:
        return f"{bits}-bit weights (tinygemm is 4-bit)"
    if group_size not in SUPPORTED_GROUPS:
        return f"group size {group_size} (tinygemm takes {', '.join(map(str, SUPPORTED_GROUPS))})"
    if out_features % 8:
        return f"{out_features} output features (tinygemm needs a multiple of 8)"
    if inner_k_tiles(in_features) is None:
        return f"{in_features} input features (tinygemm needs a multiple of 32)"
    return None


def inner_k_tiles(in_features: int) -> int | None:
    for tiles in INNER_K_TILES:
        if in_features % (tiles * 16) == 0:
            return tiles
    return None


def scales_and_zeros(scales: torch.Tensor, offsets: torch.Tensor, zero_point: bool) -> torch.Tensor:
    """scales, offsets [N, G] -> tinygemm's [G, N, 2] bfloat16 (scale, zero) pairs."""
    s, o = scales.float(), offsets.float()
    zero = (8 - o) * s if zero_point else o + 8 * s
    return torch.stack([s, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] unsigned 4-bit values (any integer dtype) -> tinygemm's packed weight for q's device."""
    n, k = q.shape
    tiles = inner_k_tiles(k)
    if q.device.type == "cuda":
        # two values per byte, the even column in the high nibble (torchao's layout for this op)
        q = q.to(torch.uint8)
        return torch._convert_weight_to_int4pack((q[:, ::2] << 4) | q[:, 1::2], tiles)
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), tiles)


def matmul(x: torch.Tensor, packed: torch.Tensor, group_size: int, scale_zero: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 -> [M, N] bfloat16."""
    if x.device.type == "cuda":
        return torch._weight_int4pack_mm(x, packed, group_size, scale_zero)
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_zero)
