"""Tensor-parallel layers: one rank's share of a layer, and the collectives that join the shares.

A column-parallel linear (q/k/v, gate/up) needs no layer of its own: each rank's share is a plain
`nn.Linear` over its rows, so merging projections and the dense kernels bind to it as to any
other. What differs is which rows it loads (`ShardSpec`). The layers here are those whose forward
differs: a row-parallel linear sums its ranks' partial products (one all-reduce), the embedding
and the head split the vocabulary.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from verispec.models.layers.moe import FusedExperts


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group."""

    rank: int
    world_size: int
    group: object = None  # the torch.distributed process group of the tensors (None: the default group)
    small_all_reduce: object = None  # kernels/p2p_all_reduce.py's, for the messages it fits (None: NCCL/gloo for all)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in place, or a new tensor: use the result)."""
        fast = self.small_all_reduce
        if fast is not None and fast.fits(x):
            return fast(x)
        dist.all_reduce(x, group=self.group)
        return x


@dataclass(frozen=True)
class ShardSpec:
    """Which part of a checkpoint tensor a rank loads: [start, stop) along `dim`, then each range
    of `more` joined after it (a fused tensor's parts, such as a Gated DeltaNet's q|k|v or fused
    experts' gate|up, each split over the ranks), zero-padded to `size` (a vocabulary that the
    ranks split unevenly)."""

    dim: int
    start: int
    stop: int
    size: int
    more: tuple[tuple[int, int], ...] = ()

    def index(self, ndim: int, start: int | None = None, stop: int | None = None) -> tuple[slice, ...]:
        span = slice(self.start if start is None else start, self.stop if stop is None else stop)
        return tuple(span if d == self.dim else slice(None) for d in range(ndim))

    def local_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.size if d == self.dim else n for d, n in enumerate(full_shape))

    def read(self, tensor, ndim: int) -> torch.Tensor:
        """This rank's part of `tensor` (a torch tensor or a safetensors slice, which reads only
        those bytes), padded to `size`."""
        parts = [tensor[self.index(ndim, a, b)] for a, b in ((self.start, self.stop), *self.more)]
        return self.fit(parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim))

    def fit(self, part: torch.Tensor) -> torch.Tensor:
        """The loaded part, zero-padded along `dim` to the local size."""
        missing = self.size - part.shape[self.dim]
        if missing == 0:
            return part
        pad_shape = list(part.shape)
        pad_shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(pad_shape)], dim=self.dim)

    def along(self, dim: int, scale: int = 1, divisor: int = 1) -> "ShardSpec":
        """The same split along another dim, its offsets times scale / divisor (the columns of a
        row-parallel weight; a quantized weight's packed words or per-group scales)."""
        conv = lambda i: i * scale // divisor  # noqa: E731
        return ShardSpec(dim, conv(self.start), conv(self.stop), conv(self.size),
                         tuple((conv(a), conv(b)) for a, b in self.more))


def even_split(total: int, shard: Shard) -> ShardSpec:
    """Rank's equal part of `total` along dim 0 (the caller checked that it divides)."""
    size = total // shard.world_size
    return ShardSpec(0, shard.rank * size, (shard.rank + 1) * size, size)


def split_parts(sizes: list[int], shard: Shard) -> ShardSpec:
    """Rank's equal part of each of a fused tensor's consecutive parts along dim 0 (each divides)."""
    ranges, offset = [], 0
    for n in sizes:
        part = n // shard.world_size
        ranges.append((offset + shard.rank * part, offset + (shard.rank + 1) * part))
        offset += n
    (start, stop), *more = ranges
    return ShardSpec(0, start, stop, sum(n // shard.world_size for n in sizes), tuple(more))


def vocab_split(vocab_size: int, shard: Shard) -> ShardSpec:
    """Rank's rows of the vocabulary: ceil(V / world) each, the last rank's padded."""
    size = -(-vocab_size // shard.world_size)
    start = min(shard.rank * size, vocab_size)
    return ShardSpec(0, start, min(start + size, vocab_size), size)


class RowParallelLinear(nn.Module):
    """y = x W^T + b where x's features and W's columns are split over the ranks: each rank's
    partial product is summed by one all-reduce, and the bias (held whole on every rank) is added
    once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: Shard):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # this rank's share of in_features
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # the local product; exact numerics rebind it to the row-invariant kernel (models/layers/exact.py)
        self.product = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features / world] -> [..., out]
        y = self.shard.all_reduce(self.product(x, self.weight, None))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds `part` rows of the table; a token's row comes from the rank that holds it
    (the others contribute zeros) and one all-reduce gives every rank the whole embedding."""

    def __init__(self, vocab_size: int, dim: int, shard: Shard):
        super().__init__()
        self.part = vocab_split(vocab_size, shard)
        self.num_embeddings, self.embedding_dim = vocab_size, dim
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(self.part.size, dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, H]
        mine = (input_ids >= self.part.start) & (input_ids < self.part.stop)
        local = torch.where(mine, input_ids - self.part.start, 0)
        return self.shard.all_reduce(F.embedding(local, self.weight) * mine[..., None].to(self.weight.dtype))


class VocabParallelHead(nn.Module):
    """The output projection split by vocabulary rows: each rank computes its rows' logits, and
    rank 0 gathers them (only rank 0 samples). Returns [..., V] on rank 0, None on the others."""

    def __init__(self, hidden_size: int, vocab_size: int, shard: Shard):
        super().__init__()
        self.part = vocab_split(vocab_size, shard)
        self.in_features, self.out_features = hidden_size, vocab_size
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(self.part.size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [..., H]
        local = F.linear(hidden, self.weight).contiguous()
        if self.shard.rank != 0:
            dist.gather(local, None, dst=0, group=self.shard.group)
            return None
        parts = [torch.empty_like(local) for _ in range(self.shard.world_size)]
        dist.gather(local, parts, dst=0, group=self.shard.group)
        return torch.cat(parts, dim=-1)[..., :self.out_features]


class RowParallelExperts(FusedExperts):
    """Fused experts holding a part of every expert's intermediate features (gate and up rows,
    down columns): each rank's weighted sum over its routed experts is partial, one all-reduce
    sums the ranks' parts. The router runs whole on every rank, so all route alike."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act, shard: Shard):
        super().__init__(num_experts, hidden, intermediate, "silu")
        self.act = act  # the whole layer's activation function
        self.shard = shard

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.shard.all_reduce(super().forward(x, top_k_index, top_k_weights))  # [N, H]: this rank's part


@functools.cache
def _row_parallel_class(cls: type) -> type:
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features / world] -> [..., out]
        return self.shard.all_reduce(cls.forward(self, x))

    return type(f"RowParallel{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})


def make_row_parallel(module: nn.Module, shard: Shard) -> None:
    """A layer computing x W^T over this rank's input columns (a quantized linear, whose class the
    quantizer chose) made row-parallel in place: its product is all-reduced. In place, so that its
    tensors keep their checkpoint names. The caller made sure it has no bias."""
    module.__class__ = _row_parallel_class(type(module))
    module.shard = shard
