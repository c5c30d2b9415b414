"""Quantized layers decoded back to plain ones, for models small enough that their dense weights
cost next to nothing: there the dense row-invariant kernels run them under exact numerics, which
the quantized formats' fast kernels do not give (docs/serving.md, "Exact numerics").

Which models are small enough is models/layers/numerics.py's SMALL_MODEL_BYTES, on `dense_bytes`.
"""
from __future__ import annotations

import torch
from torch import nn


def _decodable(module: nn.Module) -> bool:
    return hasattr(module, "dequantized_weight") and not isinstance(module, (nn.Linear, nn.Embedding))


def _is_table(module: nn.Module) -> bool:
    return hasattr(module, "num_embeddings") and hasattr(module, "embedding_dim")


def dense_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The model's weights in bytes once every quantized layer is decoded to `dtype` (other
    parameters as they are)."""
    item = torch.empty((), dtype=dtype).element_size()
    decoded, rest = 0, 0
    quantized_params: set[int] = set()
    seen: set[frozenset[int]] = set()  # a tied head shares its table's tensors: one dense copy
    for module in model.modules():
        if _decodable(module):
            tensors = frozenset(id(t) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))
            if tensors in seen:
                continue
            seen.add(tensors)
            rows, cols = ((module.num_embeddings, module.embedding_dim) if _is_table(module)
                          else (module.out_features, module.in_features))
            decoded += rows * cols * item
            quantized_params.update(id(p) for p in module.parameters(recurse=False))
    for p in model.parameters():
        if id(p) not in quantized_params:
            rest += p.numel() * p.element_size()
    return decoded + rest


def has_decodable_layers(model: nn.Module) -> bool:
    return any(_decodable(m) for m in model.modules())


def decode_to_dense(model: nn.Module, dtype: torch.dtype) -> int:
    """Replaces every quantized linear and embedding of `model` by nn.Linear / nn.Embedding holding
    its weight decoded to `dtype` (the format's own decoder); ties the head to the table again
    where the model ties them. Returns how many layers it replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _decodable(child):
                continue
            with torch.no_grad():
                weight = child.dequantized_weight(dtype).contiguous()
            if _is_table(child):
                dense = nn.Embedding(child.num_embeddings, child.embedding_dim, device="meta")
            else:
                dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                if child.bias is not None:
                    dense.bias = nn.Parameter(child.bias.detach().to(dtype), requires_grad=False)
            dense.weight = nn.Parameter(weight, requires_grad=False)
            setattr(parent, name, dense)
            replaced += 1
    if replaced and hasattr(model, "tie_weights"):
        model.tie_weights()
    return replaced
