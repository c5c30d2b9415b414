"""Quantized weights: everything verispec knows about them lives in this package
(docs/quantization.md).

Formats, loaded as they are stored (no conversion step):
- `mlx_affine`: MLX affine group quantization (mlx-community checkpoints, `mlx_lm.convert -q`),
  and the MLX config; `mlx_float`: MLX's nvfp4 / mxfp4 / mxfp8 modes.
- `compressed_tensors`: llm-compressor's `pack-quantized` integer weights (GPTQ / AWQ / RTN),
  `float-quantized` FP8 and `nvfp4-pack-quantized` weights.
- `nvfp4`: NVFP4 (modelopt's layout, and the E2M1 / E4M3 decoding both layouts share); modelopt FP8.
- `packing`: the b-bit words all integer formats share.
- `convert`: `verispec quantize` (MLX affine, compressed-tensors FP8 / NVFP4 checkpoints);
  `in_memory`: quantizing a loaded model in place (`verispec bench --quant`).

Layers (`layers/`): quantized linear / embedding (`linear`), FP8 / FP4 linear (`float_linear`),
MoE expert stacks (`experts`), the gated MLP's fused product (`mlp`). Kernels (`kernels/`): the
products and dequantization they run. `dispatch`: which kernel a layer runs, decided once.

Loading: `verispec/loading/model_loader.py` calls `quant.loading` to swap the model's linears and
embeddings for quantized layers before weights are copied in, and `prepare` (below) once the model
is on its device and its projections are merged.
"""
from __future__ import annotations

from enum import Enum

from verispec.errors import UnsupportedModelError


class QuantFormat(Enum):
    MLX_AFFINE = "mlx-affine"
    COMPRESSED_TENSORS = "compressed-tensors"
    MODELOPT = "modelopt"


SUPPORTED = "MLX affine (config 'quantization'), compressed-tensors, modelopt"


def detect_format(config: dict) -> QuantFormat | None:
    """The quantized format config.json declares, None for plain float weights; a declared
    format verispec cannot load is an error naming it (never loaded as if it were float)."""
    mlx = config.get("quantization")
    if isinstance(mlx, dict) and "bits" in mlx and "group_size" in mlx:
        return QuantFormat.MLX_AFFINE
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return QuantFormat.COMPRESSED_TENSORS
    if method == "modelopt":
        return QuantFormat.MODELOPT
    raise UnsupportedModelError(
        f"quantization_config.quant_method '{method}' is not supported (supported: {SUPPORTED})")


def prepare(model, dtype=None, exact_numerics: bool = False) -> None:
    """Binds every quantized layer of a loaded model to its kernels, converting what the chosen
    kernels need on CUDA (quant/dispatch.py `prepare`; the loader calls it)."""
    from verispec.quant.dispatch import prepare as prepare_layers

    prepare_layers(model, dtype, exact_numerics)
    if next(model.parameters()).device.type == "cpu":
        from verispec.quant import layer_stack

        layer_stack.install(model)  # whole layers in one kernel call where every product runs the CPU kernel
