"""Drafter passes as CUDA graphs: what a chained drafter (EAGLE3, the MTP head) runs per round is
a pass over T rows (observe: the accepted tokens + 1; each chained draft: 1 row) on its own
one-layer cache. Eagerly that is ~100 PyTorch ops of Python and launch overhead per pass: more
than a whole captured target step of a small model (measured on the demo model: EAGLE3 with one
draft at 291 tok/s against 2054 tok/s plain). Captured, a pass costs its kernels.
"""
from __future__ import annotations

import torch

from verispec import log
from verispec.cache.kv import KVCache
from verispec.kernels import decode_attention as split_k


class CapturedPasses:
    """Mixin for proposers with `self.cache` (their KVCache), `self.device`, and
    `_last_row(ids [1, T], features [1, T, F], positions [1, T]) -> (last row's output
    [1, 1, F], last row's logits [V])` writing T pending cache rows (row i = position i)."""

    _graphs: dict | None = None  # tokens per pass -> GraphedCall

    def _drafter_module(self) -> torch.nn.Module:
        raise NotImplementedError

    def _feature_size(self) -> int:
        raise NotImplementedError

    def capture_graphs(self, max_tokens: int, capacity: int) -> None:
        """Passes of 1..max_tokens (at most the split-K kernel's 8) tokens as CUDA graphs, the
        drafter's projections merged and small ops compiled as the target's are; its cache is then
        allocated once for `capacity` positions (graphs hold its addresses), read in place."""
        if self.device.type != "cuda" or self._graphs:
            return
        from verispec.engine.cuda_graphs import GraphedCall

        drafter = self._drafter_module()
        for module in drafter.modules():  # as CausalLM.fuse_small_ops does for the target
            if hasattr(module, "merge_projections"):
                module.merge_projections()
            if module is not drafter and hasattr(module, "fuse"):
                module.fuse()
        p = next(drafter.parameters())
        self.cache = KVCache(self.cache.specs, capacity, p.dtype, p.device)
        self.cache.use_decode_kernel = True
        graphs, pool = {}, None
        for t in range(min(max_tokens, split_k.MAX_QUERY_TOKENS), 0, -1):  # largest first: one shared pool
            example = [torch.zeros(1, t, dtype=torch.long, device=p.device),
                       torch.zeros(1, t, self._feature_size(), dtype=p.dtype, device=p.device),
                       torch.arange(capacity - t, capacity, device=p.device)[None]]  # rows no sequence reaches
            graphs[t] = GraphedCall(self._last_row, example, pool)
            pool = graphs[t].pool()
        self._graphs = graphs
        self.cache.reset()
        log.debug("%s drafter: captured CUDA graphs for passes of 1..%d tokens", type(self).__name__, len(graphs))

    def _pass(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass, replayed when a graph of its size was captured."""
        graph = self._graphs.get(ids.shape[1]) if self._graphs else None
        if graph is None:
            return self._last_row(ids, features, positions)
        out = graph(ids, features, positions)
        self.cache.pending = ids.shape[1]  # the replayed pass wrote its rows
        return out

    def _reserve(self, rows: int) -> None:
        """Room for `rows` cache rows; a graphed cache is never reallocated (graphs hold its
        addresses) and was sized for the whole context at capture."""
        if not self._graphs:
            self.cache.ensure_capacity(rows)
