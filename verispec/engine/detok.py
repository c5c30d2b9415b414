"""Incremental detokenization and stop strings: text that is safe to show, as tokens arrive."""
from __future__ import annotations

from collections import deque

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


class _StopSearch:
    """One stop string's Knuth-Morris-Pratt search, resumable across feeds. Its failure table grows
    only as far as the text has matched, so a long stop costs nothing until the text follows it."""

    def __init__(self, stop: str):
        self.stop = stop
        self.matched = 0  # the longest suffix of the text so far that is a prefix of the stop
        self._fail = [0]  # _fail[i]: the longest proper border of stop[:i + 1]
        self._border = 0  # the table's build state (KMP's own matching of the stop against itself)

    def _extend_fail(self, length: int) -> None:
        stop, fail, k = self.stop, self._fail, self._border
        for i in range(len(fail), length):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail.append(k)
        self._border = k

    def end_of_match(self, text: str) -> int:
        """Feed `text`; the index in it just past the stop's first complete occurrence, or -1."""
        stop, q, i = self.stop, self.matched, 0
        if q == 0:  # skip to where the stop could begin, at C speed
            i = text.find(stop[0])
            if i < 0:
                return -1
        for i in range(i, len(text)):
            c = text[i]
            while q and stop[q] != c:
                if len(self._fail) < q:
                    self._extend_fail(q)
                q = self._fail[q - 1]
            if stop[q] == c:
                q += 1
                if q == len(stop):
                    self.matched = q
                    return i + 1
        self.matched = q
        return -1


class StopMatcher:
    """Holds back text that might be the start of a stop string; cuts the text at a match.

    The engine thread feeds every sequence's text after every token, so a feed costs time linear in
    the new text (times the number of stops), however long the stops or the held-back text: each
    stop keeps its own resumable search, and the held text is released from the front in pieces.
    At most the longest stop's length minus one character is ever held back.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._searches = [_StopSearch(s) for s in self.stops]
        self._held: deque[str] = deque()  # text received but not yet released, oldest first
        self._head = 0  # characters of _held[0] already released
        self.num_held = 0

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to release, stopped). After a stop, nothing more is released."""
        if not self.stops:
            return text, False
        if not text:
            return "", False
        self._held.append(text)
        self.num_held += len(text)
        text_start = self.num_held - len(text)  # where `text` begins in the held text
        first = None  # the earliest start of a complete stop in the held text
        for search in self._searches:
            end = search.end_of_match(text)
            if end >= 0:
                start = text_start + end - len(search.stop)
                first = start if first is None else min(first, start)
        if first is not None:
            return self.flush()[:first], True
        # Keep the longest suffix that is a prefix of some stop string.
        keep = max(search.matched for search in self._searches)
        return self._release(self.num_held - keep), False

    def _release(self, count: int) -> str:
        """The oldest `count` held characters; a partly released piece is kept whole with an
        offset, so releasing costs what is released, not what stays."""
        out = []
        while count > 0:
            piece = self._held[0]
            take = min(count, len(piece) - self._head)
            out.append(piece[self._head:self._head + take])
            self._head += take
            count -= take
            self.num_held -= take
            if self._head == len(piece):
                self._held.popleft()
                self._head = 0
        return "".join(out)

    def flush(self) -> str:
        return self._release(self.num_held)
