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

On a CPU (`_weight_int4pack_mm_for_cpu`) the kernel is vectorized for bfloat16 activations only
on x86 (float16 and float32 take a scalar loop, 11-15x slower on SmolLM2's shapes on the 2-core
AVX2 CI machine), so float16 activations are rounded to bfloat16 for the product and its result
back to float16; the scale and zero are bfloat16 there too, and the weights are decoded and summed
in float32. Each row is one float32 multiply-add chain over K in order whatever the pass's width
or thread count (bitwise, tests/quant/kernels/test_int4_cpu.py), and on that machine it beat the
float16 GEMM on the dense weights at every width measured (1.3x at 1 row, 1.6-3.6x at 2-512 rows),
so on a CPU it runs every pass, prompts included (`max_rows`; docs/quantization.md, "On a CPU").
"""
from __future__ import annotations

import sys

import torch

SUPPORTED_GROUPS = (32, 64, 128, 256)
# Widest pass given to tinygemm when the layer also has our kernel: on the H200 (Qwen3-8B layers,
# one decode step's sum) tinygemm is 3.16x our Triton kernel at 1 row, 2.15x at 4, 0.79x at 16
# (docs/benchmarks.md; its CUDA packing: tests/gpu/test_gpu_int4_builtin.py)
MAX_ROWS = 8
INNER_K_TILES = (8, 4, 2)  # the largest that divides K (in units of 16 columns) is used
CPU_DTYPES = (torch.bfloat16, torch.float16)  # float16 through bfloat16 casts (module docstring)
CPU_ROW_MULTIPLE = 16  # the CPU packing takes output features in multiples of 16 (CUDA's: 8)


def unsupported_reason(device: torch.device, dtype: torch.dtype, bits: int, group_size: int, out_features: int,
                       in_features: int) -> str | None:
    """Why this layer cannot take the built-in kernel (None: it can)."""
    if (reason := activation_reason(device, dtype)) is not None:
        return reason
    if bits != 4:
        return f"{bits}-bit weights (tinygemm is 4-bit)"
    if group_size not in SUPPORTED_GROUPS:
        return f"group size {group_size} (tinygemm takes {', '.join(map(str, SUPPORTED_GROUPS))})"
    row_multiple = CPU_ROW_MULTIPLE if device.type == "cpu" else 8
    if out_features % row_multiple:
        return f"{out_features} output features (tinygemm needs a multiple of {row_multiple})"
    if inner_k_tiles(in_features) is None:
        return f"{in_features} input features (tinygemm needs a multiple of 32)"
    return None


def activation_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why no layer on `device` with activations in `dtype` takes the built-in kernel (None: 4-bit
    layers of a supported shape do)."""
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        return None if dtype == torch.bfloat16 else f"activations in {name} (tinygemm takes bfloat16)"
    if device.type == "cpu":
        if dtype in CPU_DTYPES:
            return None
        return (f"activations in {name} on a CPU (its int4 kernel runs bfloat16, float16 through casts; "
                f"{name} would lose its precision there)")
    return f"device {device.type} (the built-in int4 product runs on CUDA and CPUs)"


def max_rows(device: torch.device) -> int:
    """The widest pass given to the kernel on `device` (wider ones take the dequantized weight)."""
    return sys.maxsize if device.type == "cpu" else MAX_ROWS


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
    """x [M, K] -> [M, N] in x's dtype: bfloat16, or float16 on a CPU (computed in bfloat16)."""
    if x.device.type == "cuda":
        return torch._weight_int4pack_mm(x, packed, group_size, scale_zero)
    if x.dtype != torch.bfloat16:
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group_size, scale_zero).to(x.dtype)
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_zero)
