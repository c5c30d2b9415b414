"""Linear layers over floating-point quantized weights, under the checkpoint's own tensor names:
FP8 E4M3 (compressed-tensors float-quantized, modelopt FP8) and NVFP4 (E2M1 values with an E4M3
scale per 16 and a float32 global scale; modelopt and compressed-tensors layouts).

The 8-bit codes are held as uint8 buffers and float32 global scales as int32 buffers (their bits):
casting the model to its dtype would otherwise change them. Weights are dequantized on the fly
into the activations' dtype (no fused FP8 / FP4 kernel yet).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from verispec.quant.layers.linear import debug_once, float_param

FP8_E4M3_MAX = 448.0


def fp8_round_activations(x: torch.Tensor, static_scale: torch.Tensor | None,
                          group_size: int | None = None) -> torch.Tensor:
    """x [..., K] rounded through FP8 E4M3 as compressed-tensors' W8A8 forward does: a scale per
    token, or per token and group of `group_size` columns (amax / 448; dynamic), or the
    checkpoint's input_scale (static); values clamped to +-448, cast to FP8 and back."""
    shape = x.shape
    if group_size is not None:
        x = x.unflatten(-1, (shape[-1] // group_size, group_size))
    if static_scale is None:
        scale = x.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX
        scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    else:
        scale = static_scale.to(x.dtype)
    rounded = (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    return (rounded * scale).reshape(shape)


class Float8Linear(nn.Module):
    """compressed-tensors float-quantized FP8 (E4M3) weights: weight [N, K] (held as its uint8
    bits, so casting the model to its dtype leaves it alone), weight_scale [1] (tensor), [N, 1]
    (channel) or [ceil(N/bn), ceil(K/bk)] (block); w = weight * scale. Dequantized on the fly
    (no fused FP8 kernel yet). W8A8 checkpoints also round the activations through FP8
    (`activations`: "dynamic" per token or per token and `activation_group_size` columns, or
    "static" with the checkpoint's input_scale [1])."""

    checkpoint_buffers = ("weight",)

    def __init__(self, in_features: int, out_features: int, scale_shape: tuple[int, ...],
                 block: tuple[int, int] | None, bias: bool = False, activations: str | None = None,
                 activation_group_size: int | None = None, input_scale_shape: tuple[int, ...] = (1,)):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.uint8))
        self.weight_scale = float_param(*scale_shape)
        self.bias = float_param(out_features) if bias else None
        self.activations, self.activation_group_size = activations, activation_group_size
        self.input_scale = float_param(*input_scale_shape) if activations == "static" else None

    def row_scales(self) -> torch.Tensor | None:
        """[N, 1] per-row scales (tensor and channel strategies), None for blocks."""
        if self.block is not None:
            return None
        return self.weight_scale.reshape(-1, 1).expand(self.out_features, 1)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        compute = torch.promote_types(dtype, torch.float32)
        w = self.weight.view(torch.float8_e4m3fn).to(compute)
        scale = self.weight_scale.to(compute)
        if self.block is not None:
            rows, cols = self.block
            scale = scale.repeat_interleave(rows, 0)[: self.out_features].repeat_interleave(cols, 1)[:, : self.in_features]
        elif scale.dim() <= 1:
            scale = scale.reshape(1, 1)  # one scale for the tensor ([1] or [])
        return (w * scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if x.device.type == "cuda":
            debug_once(self, "on CUDA: dequantizing the whole weight per call (no fused FP8 kernel yet)")
        if self.activations is not None:
            x = fp8_round_activations(x, self.input_scale, self.activation_group_size)
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def same_quantization(self, other: nn.Module) -> bool:
        # projections of one input usually share a static activation scale; when not, they run side by side
        same_static = self.activations != "static" or torch.equal(self.input_scale, other.input_scale)
        return (type(other) is Float8Linear and self.block is None and other.block is None
                and self.activations == other.activations and same_static
                and self.activation_group_size == other.activation_group_size
                and self.in_features == other.in_features and (self.bias is None) == (other.bias is None))

    @classmethod
    def concat_rows(cls, layers: list["Float8Linear"]) -> "Float8Linear":
        """Merged rows keep each layer's scale as per-row (channel) scales."""
        first = layers[0]
        with torch.device("meta"):  # every tensor is replaced below
            merged = cls(first.in_features, sum(l.out_features for l in layers), (1, 1), None,
                         bias=first.bias is not None, activations=first.activations,
                         activation_group_size=first.activation_group_size)
        merged.weight = torch.cat([l.weight for l in layers])
        merged.weight_scale = nn.Parameter(torch.cat([l.row_scales() for l in layers]), requires_grad=False)
        if first.input_scale is not None:
            merged.input_scale = first.input_scale
        if first.bias is not None:
            merged.bias = nn.Parameter(torch.cat([l.bias for l in layers]), requires_grad=False)
        return merged

    def extra_repr(self) -> str:
        strategy = f"block={self.block}" if self.block else f"scale={tuple(self.weight_scale.shape)}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, {strategy}"


class NVFP4Linear(nn.Module):
    """NVFP4 weights (verispec/quant/nvfp4.py) in one of two layouts:
    modelopt: weight uint8 [N, K/2], weight_scale E4M3 [N, K/16], weight_scale_2 float32 [];
    compressed-tensors: weight_packed, weight_scale, weight_global_scale float32 [1].
    w = e2m1 * weight_scale * weight_scale_2 (modelopt) or e2m1 * (weight_scale / global)."""

    LAYOUTS = {"modelopt": ("weight", "weight_scale_2", ()),
               "compressed-tensors": ("weight_packed", "weight_global_scale", (1,))}

    def __init__(self, in_features: int, out_features: int, layout: str, bias: bool = False):
        super().__init__()
        if layout not in self.LAYOUTS:
            raise ValueError(f"NVFP4 layout '{layout}' (known: {', '.join(self.LAYOUTS)})")
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        self.values_name, self.global_name, global_shape = self.LAYOUTS[layout]
        self.checkpoint_buffers = (self.values_name, "weight_scale", self.global_name)
        self.register_buffer(self.values_name, torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // 16, dtype=torch.uint8))
        self.register_buffer(self.global_name, torch.empty(global_shape, dtype=torch.int32))  # float32 bits
        self.bias = float_param(out_features) if bias else None

    def global_scale(self) -> torch.Tensor:
        return getattr(self, self.global_name).view(torch.float32)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        from verispec.quant.nvfp4 import dequantize

        w = dequantize(getattr(self, self.values_name), self.weight_scale, self.global_scale(),
                       divide_by_global=self.layout == "compressed-tensors")
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if x.device.type == "cuda":
            debug_once(self, "on CUDA: dequantizing the whole weight per call (no fused FP4 kernel yet)")
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4 ({self.layout})"


class MLXFloatLinear(nn.Module):
    """MLX nvfp4 / mxfp4 / mxfp8 weights (verispec/quant/mlx_float.py): weight [N, K*bits/32]
    (uint32 words, held as int32) and scales [N, K/group] (uint8 codes); w = value * scale."""

    checkpoint_buffers = ("weight", "scales")

    def __init__(self, in_features: int, out_features: int, spec, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.register_buffer("weight", torch.empty(out_features, in_features * spec.bits // 32, dtype=torch.int32))
        self.register_buffer("scales", torch.empty(out_features, in_features // spec.group_size, dtype=torch.uint8))
        self.bias = float_param(out_features) if bias else None

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        from verispec.quant.mlx_float import dequantize

        return dequantize(self.weight, self.scales, self.spec).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if x.device.type == "cuda":
            debug_once(self, f"on CUDA: dequantizing the whole weight per call (no fused {self.spec.mode} kernel yet)")
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mlx {self.spec.mode}"


class MLXFloatEmbedding(nn.Module):
    """An embedding table [V, H] in an MLX float mode: decodes only the rows it looks up.
    `as_linear()` gives the tied lm_head over the same tensors."""

    checkpoint_buffers = ("weight", "scales")

    def __init__(self, num_embeddings: int, embedding_dim: int, spec):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.spec = num_embeddings, embedding_dim, spec
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim * spec.bits // 32, dtype=torch.int32))
        self.register_buffer("scales", torch.empty(num_embeddings, embedding_dim // spec.group_size, dtype=torch.uint8))
        # the dtype rows come out in: the model's (the table's codes are integers)
        self.register_buffer("dtype_marker", torch.empty(0), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        from verispec.quant.mlx_float import dequantize

        rows = input_ids.reshape(-1)
        w = dequantize(self.weight[rows], self.scales[rows], self.spec)
        return w.view(*input_ids.shape, self.embedding_dim).to(self.dtype_marker.dtype)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        from verispec.quant.mlx_float import dequantize

        return dequantize(self.weight, self.scales, self.spec).to(dtype)

    def as_linear(self) -> MLXFloatLinear:
        with torch.device("meta"):  # its tensors are the table's
            head = MLXFloatLinear(self.embedding_dim, self.num_embeddings, self.spec)
        head.weight, head.scales = self.weight, self.scales
        return head

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mlx {self.spec.mode}"
