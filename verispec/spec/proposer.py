"""The proposer protocol: every drafter (EAGLE3, MTP head, Gemma 4 assistant, test doubles).

The spec loop (engine) is written once against this. After each target pass it calls
`observe` with what the target committed; then `propose` returns up to k drafts that continue
from `TargetStep.next_token`.
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from verispec.engine.params import SamplingParams


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


class Proposer(ABC):
    method: str = "spec"
    capture_layers: tuple[int, ...] = ()  # target layers whose incoming residual stream it reads

    def attach_target_cache(self, cache) -> None:
        """The target's cache for this sequence (the engine calls this before `reset`): an object
        with `length` (committed rows) and `batch_cache(positions, num_keys)` (a read view, see
        engine.runner.TargetView). Drafters that read the target's K/V (the Gemma 4 assistant)
        keep it: when `propose` runs, its rows below `length` are exactly the committed ones."""

    def fork(self) -> "Proposer":
        """A proposer for another sequence: the same drafter weights, its own state. The engine
        gives each running sequence one (the proposer itself serves one of them, with its captured
        graphs). State is whatever reset/observe set, so a shallow copy is a fresh proposer;
        proposers holding buffers (a drafter cache) override this."""
        return copy.copy(self)

    def capture_graphs(self, max_tokens: int, capacity: int) -> None:
        """CUDA only, called once at prewarm after the target's graphs: capture the drafter's own
        steps (passes of 1..max_tokens tokens, positions below `capacity`) as CUDA graphs, so a
        round's drafting costs kernels, not Python. Drafters that do not are run eagerly."""

    @abstractmethod
    def reset(self, prompt_ids: list[int]) -> None:
        """A new sequence starts (before the prefill's observe)."""

    @abstractmethod
    def observe(self, step: TargetStep) -> None:
        """The target committed `step.token_ids`; the next draft continues after `step.next_token`."""

    @abstractmethod
    def propose(self, num_drafts: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        """Up to `num_drafts` tokens continuing after the last observed next_token."""


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
