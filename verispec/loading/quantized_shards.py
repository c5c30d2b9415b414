"""A tensor-parallel rank's share of an MLX quantized checkpoint (packed weights with per-group
scales and biases along each row's input features).

A column-parallel layer keeps some output rows: its packed words, scales and biases split by the
same rows. A row-parallel layer keeps some input columns: its packed words split by
`features * bits / 32`, its scales and biases by `features / group_size`, so a split must fall on a
group boundary (refused in one line otherwise). After the quantized layers are swapped in, each
row-parallel one all-reduces its partial product (models/layers/parallel.py `make_row_parallel`).
Quantized embedding tables (and a head tied to one) stay whole on every rank.
"""
from __future__ import annotations

from torch import nn

from verispec.errors import VerispecError
from verispec.models.layers.parallel import (RowParallelLinear, Shard, ShardSpec, VocabParallelEmbedding,
                                             VocabParallelHead, make_row_parallel)

QUANTIZED_MARKER = "scales"  # a tensor only quantized layers have (MLX: weight words + scales [+ biases])


def split_quantized(model: nn.Module, parts: dict[str, ShardSpec], shapes: dict[str, tuple], shard: Shard,
                    our_name) -> tuple[dict[str, ShardSpec], dict[str, tuple], list[str]]:
    """(parts with each quantized tensor's own split, the checkpoint shapes as this rank reads them,
    the paths of the row-parallel layers made plain `nn.Linear`s for the quantizer to replace:
    `rewrap` makes them row-parallel again). `parts` and the model as shard_model left them."""
    layers: dict[str, dict[str, tuple]] = {}
    for name, shape in shapes.items():
        layer, _, local = our_name(name).rpartition(".")
        layers.setdefault(layer, {})[local] = shape
    if any(".switch_glu." in layer for layer in layers):
        raise VerispecError(f"--tensor-parallel-size {shard.world_size}: quantized expert stacks are not split over "
                            "GPUs yet; load the bf16 checkpoint")
    parts = dict(parts)
    unwrapped = []
    for layer, tensors in layers.items():
        spec = parts.get(f"{layer}.weight")
        if QUANTIZED_MARKER not in tensors or spec is None:
            continue
        if layer in ("model.embed_tokens", "lm_head"):
            _keep_table_whole(model, layer, parts)
            continue
        if spec.dim == 0:  # output rows: every tensor of the layer by the same rows
            for local in tensors:
                parts[f"{layer}.{local}"] = spec
            continue
        in_features = spec.size * shard.world_size
        num_groups = tensors[QUANTIZED_MARKER][-1]
        group, bits = in_features // num_groups, tensors["weight"][-1] * 32 // in_features
        edges = [edge for span in ((spec.start, spec.stop), *spec.more) for edge in span]
        cut = next((edge for edge in edges if edge % group), None)
        if cut is not None:
            raise VerispecError(f"--tensor-parallel-size {shard.world_size} would cut {layer}'s quantization groups "
                                f"of {group} input features at feature {cut}; use a size that splits whole groups")
        parts[f"{layer}.weight"] = spec.along(1, bits, 32)
        for local in tensors.keys() - {"weight", "bias"}:
            parts[f"{layer}.{local}"] = spec.along(1, 1, group)
        unwrapped.append(_unwrap(model, layer, shard))
    local_shapes = {name: parts[our_name(name)].local_shape(shape) if our_name(name) in parts else shape
                    for name, shape in shapes.items()}
    return parts, local_shapes, unwrapped


def _keep_table_whole(model: nn.Module, layer: str, parts: dict[str, ShardSpec]) -> None:
    """A quantized embedding (and the head, which may be tied to it) whole on every rank."""
    if isinstance(model.model.embed_tokens, VocabParallelEmbedding) and layer == "model.embed_tokens":
        e = model.model.embed_tokens
        model.model.embed_tokens = nn.Embedding(e.num_embeddings, e.embedding_dim)
        parts.pop("model.embed_tokens.weight", None)
    if isinstance(model.lm_head, VocabParallelHead) and (layer == "lm_head" or model.settings.tie_word_embeddings):
        h = model.lm_head
        model.lm_head = nn.Linear(h.in_features, h.out_features, bias=False)
        parts.pop("lm_head.weight", None)


def _unwrap(model: nn.Module, path: str, shard: Shard) -> str:
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name)
    local = getattr(parent, child)
    if not isinstance(local, RowParallelLinear):
        raise TypeError(f"{path} is split by input columns but is a {type(local).__name__}")
    if local.bias is not None:  # every rank's quantized product would add it: the sum would hold it N times
        raise VerispecError(f"--tensor-parallel-size {shard.world_size}: {path} is quantized and has a bias, which "
                            "a split over GPUs does not handle yet")
    setattr(parent, child, nn.Linear(local.in_features, local.out_features, bias=False))
    return path


def rewrap(model: nn.Module, paths: list[str], shard: Shard) -> None:
    """After the quantizer swapped its layers in: each unwrapped layer all-reduces its product."""
    for path in paths:
        module = model.get_submodule(path)
        if type(module) is nn.Linear:  # not quantized after all: the dense row-parallel layer
            parent_name, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent_name), child,
                    RowParallelLinear(module.in_features, module.out_features, False, shard))
        else:
            make_row_parallel(module, shard)
