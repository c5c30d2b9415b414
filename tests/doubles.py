"""Proposer test doubles on the engine's one (batched) drafting protocol.

A double is written per sequence (`reset` at start, `observe_step` after each committed target
step, `draft` for k tokens), which is the simplest way to script drafts; `PerSequence` runs one
copy of it for every sequence the engine starts, behind the batched protocol the engine drives.
"""
from __future__ import annotations

import copy

import torch

from verispec.spec.proposer import Draft, Proposer, TargetStep


class PerSequence(Proposer):
    """Subclasses give reset(prompt_ids), observe_step(step) and draft(k, params, generator) for one
    sequence; the engine sees one proposer drafting for every sequence at once."""

    method = "double"

    def __init__(self):
        self._copies: dict[int, PerSequence] = {}

    def start(self, seq) -> None:
        one = copy.copy(self)
        one._copies = {}
        one.reset(seq.prompt_ids)
        self._copies[seq.id] = one

    def release(self, seq) -> None:
        self._copies.pop(seq.id, None)

    def observe(self, rows: list[tuple[object, TargetStep]]) -> None:
        for seq, step in rows:
            self._copies[seq.id].observe_step(step)

    def propose(self, seqs, num_drafts, params, generators) -> list[Draft]:
        return [self._copies[s.id].draft(k, p, g) for s, k, p, g in zip(seqs, num_drafts, params, generators)]

    # ---- one sequence ------------------------------------------------------------------------------
    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def observe_step(self, step: TargetStep) -> None:
        pass

    def draft(self, num_drafts: int, params, generator: torch.Generator | None) -> Draft:
        raise NotImplementedError
