"""Proposer doubles for the GPU identity tests: replays of each prompt's known greedy output."""
from __future__ import annotations

from tests.doubles import PerSequence
from verispec.spec.proposer import Draft, TargetStep


class KeyedReplay(PerSequence):
    """Replays each prompt's own greedy continuation (keyed by its prompt ids), so one engine runs
    every prompt: right everywhere, or wrong (the next token id) where `wrong_at(i)` says, i being
    the index in the continuation."""

    method = "replay"

    def __init__(self, continuations: dict[tuple, list[int]], vocab_size: int, wrong_at=lambda i: False):
        super().__init__()
        self.continuations, self.vocab_size, self.wrong_at = continuations, vocab_size, wrong_at
        self.continuation: list[int] = []
        self.prompt_len = self.next_index = 0

    def reset(self, prompt_ids):
        self.continuation = self.continuations.get(tuple(prompt_ids), [])
        self.prompt_len = len(prompt_ids)

    def observe_step(self, step: TargetStep):
        # next_token sits at position start + n, i.e. continuation[next_index - 1]; drafts follow it
        self.next_index = step.start_position + len(step.token_ids) - self.prompt_len + 1

    def draft(self, num_drafts, params, generator):
        out = []
        for j in range(num_drafts):
            i = self.next_index + j
            token = self.continuation[i] if i < len(self.continuation) else 0
            out.append((token + 1) % self.vocab_size if self.wrong_at(i) else token)
        return Draft(out)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
