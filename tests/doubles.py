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


class KeyedReplay(PerSequence):
    """Replays each prompt's own known continuation (`continuations` keyed by prompt ids, so one
    engine runs every prompt; or one list for any prompt): right everywhere, or wrong (the next
    token id) where `wrong_at(i)` says, i being the index in the continuation."""

    method = "replay"

    def __init__(self, continuations: dict[tuple, list[int]] | list[int], vocab_size: int, wrong_at=lambda i: False):
        super().__init__()
        self.continuations, self.vocab_size, self.wrong_at = continuations, vocab_size, wrong_at
        self.continuation: list[int] = []
        self.prompt_len = self.next_index = 0

    def reset(self, prompt_ids: list[int]) -> None:
        known = self.continuations
        self.continuation = known if isinstance(known, list) else known.get(tuple(prompt_ids), [])
        self.prompt_len = len(prompt_ids)

    def observe_step(self, step: TargetStep) -> None:
        # next_token sits at position start + n, i.e. continuation[next_index - 1]; drafts follow it
        self.next_index = step.start_position + len(step.token_ids) - self.prompt_len + 1

    def draft(self, num_drafts: int, params, generator) -> Draft:
        out = []
        for j in range(num_drafts):
            i = self.next_index + j
            token = self.continuation[i] if i < len(self.continuation) else 0
            out.append((token + 1) % self.vocab_size if self.wrong_at(i) else token)
        return Draft(out)


class DeviceKeyedReplay(KeyedReplay):
    """KeyedReplay whose greedy drafts are handed over as one tensor (Proposer.propose_on_device),
    as the chained drafters' are: the engine's round then verifies them without reading them back
    first, and reads drafts and target tokens together after the pass."""

    drafts_on_device = True

    def propose_on_device(self, seqs, num_drafts) -> torch.Tensor:
        k = max(num_drafts)
        rows = [self._copies[s.id].draft(n, None, None).token_ids for s, n in zip(seqs, num_drafts)]
        # past a row's count: padding the pass computes and nothing reads (here: the next token id)
        return torch.tensor([row + [(row[-1] + 1) % self.vocab_size] * (k - len(row)) for row in rows])
