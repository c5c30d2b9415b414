"""Plugging quantized layers into a model built for float weights, at load time.

The model is built as usual (on the meta device); `prepare_model` then replaces each
`nn.Linear` / `nn.Embedding` whose checkpoint tensors are quantized by the matching quantized
layer, with the checkpoint's tensor names. The loader copies tensors in, then `finish_loading`
ties a quantized lm_head to a quantized embedding and lets each layer check and derive what it
needs. Models stay format-agnostic: they only ever see modules that map [..., K] -> [..., N].
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from verispec.errors import UnsupportedModelError, VerispecError
from verispec.quant.layers.float_linear import MLXFloatEmbedding, MLXFloatLinear
from verispec.quant.layers.linear import MLXAffineEmbedding, MLXAffineLinear, PackedIntEmbedding, QuantizedLinear
from verispec.quant import QuantFormat, detect_format


@dataclass(frozen=True)
class CheckpointTensor:
    name: str  # the checkpoint's name (mlx-lm's per-layer config keys use these)
    shape: tuple[int, ...]


def prepare_model(model: nn.Module, config: dict, tensors: dict[str, CheckpointTensor]) -> QuantFormat | None:
    """Swap quantized layers in; `tensors` maps our parameter names (after the model's
    checkpoint_prefix_map) to the checkpoint's. Returns the format, None for float weights."""
    fmt = detect_format(config)
    if fmt is QuantFormat.MLX_AFFINE:
        _prepare_mlx(model, config["quantization"], tensors)
    elif fmt is QuantFormat.COMPRESSED_TENSORS:
        from verispec.quant.compressed_tensors import prepare_model as prepare_ct
        prepare_ct(model, config, tensors)
    elif fmt is QuantFormat.MODELOPT:
        from verispec.quant.nvfp4 import prepare_modelopt
        prepare_modelopt(model, config["quantization_config"], tensors)
    return fmt


def with_sidecar_config(config: dict, model_dir: Path) -> dict:
    """config.json, plus the quantization section modelopt writes to hf_quant_config.json
    instead of config.json (as quantization_config, quant_method "modelopt")."""
    sidecar = model_dir / "hf_quant_config.json"
    if "quantization_config" in config or "quantization" in config or not sidecar.is_file():
        return config
    try:
        section = json.loads(sidecar.read_text()).get("quantization", {})
    except (OSError, json.JSONDecodeError) as exc:
        raise VerispecError(f"could not read {sidecar}: {exc}") from exc
    return dict(config, quantization_config=dict(section, quant_method="modelopt"))


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


@dataclass(frozen=True)
class QuantizedSite:
    """One module of the model whose checkpoint tensors are quantized."""

    path: str  # our module path
    checkpoint_path: str  # the checkpoint's name for it (config entries use these)
    module: nn.Module  # the float module it replaces
    shapes: dict[str, tuple]  # its checkpoint tensors' shapes by local name (weight, scales, ...)


def quantized_sites(model: nn.Module, tensors: dict[str, CheckpointTensor], marker: str,
                    kinds: tuple[type, ...] = (nn.Linear,)) -> list[QuantizedSite]:
    """The modules with a `<path>.<marker>` tensor (a tensor only quantized layers have). Paths
    this model does not have are skipped (the loader ignores their tensors too, e.g. a vision
    tower); a quantized module of another kind is an error naming the kinds supported."""
    by_layer: dict[str, dict[str, tuple]] = {}  # layer path -> {local tensor name: shape}
    for name, t in tensors.items():
        layer, _, local = name.rpartition(".")
        by_layer.setdefault(layer, {})[local] = t.shape
    sites = []
    for path in sorted(layer for layer, local in by_layer.items() if marker in local):
        try:
            module = model.get_submodule(path)
        except AttributeError:
            _refuse_quantized_expert_part(model, path, tensors[f"{path}.{marker}"].name[: -len(marker) - 1])
            continue
        if getattr(module, "checkpoint_buffers", ()):
            continue  # already a quantized module (expert stacks are swapped in before the linears)
        checkpoint_path = tensors[f"{path}.{marker}"].name[: -len(marker) - 1]
        if not isinstance(module, kinds):
            supported = " and ".join(k.__name__ for k in kinds)
            raise UnsupportedModelError(f"{checkpoint_path} is quantized but verispec's {type(module).__name__} "
                                        f"there has no quantized version yet (supported: {supported})")
        sites.append(QuantizedSite(path, checkpoint_path, module, by_layer[path]))
    return sites


def _refuse_quantized_expert_part(model: nn.Module, path: str, checkpoint_name: str) -> None:
    """A quantized per-expert linear (`<experts>.<e>.gate_proj` with scales beside it) where our
    model stacks the experts: named as unsupported instead of surfacing as missing weights."""
    parent = path
    while "." in parent:
        parent = parent.rpartition(".")[0]
        try:
            module = model.get_submodule(parent)
        except AttributeError:
            continue
        if hasattr(module, "checkpoint_part"):
            raise UnsupportedModelError(f"{checkpoint_name}: MoE experts quantized one linear per expert are not "
                                        "supported yet (supported: float experts, per expert or stacked, and "
                                        "MLX-affine quantized expert stacks)")
        return


def expect_shapes(site: QuantizedSite, expected: dict[str, tuple], what: str) -> None:
    """Each named tensor of the layer has the shape its format implies (a missing one too)."""
    for name, shape in expected.items():
        found = site.shapes.get(name)
        if found is None or tuple(found) != tuple(shape):
            raise UnsupportedModelError(f"{site.checkpoint_path}.{name} has shape {found}, expected {tuple(shape)} "
                                        f"for {what}")


def _prepare_mlx(model: nn.Module, quantization: dict, tensors: dict[str, CheckpointTensor]) -> None:
    from verispec.quant import mlx_affine

    mlx_affine.mode_of(None, quantization.get("mode", "affine"))
    _prepare_mlx_experts(model, quantization, tensors)
    for site in quantized_sites(model, tensors, "scales", (nn.Linear, nn.Embedding)):
        m = site.module
        if isinstance(m, nn.Linear):
            out_features, in_features = m.out_features, m.in_features
        else:
            out_features, in_features = m.num_embeddings, m.embedding_dim
        spec = mlx_affine.layer_spec(site.checkpoint_path, quantization, in_features, site.shapes)
        expect_shapes(site, spec.tensor_shapes(out_features, in_features),
                      f"{spec.bits}-bit group {spec.group_size} over [{out_features}, {in_features}]")
        affine = isinstance(spec, mlx_affine.AffineSpec)
        if isinstance(m, nn.Linear):
            new = (MLXAffineLinear(in_features, out_features, spec.bits, spec.group_size, bias=m.bias is not None)
                   if affine else MLXFloatLinear(in_features, out_features, spec, bias=m.bias is not None))
        else:
            new = (MLXAffineEmbedding(out_features, in_features, spec.bits, spec.group_size)
                   if affine else MLXFloatEmbedding(out_features, in_features, spec))
        replace_module(model, site.path, new)
    _tie_quantized_head(model)


SWITCH_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _prepare_mlx_experts(model: nn.Module, quantization: dict, tensors: dict[str, CheckpointTensor]) -> None:
    """mlx-lm's quantized MoE experts (`<experts>.switch_glu.<proj>.{weight,scales,biases}`, each
    [E, ...]) replace the model's FusedExperts with MLXQuantizedExperts, which reads them as stored."""
    from verispec.models.layers.moe import FusedExperts
    from verispec.quant.layers.experts import MLXQuantizedExperts, QuantizedExpertStack
    from verispec.quant import mlx_affine

    paths = sorted({name.split(".switch_glu.")[0] for name in tensors if ".switch_glu." in name})
    for path in paths:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue  # not part of this model (the loader ignores its tensors too)
        if not isinstance(module, FusedExperts):
            raise UnsupportedModelError(f"{path}.switch_glu: quantized experts where verispec's model has "
                                        f"{type(module).__name__}")
        num_experts, two_i, hidden = module.gate_up_proj.shape
        stacks = {}
        for proj, (out_features, in_features) in zip(SWITCH_PROJECTIONS, ((two_i // 2, hidden), (two_i // 2, hidden),
                                                                            (hidden, two_i // 2))):
            key = f"{path}.switch_glu.{proj}"
            if f"{key}.scales" not in tensors:
                raise UnsupportedModelError(f"{key}: expert stacks must all be quantized (this one is not)")
            checkpoint_path = tensors[f"{key}.scales"].name[: -len(".scales")]
            shapes = {local: tensors[f"{key}.{local}"].shape for local in ("weight", "scales", "biases")
                      if f"{key}.{local}" in tensors}
            spec = mlx_affine.layer_spec(checkpoint_path, quantization, in_features, shapes)
            if not isinstance(spec, mlx_affine.AffineSpec):
                raise UnsupportedModelError(f"{checkpoint_path}: experts in MLX's {spec.mode} mode are not supported "
                                            f"(affine 2-8 bit experts are)")
            for name, shape in spec.tensor_shapes(out_features, in_features).items():
                if tuple(shapes.get(name, ())) != (num_experts, *shape):
                    raise UnsupportedModelError(f"{checkpoint_path}.{name} has shape {shapes.get(name)}, expected "
                                                f"{(num_experts, *shape)} for {num_experts} experts")
            stacks[proj] = QuantizedExpertStack(num_experts, in_features, out_features, spec.bits, spec.group_size)
        replace_module(model, path, MLXQuantizedExperts(num_experts, module.act, **stacks))


def _tie_quantized_head(model: nn.Module) -> None:
    """A tied lm_head reads the quantized embedding table: mlx-lm writes no lm_head tensors then."""
    settings = getattr(model, "settings", None)
    if not getattr(settings, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return
    embedding = model.input_embeddings()
    if isinstance(embedding, (MLXAffineEmbedding, MLXFloatEmbedding)):
        model.lm_head = embedding.as_linear()


def loadable_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The quantized layers' packed buffers, by name: the loader fills them like parameters."""
    out = {}
    for prefix, module in model.named_modules():
        wanted = getattr(module, "checkpoint_buffers", ())
        for name, buf in module.named_buffers(recurse=False):
            if name in wanted:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def finish_loading(model: nn.Module) -> None:
    """After the tensors are copied in (and the model's own tie_weights ran)."""
    settings = getattr(model, "settings", None)
    if getattr(settings, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        embedding = model.input_embeddings()
        if isinstance(embedding, (MLXAffineEmbedding, MLXFloatEmbedding)):
            model.lm_head = embedding.as_linear()  # the loaded tensors, shared
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, PackedIntEmbedding)):
            module.finish_loading()
