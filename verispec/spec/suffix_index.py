"""Where the tail of a token sequence occurred before, and what followed: the search behind suffix
decoding and prompt-lookup drafting (spec/suffix.py).

Suffix decoding (Arctic Inference) keeps a suffix tree of depth D: for every substring of up to D
tokens, how often it occurs and which tokens follow it. Materialised in Python that is up to D
nodes per token, too much memory and prefill time for long prompts. Instead every position is
indexed under a hash of the 1, 2, 4, 8 and 16 tokens ending there (five dict updates per token).
A query takes the longest of those lengths at which the tail occurred before, extends each
occurrence backwards to its exact match length (at most D), and counts the continuations from the
occurrences themselves: the counts a depth-D tree would hold, over the most recent `limit`
occurrences. A query costs O(limit x (D + drafts)), independent of the sequence's length.
"""
from __future__ import annotations

from dataclasses import dataclass

ANCHOR_LENGTHS = (1, 2, 4, 8, 16)
_DOC_SHIFT = 32  # an index entry packs (document, end) into one int: doc << 32 | end


@dataclass(frozen=True)
class Match:
    """An earlier occurrence of the tail: tokens[end - length:end] equals the tail's last `length`
    tokens, and tokens[end:] is what followed it."""

    tokens: list[int]  # the document it is in (live: a running sequence's list grows)
    end: int
    length: int
    doc: int


def _anchor(tokens: list[int], end: int, length: int) -> int:
    return hash(tuple(tokens[end - length:end]))


class SuffixIndex:
    """Documents (token lists) indexed by the anchors ending at each of their positions. Tokens only
    append to a document; a removed document's entries are skipped, and dropped by a rebuild once
    they outnumber the live ones (so memory stays proportional to the live tokens)."""

    def __init__(self):
        self.docs: dict[int, list[int]] = {}
        self.num_tokens = 0  # live tokens, over every document
        self._entries: dict[int, int | list[int]] = {}  # anchor hash -> an entry, or a list of them (oldest first)
        self._num_dead = 0  # tokens of removed documents still in _entries

    def extend(self, doc: int, tokens: list[int]) -> None:
        """Append tokens to document `doc` (created if new) and index the positions they end."""
        seq = self.docs.setdefault(doc, [])
        start = len(seq)
        seq.extend(tokens)
        self.num_tokens += len(tokens)
        entries = self._entries
        base = doc << _DOC_SHIFT
        for end in range(start + 1, len(seq) + 1):
            entry = base | end
            for length in ANCHOR_LENGTHS:
                if length > end:
                    break
                key = hash(tuple(seq[end - length:end]))
                known = entries.get(key)
                if known is None:
                    entries[key] = entry  # most anchors occur once: no list for them
                elif type(known) is int:
                    entries[key] = [known, entry]
                else:
                    known.append(entry)

    def remove(self, doc: int) -> None:
        tokens = self.docs.pop(doc, None)
        if tokens is None:
            return
        self.num_tokens -= len(tokens)
        self._num_dead += len(tokens)
        if self._num_dead > max(self.num_tokens, 1024):
            self._rebuild()

    def _rebuild(self) -> None:
        docs = self.docs
        self.docs, self._entries, self.num_tokens, self._num_dead = {}, {}, 0, 0
        for doc, tokens in docs.items():
            self.extend(doc, tokens)

    def lookup(self, key: int, tail: list[int], anchor: int, max_depth: int, limit: int) -> list[Match]:
        """Up to `limit` occurrences (most recent first) of the tail's last `anchor` tokens whose
        anchor hash is `key` and that some token followed, each with its exact match length
        (at most max_depth; a hash collision shows as a length below `anchor` and is dropped)."""
        known = self._entries.get(key)
        if known is None or limit <= 0:
            return []
        entries = (known,) if type(known) is int else reversed(known)
        found = []
        num_tail = len(tail)
        mask = (1 << _DOC_SHIFT) - 1
        for entry in entries:
            doc, end = entry >> _DOC_SHIFT, entry & mask
            tokens = self.docs.get(doc)
            if tokens is None or end >= len(tokens):  # removed, or the tail itself: nothing followed
                continue
            depth = min(max_depth, end, num_tail)
            length = 0
            while length < depth and tokens[end - 1 - length] == tail[num_tail - 1 - length]:
                length += 1
            if length >= anchor:
                found.append(Match(tokens, end, length, doc))
                if len(found) >= limit:
                    break
        return found


def find_matches(indexes: list[SuffixIndex], tail: list[int], min_length: int, max_depth: int,
                 limit: int) -> list[Match]:
    """Occurrences of the tail's longest suffix (of at least min_length tokens) found at the longest
    anchor length that has any, searched in `indexes` in order, at most `limit` of them."""
    lengths = [a for a in ANCHOR_LENGTHS if a <= max_depth]
    shortest = max([a for a in lengths if a <= min_length], default=lengths[0])
    for anchor in reversed(lengths):
        if anchor < shortest:
            break
        if anchor > len(tail):
            continue
        key = _anchor(tail, len(tail), anchor)
        found: list[Match] = []
        for index in indexes:
            found += index.lookup(key, tail, anchor, max_depth, limit - len(found))
        found = [m for m in found if m.length >= min_length]
        if found:
            return found
    return []


def frequent_path(matches: list[Match], max_drafts: int, spec_factor: float, spec_offset: float,
                  min_prob: float) -> tuple[list[int], float, list[Match]]:
    """The draft suffix decoding proposes from a set of occurrences: for each match length L
    (longest first), the occurrences matching at least L tokens vote on each next token; the
    path follows the most frequent one while the product of its shares stays >= min_prob, for at
    most min(max_drafts, L * spec_factor + spec_offset) tokens (a longer match earns a longer
    draft). Returns the path with the highest score (the sum of the products: its expected number
    of accepted tokens under the counts), that score, and the occurrences that back it whole."""
    best: tuple[list[int], float, list[Match]] = ([], 0.0, [])
    for length in sorted({m.length for m in matches}, reverse=True):
        cap = min(max_drafts, int(length * spec_factor + spec_offset + 1e-9))
        if cap <= best[1]:  # a path's score is at most its length
            continue
        live = [m for m in matches if m.length >= length]
        drafts, prob, score = [], 1.0, 0.0
        for j in range(cap):
            counts: dict[int, int] = {}
            for m in live:
                if m.end + j < len(m.tokens):
                    token = m.tokens[m.end + j]
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)  # ties: the most recent occurrence's token
            # occurrences that ran out of tokens still count in the denominator, as in a tree a
            # node's count includes the suffixes that end at it
            prob *= counts[token] / len(live)
            if prob < min_prob:
                break
            drafts.append(token)
            score += prob
            live = [m for m in live if m.end + j < len(m.tokens) and m.tokens[m.end + j] == token]
        if score > best[1]:
            best = (drafts, score, live)
    return best
