"""The proposer protocol: one batched interface for every drafter (EAGLE3, the MTP head, the
Gemma 4 assistant, suffix and n-gram drafting, test doubles).

The engine's round is written once against it. A sequence starts drafting when its prefill
begins (`start`) and stops when its blocks go back (`release`); after every target pass the
proposer `observe`s what each sequence committed; then `propose` returns up to k drafts per
sequence continuing from each step's `next_token`, for all the round's sequences at once.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from verispec.cache.paged import PagedPools
from verispec.sampling.params import SamplingParams


@dataclass
class TargetStep:
    """What the target committed in one pass (prefill or verify).

    The target processed `token_ids` at positions start_position.., producing `hidden`
    (final-norm) and `aux` (captured residual streams) for each, and chose `next_token` after
    them (the first token after prefill, or the bonus token after a verify pass).
    """

    token_ids: list[int]
    start_position: int
    hidden: torch.Tensor  # [n, H]
    aux: list[torch.Tensor]  # each [n, H_target]
    next_token: int
    pre_norm: torch.Tensor | None = None  # [n, H] residual stream before the final norm


class PassRowStep:
    """A TargetStep read from row `b` of a batched verify pass (engine `_round`): its tensors are
    sliced only when something reads them, and a batched drafter whose rows all come from the same
    pass reads the pass's tensors at once instead (`source`)."""

    def __init__(self, token_ids: list[int], start_position: int, next_token: int, out, b: int):
        self.token_ids = token_ids
        self.start_position = start_position
        self.next_token = next_token
        self.source = (out, b)  # out: the pass output (hidden [B, W, H], aux, pre_norm)

    @property
    def hidden(self) -> torch.Tensor:  # [n, H]
        out, b = self.source
        return out.hidden[b, :len(self.token_ids)]

    @property
    def aux(self) -> list[torch.Tensor]:  # each [n, H_target]
        out, b = self.source
        return [a[b, :len(self.token_ids)] for a in out.aux]

    @property
    def pre_norm(self) -> torch.Tensor | None:  # [n, H]
        out, b = self.source
        return out.pre_norm[b, :len(self.token_ids)] if out.pre_norm is not None else None


@dataclass
class Draft:
    token_ids: list[int]  # k drafted tokens (target vocabulary ids)
    # [k, V] the (processed) distribution each draft was sampled from; None = chosen
    # deterministically (greedy drafting), which verification treats as a one-hot q.
    probs: torch.Tensor | None = None


class DraftingSequence(Protocol):
    """What a proposer reads of an engine sequence."""

    id: int
    prompt_ids: list[int]
    num_cached: int  # committed positions in the target's cache
    block_table: list[int]  # the sequence's blocks in the target's (and a drafter's own) paged pools
    token_ids: list[int]  # prompt + output so far (model-free drafters fill a prefix-cache hit's positions)
    finished: bool  # at release: it ended (False: preempted, it will start again)


@dataclass(frozen=True)
class TargetCache:
    """The target's paged cache as a drafter sees it: its pools (read by the Gemma 4 assistant),
    their geometry (a drafter's own rows are indexed by the same blocks), and the device block
    tables of a list of sequences ([B, N], 0-padded)."""

    pools: PagedPools
    tables: Callable[[list], torch.Tensor]
    use_kernel: bool  # the split-K attention kernel reads the pools in place (CUDA)

    @property
    def num_blocks(self) -> int:
        return self.pools.num_blocks

    @property
    def block_size(self) -> int:
        return self.pools.block_size


class Proposer(ABC):
    method: str = "spec"
    capture_layers: tuple[int, ...] = ()  # target layers whose incoming residual stream it reads
    # the drafter's own K/V rows, indexed by the target's block tables (None: it keeps none); the
    # engine zeroes and copies their blocks with the target's
    pools: PagedPools | None = None
    # one chained drafting step over some sequences, as a fraction of a target pass over them: what
    # the adaptive draft choice charges before anything is measured (a captured EAGLE3 step measured
    # 0.03-0.09 of a decode step on the H200; docs/speculative-decoding.md)
    draft_cost_fraction: float = 0.06
    # whether `observe` reads the steps' target features (False: only their tokens and positions,
    # so rows it has not seen need no copying until it next observes)
    needs_target_features: bool = True
    # whether `propose_on_device` drafts greedily without reading its drafts back
    drafts_on_device: bool = False

    def bind(self, target: TargetCache) -> None:
        """Called once, when the engine has sized the target's cache, before any sequence starts."""

    def capture_graphs(self, batch_sizes: list[int], max_tokens: int, table_width: int) -> None:
        """CUDA only, once at prewarm after the target's graphs: capture the drafter's passes (batch
        buckets x 1..max_tokens tokens) so a round's drafting costs kernels, not Python."""

    def drop_graphs(self) -> None:
        """Forget captured passes (prewarm's dry run builds them once to compile their kernels ahead)."""

    def start(self, seq: DraftingSequence) -> None:
        """A sequence starts (or restarts after a preemption): no state from before."""

    def release(self, seq: DraftingSequence) -> None:
        """A sequence's blocks went back (finished or preempted): drop its state."""

    @abstractmethod
    def observe(self, rows: list[tuple[DraftingSequence, TargetStep]]) -> None:
        """Each sequence's committed target step (a prompt chunk or a verify pass's accepted rows);
        its next draft continues after `step.next_token`."""

    @abstractmethod
    def propose(self, seqs: list[DraftingSequence], num_drafts: list[int], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[Draft]:
        """Up to num_drafts[b] (>= 1) drafts for each sequence, continuing after its last observed
        next_token. A sampling row draws from generators[b] exactly as it would alone."""

    def propose_on_device(self, seqs: list[DraftingSequence], num_drafts: list[int]) -> torch.Tensor:
        """`propose`'s greedy drafts left on the device: [B, max(num_drafts)] target token ids, row
        b's first num_drafts[b] its drafts (the rest padding), for the verify pass to take as its
        inputs and the engine to read back with the pass's result: one wait for the device a round.
        Only where `drafts_on_device`."""
        raise NotImplementedError


def drafts_per_row(chosen: list[torch.Tensor], probs: list[list[torch.Tensor | None]],
                   num_drafts: list[int]) -> list[Draft]:
    """A batched proposer's chained steps -> one Draft per sequence: chosen[i] [B] the tokens of
    step i (on the device: read back with one sync), probs[i][b] the distribution row b's token
    was sampled from (None when greedy), num_drafts[b] how many of the steps row b keeps."""
    table = torch.stack(chosen, dim=1).tolist()  # [B, k]
    drafts = []
    for b, n in enumerate(num_drafts):
        qs = [probs[i][b] for i in range(n)]
        drafts.append(Draft(table[b][:n], torch.stack(qs) if n and qs[0] is not None else None))
    return drafts
