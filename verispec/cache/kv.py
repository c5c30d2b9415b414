"""KV cache for attention layers: preallocated buffers, a committed length, and rollback.

A forward pass writes its T new rows after the committed length ("pending" rows) and attends
over committed + pending. Nothing is committed until the caller says how many of those rows to
keep: `commit(n)` keeps the first n (plain decode keeps all T, a verify pass keeps the accepted
prefix), and `rollback(n)` drops n committed rows. Both are pointer moves: rejected rows are
simply overwritten by the next pass. Sliding windows are masks over this full cache, never a
ring buffer, so rollback works after the window has slid.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerCacheSpec:
    num_kv_heads: int
    head_dim: int


class KVCache:
    def __init__(self, specs: list[LayerCacheSpec], capacity: int, dtype: torch.dtype,
                 device: torch.device | str, batch_size: int = 1):
        self.specs = specs
        self.dtype = dtype
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.capacity = 0
        self.length = 0  # committed rows
        self.pending = 0  # rows written by the last forward, not yet committed
        self.keys: list[torch.Tensor] = []  # per layer [B, Hkv, capacity, D]
        self.values: list[torch.Tensor] = []
        self.ensure_capacity(capacity)

    def ensure_capacity(self, needed: int) -> None:
        """Grow the buffers (copying committed rows) so `needed` rows fit."""
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity)
        new_capacity = (new_capacity + 255) // 256 * 256
        keys, values = [], []
        for i, spec in enumerate(self.specs):
            shape = (self.batch_size, spec.num_kv_heads, new_capacity, spec.head_dim)
            k = torch.empty(shape, dtype=self.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.dtype, device=self.device)
            if self.length:
                k[:, :, : self.length].copy_(self.keys[i][:, :, : self.length])
                v[:, :, : self.length].copy_(self.values[i][:, :, : self.length])
            keys.append(k)
            values.append(v)
        self.keys, self.values, self.capacity = keys, values, new_capacity

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, D] as pending rows; return views [B, Hkv, length + T, D]."""
        t = k.shape[2]
        start, end = self.length, self.length + t
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} rows > capacity {self.capacity}")
        self.keys[layer][:, :, start:end].copy_(k)
        self.values[layer][:, :, start:end].copy_(v)
        self.pending = t
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def commit(self, num_rows: int) -> None:
        """Keep the first `num_rows` pending rows of the last forward."""
        if not 0 <= num_rows <= self.pending:
            raise ValueError(f"commit({num_rows}) with {self.pending} pending rows")
        self.length += num_rows
        self.pending = 0

    def rollback(self, num_rows: int) -> None:
        """Drop the last `num_rows` committed rows."""
        if not 0 <= num_rows <= self.length:
            raise ValueError(f"rollback({num_rows}) with {self.length} committed rows")
        self.length -= num_rows
        self.pending = 0

    def reset(self) -> None:
        self.length = 0
        self.pending = 0
