"""compressed-tensors checkpoints (what llm-compressor writes): integer `pack-quantized` weights
and FP8 `float-quantized` weights.

config.json: `quantization_config: {quant_method: "compressed-tensors", format, config_groups:
{name: {targets, weights: {num_bits, type, symmetric, strategy, group_size}, input_activations,
format?}}, ignore, quantization_status}`. A quantized linear `P` stores
  P.weight_packed      int32 [N, ceil(K*b/32)]  signed values + 2**(b-1), little-endian bitstream
  P.weight_scale       float [N, K/group_size] (strategy "group") or [N, 1] ("channel")
  P.weight_zero_point  int32 [ceil(N*b/32), groups], packed along N (asymmetric only)
  P.weight_shape       int64 [2] = (N, K)
and decodes as w = (q - z) * scale (z = 0 when symmetric); held unsigned here, that is
w = (u - u_z) * scale with u_z = 2**(b-1) when symmetric. This covers GPTQ / AWQ / RTN W4A16
and W8A16 exports (without activation reordering).

An FP8 linear `P` stores `P.weight` float8_e4m3fn [N, K] and `P.weight_scale` ([1] per tensor,
[N, 1] per channel, [N/bn, K/bk] per block); w = weight * scale. W8A8 schemes (FP8_DYNAMIC: per
token; FP8: static `P.input_scale`) round the activations through FP8 too, as the library's own
forward does; W8A16 ones do not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from verispec.errors import UnsupportedModelError
from verispec.quant.packing import packed_words

SUPPORTED_FORMATS = ("pack-quantized", "float-quantized", "nvfp4-pack-quantized")
FLOAT_STRATEGIES = ("tensor", "channel", "block")
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)  # those the fused kernel decodes
SUPPORTED_STRATEGIES = ("group", "channel")


@dataclass(frozen=True)
class PackedIntSpec:
    bits: int
    symmetric: bool
    group_size: int | None  # None: one group per row ("channel")


def _scheme_error(path: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"compressed-tensors scheme of {path}: {what}")


@dataclass(frozen=True)
class Float8Spec:
    strategy: str  # tensor | channel | block
    block: tuple[int, int] | None  # block strategy: (rows, columns) per scale
    activations: str | None  # None (W8A16), "dynamic" (per token) or "static" (input_scale)
    activation_group_size: int | None = None  # dynamic per token and group of columns


def spec_from_args(path: str, fmt: str, args: dict | None,
                   activations: dict | None) -> PackedIntSpec | Float8Spec | NVFP4Spec:
    if fmt not in SUPPORTED_FORMATS:
        raise _scheme_error(path, f"format '{fmt}' is not supported (supported: {', '.join(SUPPORTED_FORMATS)})")
    if not args:
        raise _scheme_error(path, "no weight quantization arguments")
    if fmt == "float-quantized":
        return _float8_spec(path, args, activations)
    if fmt == "nvfp4-pack-quantized":
        return _nvfp4_spec(path, args, activations)
    if args.get("type", "int") != "int":
        raise _scheme_error(path, f"weight type '{args.get('type')}' is not supported (supported: int)")
    bits = int(args.get("num_bits", 8))
    if bits not in SUPPORTED_BITS:
        raise _scheme_error(path, f"num_bits={bits} is not supported (supported: {', '.join(map(str, SUPPORTED_BITS))})")
    strategy = args.get("strategy", "tensor")
    if strategy not in SUPPORTED_STRATEGIES:
        raise _scheme_error(path, f"strategy '{strategy}' is not supported (supported: {', '.join(SUPPORTED_STRATEGIES)})")
    if args.get("actorder") not in ACTORDERS:
        raise _scheme_error(path, f"actorder '{args.get('actorder')}' is not supported (supported: "
                                  f"{', '.join(str(a) for a in ACTORDERS if a)})")
    if activations:
        # pack-quantized is the weight-only (W*A16) format; integer activation schemes are not
        raise _scheme_error(path, "quantized activations (input_activations) are not supported with "
                                  "pack-quantized (supported: W*A16)")
    group = int(args["group_size"]) if strategy == "group" else None
    return PackedIntSpec(bits, bool(args.get("symmetric", True)), group)


def _float8_spec(path: str, args: dict, activations: dict | None) -> Float8Spec:
    if args.get("type") != "float" or int(args.get("num_bits", 8)) != 8:
        raise _scheme_error(path, f"float-quantized {args.get('type')} {args.get('num_bits')}-bit weights are not "
                                  "supported (supported: float 8-bit, E4M3)")
    strategy = args.get("strategy", "tensor")
    if strategy not in FLOAT_STRATEGIES:
        raise _scheme_error(path, f"FP8 strategy '{strategy}' is not supported (supported: {', '.join(FLOAT_STRATEGIES)})")
    block = tuple(int(v) for v in args["block_structure"]) if strategy == "block" else None
    return Float8Spec(strategy, block, *_fp8_activations(path, activations))


@dataclass(frozen=True)
class NVFP4Spec:
    """E2M1 values, E4M3 scales per 16 columns, a float32 global scale (quant/nvfp4.py)."""


def _nvfp4_spec(path: str, args: dict, activations: dict | None) -> NVFP4Spec:
    kind = (args.get("type"), int(args.get("num_bits", 4)), int(args.get("group_size") or 0))
    if kind != ("float", 4, 16):
        raise _scheme_error(path, f"nvfp4-pack-quantized weights {kind} (type, bits, group) are not supported "
                                  "(supported: float 4-bit group 16)")
    if activations:
        raise _scheme_error(path, "FP4 activations (NVFP4 W4A4) are not supported (supported: NVFP4A16)")
    return NVFP4Spec()


def _fp8_activations(path: str, args: dict | None) -> tuple[str | None, int | None]:
    if not args:
        return None, None
    kind = (args.get("type"), int(args.get("num_bits", 8)), args.get("strategy"), bool(args.get("dynamic")))
    if kind == ("float", 8, "token", True):
        return "dynamic", None
    if kind == ("float", 8, "group", True):
        return "dynamic", int(args["group_size"])
    if kind == ("float", 8, "tensor", False):
        return "static", None
    raise _scheme_error(path, f"FP8 activation scheme {kind} (type, bits, strategy, dynamic) is not supported "
                              "(supported: float 8-bit dynamic per token or per group, float 8-bit static per tensor)")


def _matches(target: str, path: str, module: nn.Module) -> int:
    """How specifically `target` names the layer (compressed-tensors' order: exact name, regex,
    class name); 0 when it does not."""
    if target == path:
        return 3
    if target.startswith("re:") and re.match(target[3:], path):
        return 2
    return 1 if target == type(module).__name__ else 0


def layer_spec(quant_config: dict, path: str, module: nn.Module) -> PackedIntSpec | Float8Spec | NVFP4Spec:
    """The scheme of checkpoint layer `path` from config_groups (the most specific target wins)."""
    best, best_rank = None, 0
    for group in (quant_config.get("config_groups") or {}).values():
        rank = max((_matches(t, path, module) for t in group.get("targets", [])), default=0)
        if rank > best_rank:
            best, best_rank = group, rank
    if best is None:
        raise _scheme_error(path, "its tensors are quantized but no config_groups target names it")
    fmt = best.get("format") or quant_config.get("format")
    return spec_from_args(path, fmt, best.get("weights"), best.get("input_activations"))


def check_config(quant_config: dict) -> None:
    status = quant_config.get("quantization_status", "compressed")
    if status != "compressed":
        raise UnsupportedModelError(f"compressed-tensors quantization_status '{status}' is not supported "
                                    "(supported: compressed, the packed checkpoints llm-compressor saves)")
    if quant_config.get("sparsity_config"):
        raise UnsupportedModelError("compressed-tensors sparsity_config is not supported")


def packed_int_shapes(path: str, spec: PackedIntSpec, out_features: int, in_features: int) -> tuple[int, dict]:
    """The layer's group size (in_features for "channel") and its tensors' shapes."""
    group = spec.group_size or in_features
    if in_features % group:
        raise UnsupportedModelError(f"{path}: {in_features} input features are not a multiple of group_size {group}")
    num_groups = in_features // group
    expected = {"weight_packed": (out_features, packed_words(in_features, spec.bits)),
                "weight_scale": (out_features, num_groups), "weight_shape": (2,)}
    if not spec.symmetric:
        expected["weight_zero_point"] = (packed_words(out_features, spec.bits), num_groups)
    return group, expected


def float8_scale_shape(spec: Float8Spec, out_features: int, in_features: int) -> tuple[int, ...]:
    if spec.strategy == "tensor":
        return (1,)
    if spec.strategy == "channel":
        return (out_features, 1)
    rows, cols = spec.block
    return (-(-out_features // rows), -(-in_features // cols))


def prepare_model(model: nn.Module, config: dict, tensors: dict) -> None:
    """Swap each quantized linear (one with a weight_scale) for a PackedIntLinear, a Float8Linear
    or an NVFP4Linear (see quant/loading.py)."""
    from verispec.quant.layers.float_linear import Float8Linear, NVFP4Linear
    from verispec.quant.layers.linear import PackedIntEmbedding, PackedIntLinear
    from verispec.quant.loading import expect_shapes, quantized_sites, replace_module

    quant_config = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    check_config(quant_config)
    for site in quantized_sites(model, tensors, "weight_scale", (nn.Linear, nn.Embedding)):
        spec = layer_spec(quant_config, site.checkpoint_path, site.module)
        if isinstance(site.module, nn.Embedding):
            if not isinstance(spec, PackedIntSpec):
                raise UnsupportedModelError(f"{site.checkpoint_path}: a {type(spec).__name__.removesuffix('Spec')} "
                                            f"embedding is not supported (pack-quantized integer embeddings are)")
            if getattr(getattr(model, "settings", None), "tie_word_embeddings", False):
                raise UnsupportedModelError(f"{site.checkpoint_path}: a quantized embedding tied to the lm_head is not "
                                            f"supported in compressed-tensors checkpoints (untied ones are)")
            v, h = site.module.num_embeddings, site.module.embedding_dim
            group, expected = packed_int_shapes(site.checkpoint_path, spec, v, h)
            expect_shapes(site, expected, f"{spec.bits}-bit group {group} embedding [{v}, {h}]")
            replace_module(model, site.path, PackedIntEmbedding(v, h, spec.bits, group, spec.symmetric))
            continue
        n, k, bias = site.module.out_features, site.module.in_features, site.module.bias is not None
        if isinstance(spec, NVFP4Spec):
            if k % 16:
                raise UnsupportedModelError(f"{site.checkpoint_path}: {k} input features are not a multiple of 16")
            expect_shapes(site, {"weight_packed": (n, k // 2), "weight_scale": (n, k // 16),
                                 "weight_global_scale": (1,)}, f"NVFP4 over [{n}, {k}]")
            new = NVFP4Linear(k, n, layout="compressed-tensors", bias=bias)
        elif isinstance(spec, Float8Spec):
            expected = {"weight": (n, k), "weight_scale": float8_scale_shape(spec, n, k)}
            if spec.activations == "static":
                expected["input_scale"] = (1,)
            expect_shapes(site, expected, f"FP8 {spec.strategy} over [{n}, {k}]")
            new = Float8Linear(k, n, expected["weight_scale"], spec.block, bias=bias, activations=spec.activations,
                               activation_group_size=spec.activation_group_size)
        else:
            group, expected = packed_int_shapes(site.checkpoint_path, spec, n, k)
            expect_shapes(site, expected, f"{spec.bits}-bit group {group} over [{n}, {k}]")
            if "weight_g_idx" in site.shapes:
                raise UnsupportedModelError(
                    f"{site.checkpoint_path}.weight_g_idx: activation-ordered groups (actorder group, which "
                    f"compressed-tensors 0.20 removed) are not supported; actorder weight / static are")
            new = PackedIntLinear(k, n, spec.bits, group, spec.symmetric, bias=bias)
        replace_module(model, site.path, new)


FP8_E4M3_MAX = 448.0
# GPTQ's activation ordering: weight / static keep each group's columns contiguous, so the
# checkpoint loads as any other (group / dynamic, with a weight_g_idx per column, are refused:
# compressed-tensors 0.20 removed them, so no oracle remains to check them against)
ACTORDERS = (None, False, "static", "weight")


def quantize_fp8_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], scale [N, 1] in weight's dtype): symmetric
    round-to-nearest with one scale per output channel, the scale as compressed-tensors computes
    it (the row's largest magnitude / 448; an all-zero row gets the dtype's eps)."""
    w = weight.to(torch.float32)
    scale = (w.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).to(weight.dtype)
    scale = torch.where(scale == 0, torch.finfo(weight.dtype).eps, scale)
    q = (w / scale.to(torch.float32)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def scheme_config(fmt: str, weights: dict, targets: list[str]) -> dict:
    """The quantization_config compressed-tensors reads back: one weight-only config group
    naming the quantized layers exactly (so nothing else, such as a vision tower, is matched)."""
    group = {"targets": targets, "weights": weights, "input_activations": None, "output_activations": None,
             "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": [], "kv_cache_scheme": None, "sparsity_config": {},
            "transform_config": {}, "global_compression_ratio": None}
