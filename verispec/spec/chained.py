"""The chained drafter: what EAGLE3 and the MTP head share.

Both are a small model with its own one-layer cache (row i = position i) that
- observes each committed target step: one pass over the step's tokens shifted by one (plus the
  next token) paired with the target's features at those positions, keeping the rows and the
  last row's output and logits;
- proposes k drafts by chaining: choose a token from the last logits, run one row for it fed the
  last output, repeat; the in-round rows are dropped at the next observe.
Subclasses give the pass (`_last_row`), the target features (`_features`) and the choice of a
token from their logits (`_choose`).

On CUDA the passes run as CUDA graphs (`capture_graphs`): eagerly one is ~100 PyTorch ops of
Python and launch overhead, more than a whole captured target step of a small model (measured on
the demo model: EAGLE3 with one draft at 291 tok/s against 2054 tok/s plain). Captured, a pass
costs its kernels.
"""
from __future__ import annotations

import torch

from verispec import log
from verispec.cache.kv import KVCache, LayerCacheSpec
from verispec.engine.params import SamplingParams
from verispec.kernels import decode_attention as split_k
from verispec.models.base import fuse_small_ops
from verispec.spec.batched import BatchedDrafting
from verispec.spec.proposer import Draft, Proposer, TargetStep


class ChainedDrafter(BatchedDrafting, Proposer):
    def __init__(self, drafter: torch.nn.Module, cache_specs: list[LayerCacheSpec], feature_size: int):
        self.drafter = drafter
        self.feature_size = feature_size
        p = next(drafter.parameters())
        self.device = p.device
        self.cache = KVCache(cache_specs, 256, p.dtype, p.device)
        self.committed = 0  # rows holding target features (in-round draft rows come after)
        self.last_out: torch.Tensor | None = None  # [1, 1, F] output of the last committed row
        self.last_logits: torch.Tensor | None = None  # [V] (or the draft vocabulary)
        self.next_position = 0
        self._graphs: dict = {}  # tokens per pass -> GraphedCall (CUDA, after capture_graphs)

    # ---- what a drafter provides ------------------------------------------------------------
    def _last_row(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over ids, positions [1, T], features [1, T, F], writing T pending cache rows:
        the last row's output [1, 1, F] (fed to the next chained row) and logits."""
        raise NotImplementedError

    def _features(self, step: TargetStep) -> torch.Tensor:
        """The target's features for the step's positions: [T, F]."""
        raise NotImplementedError

    def _choose(self, logits: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
        """The drafter's logits -> (target token id, the distribution it was sampled from over the
        target vocabulary [V], or None when greedy)."""
        raise NotImplementedError

    # ---- the proposer protocol ------------------------------------------------------------------
    def fork(self) -> "ChainedDrafter":
        """Same drafter, its own cache; runs eagerly (captured graphs hold the original's cache)."""
        other = super().fork()
        other.cache = KVCache(self.cache.specs, 256, self.cache.dtype, self.cache.device)
        other._graphs = {}
        other.committed, other.last_out, other.last_logits, other.next_position = 0, None, None, 0
        return other

    def reset(self, prompt_ids: list[int]) -> None:
        self.cache.reset()
        self.committed = 0

    @torch.inference_mode()
    def observe(self, step: TargetStep) -> None:
        """Run the drafter over step.token_ids[1:] + [next_token], paired with the target
        features of step.token_ids (token at p+1 with feature at p), at positions p...; keep the
        rows, and the last row's output and logits (only the last: prefill chunks are long)."""
        self.cache.rollback(self.cache.length - self.committed)  # drop last round's draft rows
        n = len(step.token_ids)
        self._reserve(self.committed + n + 64)
        ids = torch.tensor([step.token_ids[1:] + [step.next_token]], dtype=torch.long, device=self.device)
        positions = torch.arange(step.start_position, step.start_position + n, device=self.device)[None]
        self.last_out, self.last_logits = self._pass(ids, self._features(step)[None], positions)
        self.cache.commit(n)
        self.committed = self.cache.length
        self.next_position = step.start_position + n

    @torch.inference_mode()
    def propose(self, num_drafts: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        logits, out = self.last_logits, self.last_out
        self._reserve(self.cache.length + num_drafts + 1)
        for i in range(num_drafts):
            token, q = self._choose(logits, params, generator)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 == num_drafts:
                break
            ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
            positions = torch.tensor([[self.next_position + i]], device=self.device)
            out, logits = self._pass(ids, out, positions)
            self.cache.commit(1)
        return Draft(tokens, torch.stack(probs) if probs else None)

    # ---- CUDA graphs ------------------------------------------------------------------------------
    def capture_graphs(self, max_tokens: int, capacity: int) -> None:
        """Passes of 1..max_tokens (at most the split-K kernel's 8) tokens as CUDA graphs, the
        drafter's projections merged and small ops compiled as the target's are; its cache is then
        allocated once for `capacity` positions (graphs hold its addresses), read in place."""
        if self.device.type != "cuda" or self._graphs:
            return
        from verispec.engine.cuda_graphs import GraphedCall

        fuse_small_ops(self.drafter)
        p = next(self.drafter.parameters())
        self.cache = KVCache(self.cache.specs, capacity, p.dtype, p.device)
        self.cache.use_decode_kernel = True
        graphs, pool = {}, None
        for t in range(min(max_tokens, split_k.MAX_QUERY_TOKENS), 0, -1):  # largest first: one shared pool
            example = [torch.zeros(1, t, dtype=torch.long, device=p.device),
                       torch.zeros(1, t, self.feature_size, dtype=p.dtype, device=p.device),
                       torch.arange(capacity - t, capacity, device=p.device)[None]]  # rows no sequence reaches
            graphs[t] = GraphedCall(self._last_row, example, pool)
            pool = graphs[t].pool()
        self._graphs = graphs
        self.cache.reset()
        log.debug("%s: captured CUDA graphs for drafter passes of 1..%d tokens", type(self).__name__, len(graphs))

    def _pass(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass, replayed when a graph of its size was captured."""
        graph = self._graphs.get(ids.shape[1])
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
