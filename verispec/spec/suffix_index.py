"""Where the tail of a token sequence occurred before, and what followed: the search behind suffix
decoding and prompt-lookup drafting (spec/suffix.py).

Suffix decoding (Arctic Inference) keeps a suffix tree of depth D: for every substring of up to D
tokens, how often it occurs and which tokens follow it. Materialised in Python that is up to D
nodes per token, too much memory and prefill time for long prompts. Instead every position is
indexed under a hash of the 1, 2, 4, 8 and 16 tokens ending there. A query takes the longest of
those lengths at which the tail occurred before, extends each occurrence backwards to its exact
match length (at most D), and counts the continuations from the occurrences themselves: the
counts a depth-D tree would hold, over the most recent `limit` occurrences. A query costs
O(limit x (D + drafts)), independent of the sequence's length.

Two stores, one hash (a polynomial over the tokens, mod 2^64, so numpy and Python agree): a long
append (a prompt) is hashed with numpy and kept as sorted arrays searched with searchsorted (a 30k
token prompt is indexed in milliseconds, not 150k dict updates); a round's few new tokens go to a
dict. Occurrences are ordered by (document, end): documents are numbered in the order they start
and only the newest one grows, so that is the order they were added in.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterator

import numpy as np

ANCHOR_LENGTHS = (1, 2, 4, 8, 16)
_DOC_SHIFT = 32  # an index entry packs (document, end) into one int: doc << 32 | end
_END_MASK = (1 << _DOC_SHIFT) - 1
_BASE = 0x100000001B3  # odd, so no power of it is 0 mod 2^64
_MASK = (1 << 64) - 1
BULK_TOKENS = 64  # appends at least this long go to the sorted arrays (numpy's per-call cost pays)


@dataclass(frozen=True)
class Match:
    """An earlier occurrence of the tail: tokens[end - length:end] equals the tail's last `length`
    tokens, and tokens[end:] is what followed it."""

    tokens: list[int]  # the document it is in (live: a running sequence's list grows)
    end: int
    length: int
    doc: int


def _anchor(tokens: list[int], end: int, length: int) -> int:
    """The hash of tokens[end - length:end] (ids shifted by one, so a leading 0 counts)."""
    h = 0
    for t in tokens[end - length:end]:
        h = (h * _BASE + t + 1) & _MASK
    return h


def _window_hashes(tokens: np.ndarray) -> dict[int, np.ndarray]:
    """tokens [N] -> per anchor length L, [N] uint64: entry i the hash of tokens[i - L + 1:i + 1]
    (entries i < L - 1 are meaningless). A window of 2L is its first L shifted past the last L."""
    with np.errstate(over="ignore"):
        current = tokens.astype(np.uint64) + np.uint64(1)
        out = {1: current}
        length = 1
        while length * 2 <= ANCHOR_LENGTHS[-1]:
            shift = np.uint64(pow(_BASE, length, 1 << 64))
            doubled = np.zeros_like(current)
            doubled[length:] = current[:-length] * shift + current[length:]
            length *= 2
            out[length] = current = doubled
    return out


@dataclass
class _SortedRun:
    """One bulk append's anchors for one length: hashes ascending, each hash's entries ascending."""

    keys: np.ndarray  # [M] uint64
    entries: np.ndarray  # [M] int64

    def newest_first(self, key: int) -> Iterator[int]:
        keys, k = self.keys, np.uint64(key)
        lo = keys.searchsorted(k, "left")
        if lo == len(keys) or keys[lo] != k:  # most anchors looked up are not here: one search
            return iter(())
        return reversed(self.entries[lo:keys.searchsorted(k, "right")].tolist())


def _merge(older: _SortedRun, keys: np.ndarray, entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two sorted runs as one, by (key, entry). A newer run's entries all follow an older one's
    (documents are numbered as they start, and a document's ends grow), so a stable sort of the
    keys keeps each key's entries ascending; timsort finds the two sorted halves and merges them."""
    all_keys = np.concatenate([older.keys, keys])
    all_entries = np.concatenate([older.entries, entries])
    if len(entries) and len(older.entries) and entries.min() < older.entries.max():
        order = np.lexsort((all_entries, all_keys))  # not the case above (kept correct regardless)
    else:
        order = np.argsort(all_keys, kind="stable")
    return all_keys[order], all_entries[order]


class SuffixIndex:
    """Documents (token lists) indexed by the anchors ending at each of their positions. Tokens only
    append to a document; a removed document's entries are skipped, and dropped by a rebuild once
    they outnumber the live ones (so memory stays proportional to the live tokens)."""

    def __init__(self):
        self.docs: dict[int, list[int]] = {}
        self.num_tokens = 0  # live tokens, over every document
        # anchor length -> hash -> an entry, or a list of them (ascending)
        self._entries: dict[int, dict[int, int | list[int]]] = {a: {} for a in ANCHOR_LENGTHS}
        self._runs: dict[int, list[_SortedRun]] = {a: [] for a in ANCHOR_LENGTHS}
        self._num_dead = 0  # tokens of removed documents still indexed

    @property
    def num_entries(self) -> int:
        """Anchors indexed, live or dead (what the index's memory is proportional to)."""
        return (sum(len(e) for e in self._entries.values())
                + sum(len(r.keys) for runs in self._runs.values() for r in runs))

    def extend(self, doc: int, tokens: list[int]) -> None:
        """Append tokens to document `doc` (created if new) and index the positions they end."""
        seq = self.docs.setdefault(doc, [])
        start = len(seq)
        seq.extend(tokens)
        self.num_tokens += len(tokens)
        if len(tokens) >= BULK_TOKENS:
            self._extend_bulk(doc, seq, start)
            return
        base = doc << _DOC_SHIFT
        for end in range(start + 1, len(seq) + 1):
            entry = base | end
            for length in ANCHOR_LENGTHS:
                if length > end:
                    break
                entries = self._entries[length]
                key = _anchor(seq, end, length)
                known = entries.get(key)
                if known is None:
                    entries[key] = entry  # most anchors occur once: no list for them
                elif type(known) is int:
                    entries[key] = [known, entry]
                else:
                    known.append(entry)

    def _extend_bulk(self, doc: int, seq: list[int], start: int) -> None:
        """Index the positions ending at start+1..len(seq) with numpy, as one sorted run per length."""
        lead = min(start, ANCHOR_LENGTHS[-1] - 1)  # earlier tokens the first new windows reach back to
        hashes = _window_hashes(np.asarray(seq[start - lead:], dtype=np.int64))
        ends = np.arange(start - lead + 1, len(seq) + 1, dtype=np.int64)  # the end of each window
        entries = np.int64(doc << _DOC_SHIFT) | ends
        for length, keys in hashes.items():
            first = max(lead, length - 1)  # new positions whose window lies in the document
            if first >= len(keys):
                continue
            self._add_run(length, keys[first:], entries[first:])

    def _add_run(self, length: int, keys: np.ndarray, entries: np.ndarray) -> None:
        """A sorted run of these anchors, merged with the newest runs while they are at most twice
        its size: the runs' sizes then at least double from newest to oldest, so a lookup searches
        O(log N) of them however many documents came in, not one per cached output
        (docs/benchmarks.md: scripts/suffix_index_bench.py)."""
        order = np.lexsort((entries, keys))
        self._add_sorted(length, keys[order], entries[order])

    def _add_sorted(self, length: int, keys: np.ndarray, entries: np.ndarray) -> None:
        runs = self._runs[length]
        while runs and len(runs[-1].keys) <= 2 * len(keys):
            older = runs.pop()
            keys, entries = _merge(older, keys, entries)
        runs.append(_SortedRun(keys, entries))

    def remove(self, doc: int) -> None:
        tokens = self.docs.pop(doc, None)
        if tokens is None:
            return
        self.num_tokens -= len(tokens)
        self._num_dead += len(tokens)
        if self._num_dead > max(self.num_tokens, 1024):
            self._rebuild()

    def _rebuild(self) -> None:
        """Drop the removed documents' entries: filtered out of the sorted runs with numpy (their
        order kept) and out of the dict; the runs then merge again as they are added back."""
        live = np.fromiter(self.docs, dtype=np.int64, count=len(self.docs))
        for length, runs in self._runs.items():
            self._runs[length] = []
            for run in runs:  # oldest first, as they were added
                keep = np.isin(run.entries >> _DOC_SHIFT, live)
                if keep.any():
                    self._add_sorted(length, run.keys[keep], run.entries[keep])
        for length, entries in self._entries.items():
            kept = {}
            for key, known in entries.items():
                alive = [e for e in ((known,) if type(known) is int else known) if (e >> _DOC_SHIFT) in self.docs]
                if alive:
                    kept[key] = alive[0] if len(alive) == 1 else alive
            self._entries[length] = kept
        self._num_dead = 0

    def _newest_first(self, key: int, anchor: int) -> Iterator[int]:
        """Every entry indexed under (anchor, key), by (document, end) descending."""
        sources = [run.newest_first(key) for run in self._runs[anchor]]
        known = self._entries[anchor].get(key)
        if known is not None:
            sources.append(iter((known,)) if type(known) is int else reversed(known))
        if len(sources) == 1:
            return sources[0]
        return heapq.merge(*sources, reverse=True)

    def lookup(self, key: int, tail: list[int], anchor: int, max_depth: int, limit: int) -> list[Match]:
        """Up to `limit` occurrences (most recent first) of the tail's last `anchor` tokens whose
        anchor hash is `key` and that some token followed, each with its exact match length
        (at most max_depth; a hash collision shows as a length below `anchor` and is dropped)."""
        if limit <= 0:
            return []
        found = []
        num_tail = len(tail)
        for entry in self._newest_first(key, anchor):
            doc, end = entry >> _DOC_SHIFT, entry & _END_MASK
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
