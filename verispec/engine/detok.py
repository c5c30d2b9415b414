"""Incremental detokenization and stop strings: text that is safe to show, as tokens arrive."""
from __future__ import annotations

from verispec.loading.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas without re-emitting or splitting characters.

    Decoding a window that starts a few tokens back (prefix) keeps tokenizers that merge across
    token boundaries (byte-level BPE, sentencepiece spaces) right; a trailing U+FFFD means an
    incomplete UTF-8 sequence, so that text waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end of generation: release whatever is left, incomplete characters included."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]


class StopMatcher:
    """Holds back text that might be the start of a stop string; cuts the text at a match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.pending = ""  # text received but not yet released

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to release, stopped). After a stop, nothing more is released."""
        if not self.stops:
            return text, False
        self.pending += text
        first = None
        for s in self.stops:
            idx = self.pending.find(s)
            if idx != -1 and (first is None or idx < first):
                first = idx
        if first is not None:
            out, self.pending = self.pending[:first], ""
            return out, True
        # Keep the longest suffix that is a prefix of some stop string.
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
