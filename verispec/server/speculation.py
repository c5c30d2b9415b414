"""The `verispec` field on streamed chat choices: which of the streamed tokens were accepted drafts.

OpenAI clients ignore unknown fields, so each streamed choice may carry
`"verispec": {"tokens": m, "drafted_tokens": n, "rounds": r}`: the m tokens committed since the
previous choice that carried the field, n of them drafts the target accepted (the rest are the
target's own picks), over r target passes after prefill. Counts, not text: an engine chunk's text
can lag its tokens (a possible stop string or an incomplete UTF-8 sequence is held back), so no
exact token -> character map exists on this side; a chunk whose text is held back entirely sends
no choice, and its counts ride on the next one. Summed over a stream the counts are exact:
tokens = completion tokens, drafted_tokens = accepted drafts, rounds = target passes. The last
choice also carries `"stats"` (the engine's GenerationStats: method, drafted, accepted, timings).
"""
from __future__ import annotations

from verispec.engine.types import GenerationChunk


class SpeculationTally:
    def __init__(self) -> None:
        self._tokens = 0
        self._drafted = 0
        self._rounds = 0
        self._stats: dict | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self._rounds += chunk.num_rounds  # target passes after prefill (a merged chunk holds several)
        self._tokens += len(chunk.token_ids)
        self._drafted += chunk.num_drafted
        if chunk.stats is not None:
            self._stats = chunk.stats.as_dict()

    def take(self) -> dict | None:
        """The field's value for the next choice sent (None when there is nothing new), then reset."""
        if not self._tokens and self._stats is None:
            return None
        field: dict = {"tokens": self._tokens, "drafted_tokens": self._drafted, "rounds": self._rounds}
        if self._stats is not None:
            field["stats"] = self._stats
        self._tokens = self._drafted = self._rounds = 0
        self._stats = None
        return field
