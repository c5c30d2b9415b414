"""The model cache: K/V for attention layers and state for recurrent layers, with commit/rollback.

A forward pass writes its T new rows after the committed length ("pending" rows) and attends
over committed + pending. Nothing is committed until the caller says how many of those rows to
keep: `commit(n)` keeps the first n (plain decode keeps all T, a verify pass keeps the accepted
prefix), and `rollback(n)` drops n committed rows. Both are pointer moves: rejected rows are
simply overwritten by the next pass. Sliding windows are masks over this full cache, never a
ring buffer, so rollback works after the window has slid.

Recurrent layers (Gated DeltaNet) cannot be un-applied, so a pass keeps what commit(n) needs:
the SSM state after each of its positions (passes of at most `max_tracked_positions` tokens:
decode and verify steps; a longer pass, a prefill chunk, keeps only its final state and must be
committed whole), and the pre-convolution input window, whose slice at n is the conv state after
n rows. Committed recurrent rows cannot be rolled back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.kernels.kv_write import KVDestination


@dataclass(frozen=True)
class LayerCacheSpec:
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class RecurrentLayerSpec:
    conv_dim: int  # channels of the depthwise causal convolution
    conv_kernel: int
    num_heads: int  # value heads of the SSM state
    key_dim: int
    value_dim: int


@dataclass
class _PendingRecurrent:
    conv_window: torch.Tensor  # [B, conv_dim, kernel - 1 + T]: committed conv state + this pass's inputs
    ssm_states: torch.Tensor  # [T, B, H, Dk, Dv] after each position, or [1, ...] final only
    per_position: bool


class KVCache:
    max_tracked_positions = 16  # passes up to this many tokens keep per-position recurrent states
    # Short passes write K/V at device-side positions and attend with the split-K kernel (CUDA).
    use_decode_kernel = False

    def __init__(self, specs: list[LayerCacheSpec | RecurrentLayerSpec], capacity: int, dtype: torch.dtype,
                 device: torch.device | str, batch_size: int = 1):
        self.specs = specs
        self.dtype = dtype
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.capacity = 0
        self.length = 0  # committed rows
        self.pending = 0  # rows written by the last forward, not yet committed
        self.keys: list[torch.Tensor | None] = []  # per attention layer [B, Hkv, capacity, D]
        self.values: list[torch.Tensor | None] = []
        self.recurrent_layers = [i for i, spec in enumerate(specs) if isinstance(spec, RecurrentLayerSpec)]
        self.conv_states: dict[int, torch.Tensor] = {}  # [B, conv_dim, kernel - 1]
        self.ssm_states: dict[int, torch.Tensor] = {}  # [B, H, Dk, Dv] float32
        self._pending_recurrent: dict[int, _PendingRecurrent] = {}
        self._reset_recurrent()
        self.ensure_capacity(capacity)

    def ensure_capacity(self, needed: int) -> None:
        """Grow the buffers (copying committed rows) so `needed` rows fit."""
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity)
        new_capacity = (new_capacity + 255) // 256 * 256
        keys, values = [], []
        for i, spec in enumerate(self.specs):
            if isinstance(spec, RecurrentLayerSpec):
                keys.append(None)
                values.append(None)
                continue
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

    # ---- recurrent layers ---------------------------------------------------------------
    def recurrent_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed (conv state [B, conv_dim, kernel-1], SSM state [B, H, Dk, Dv] float32)."""
        return self.conv_states[layer], self.ssm_states[layer]

    def set_recurrent_pending(self, layer: int, conv_window: torch.Tensor, ssm_states: torch.Tensor,
                              per_position: bool) -> None:
        """Record a pass over T tokens: conv_window [B, conv_dim, kernel-1+T] (committed state
        followed by this pass's pre-conv inputs) and ssm_states [T or 1, B, H, Dk, Dv]."""
        self._pending_recurrent[layer] = _PendingRecurrent(conv_window, ssm_states, per_position)
        self.pending = conv_window.shape[-1] - (self.specs[layer].conv_kernel - 1)

    def _commit_recurrent(self, num_rows: int) -> None:
        for layer, p in self._pending_recurrent.items():
            t = p.conv_window.shape[-1] - (self.specs[layer].conv_kernel - 1)
            if num_rows == 0:
                continue
            # copied into the persistent buffers (never rebound): captured CUDA graphs read them
            if p.per_position:
                self.ssm_states[layer].copy_(p.ssm_states[num_rows - 1])
            elif num_rows == t:
                self.ssm_states[layer].copy_(p.ssm_states[-1])
            else:
                raise ValueError(f"commit({num_rows}) of a {t}-token pass that kept only its final "
                                 f"recurrent state (passes over {self.max_tracked_positions} tokens or fewer "
                                 "keep per-position states)")
            self.conv_states[layer].copy_(p.conv_window[..., num_rows:num_rows + self.specs[layer].conv_kernel - 1])
        self._pending_recurrent.clear()

    def _reset_recurrent(self) -> None:
        for i in self.recurrent_layers:
            if i in self.conv_states:  # zeroed in place: graphs hold these buffers' addresses
                self.conv_states[i].zero_()
                self.ssm_states[i].zero_()
                continue
            spec: RecurrentLayerSpec = self.specs[i]
            self.conv_states[i] = torch.zeros(self.batch_size, spec.conv_dim, spec.conv_kernel - 1,
                                              dtype=self.dtype, device=self.device)
            self.ssm_states[i] = torch.zeros(self.batch_size, spec.num_heads, spec.key_dim, spec.value_dim,
                                             dtype=torch.promote_types(self.dtype, torch.float32), device=self.device)
        self._pending_recurrent.clear()

    def pending_recurrent_snapshot(self) -> dict:
        """What the last forward recorded for commit (a graph replay restores it: no Python
        runs during a replay, but the recorded tensors are the graph's own outputs)."""
        return dict(self._pending_recurrent)

    def restore_pending_recurrent(self, snapshot: dict) -> None:
        self._pending_recurrent = dict(snapshot)

    # ---- commit / rollback ----------------------------------------------------------------
    def write_at(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Write k, v [B, Hkv, T, D] at rows positions[0] (row == position), as pending rows.

        Indexing by a device tensor (not Python ints) keeps the step capturable in a CUDA graph;
        every sequence of the batch shares the positions of row 0."""
        self.kv_destination(layer, positions).write(k, v)

    def kv_destination(self, layer: int, positions: torch.Tensor) -> KVDestination:
        """Where write_at would put this pass's rows ([B, T] positions), for a kernel that writes
        them itself; they count as pending rows from here on."""
        self.pending = positions.shape[1]
        return KVDestination(self.keys[layer], self.values[layer], positions[0], row_dim=2, batch_dim=0, head_dim=1)

    def commit(self, num_rows: int) -> None:
        """Keep the first `num_rows` pending rows of the last forward."""
        if not 0 <= num_rows <= self.pending:
            raise ValueError(f"commit({num_rows}) with {self.pending} pending rows")
        self._commit_recurrent(num_rows)
        self.length += num_rows
        self.pending = 0

    def rollback(self, num_rows: int) -> None:
        """Drop the last `num_rows` committed rows (attention-only caches)."""
        if not 0 <= num_rows <= self.length:
            raise ValueError(f"rollback({num_rows}) with {self.length} committed rows")
        if num_rows and self.recurrent_layers:
            raise ValueError("committed rows of recurrent layers cannot be rolled back")
        self.length -= num_rows
        self.pending = 0
        self._pending_recurrent.clear()

    def batch_cache(self, positions: torch.Tensor, num_keys: int) -> "KVCache":
        """A read view for a drafter pass over the target's rows (see engine.runner.TargetView):
        a contiguous cache is its own view (row i = position i)."""
        return self

    def reset(self) -> None:
        self.length = 0
        self.pending = 0
        self._reset_recurrent()
