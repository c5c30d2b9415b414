"""Model-free drafting: suffix decoding (`--suffix`) and prompt-lookup n-grams (`--ngram`).

Both draft by copying: where the sequence's last tokens occurred before, the tokens that followed
are the draft. They keep no K/V and read no target features; a round's host work is one index
lookup per sequence (spec/suffix_index.py), and a sequence whose tail matches nothing gets no
drafts, so its verify row is a plain decode step.
- Suffix decoding (Oliaro et al., arXiv 2411.04975): the sequence's own prompt and output so far,
  plus a bounded cache of recent finished outputs shared by every request to this model; the
  draft follows the most frequent continuation, as long as the match and the counts justify.
- Prompt lookup: the most recent earlier occurrence of the sequence's last n tokens
  (min_n <= n <= max_n, longest first) in the sequence itself; the next k tokens are the draft.
Drafts are deterministic, so verification treats them as one-hot (Draft.probs None): rejection
sampling then accepts draft d with probability p(d), which keeps the target's distribution.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from verispec.errors import VerispecError
from verispec.spec.proposer import Draft, Proposer, TargetStep
from verispec.spec.suffix_index import SuffixIndex, find_matches, frequent_path

_OWN = 0  # a sequence's own index holds one document


@dataclass(frozen=True)
class SuffixOptions:
    max_depth: int = 32  # the longest match counted, in tokens (the suffix tree's depth)
    max_candidates: int = 32  # earlier occurrences counted per lookup, most recent first
    spec_factor: float = 1.0  # drafts per matched token: a match of L tokens drafts at most L * factor + offset
    spec_offset: float = 0.0
    min_prob: float = 0.1  # stop the draft where the product of the continuation's shares drops below
    cache_tokens: int = 1 << 18  # the shared cache of finished outputs, in tokens (0: no cache)
    cache_requests: int = 4096  # ... and in outputs

    def check(self) -> None:
        if self.cache_tokens < 0:
            raise VerispecError(f"--suffix-cache-tokens must be >= 0, got {self.cache_tokens}")
        if self.cache_requests < 0 or self.max_depth < 1 or self.max_candidates < 1 or not 0 <= self.min_prob <= 1:
            raise VerispecError(f"suffix options out of range: {self}")


@dataclass(frozen=True)
class NgramOptions:
    min_n: int = 2
    max_n: int = 5

    def check(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise VerispecError(f"--ngram-min and --ngram-max need 1 <= min <= max, got {self.min_n} and {self.max_n}")


class OutputCache:
    """Recent finished outputs shared by every request to one model, least recently used first out
    once it holds more than `max_tokens` tokens or `max_requests` outputs (an output backing a
    proposed draft counts as used)."""

    def __init__(self, max_tokens: int, max_requests: int):
        self.max_tokens, self.max_requests = max_tokens, max_requests
        self.index = SuffixIndex()
        self._order: OrderedDict[int, None] = OrderedDict()
        self._next_doc = 1

    def add(self, tokens: list[int]) -> None:
        if not tokens or len(tokens) > self.max_tokens or self.max_requests == 0:
            return
        doc, self._next_doc = self._next_doc, self._next_doc + 1
        self.index.extend(doc, list(tokens))
        self._order[doc] = None
        while self.index.num_tokens > self.max_tokens or len(self._order) > self.max_requests:
            oldest, _ = self._order.popitem(last=False)
            self.index.remove(oldest)

    def touch(self, doc: int) -> None:
        if doc in self._order:
            self._order.move_to_end(doc)

    def __len__(self) -> int:
        return len(self._order)


class _CopyingProposer(Proposer):
    """Per sequence, an index over its prompt and output so far, grown by what it commits."""

    draft_cost_fraction = 0.0  # host lookups only, no device pass
    needs_target_features = False

    def __init__(self):
        self._own: dict[int, SuffixIndex] = {}

    def start(self, seq) -> None:
        self._own[seq.id] = SuffixIndex()

    def release(self, seq) -> None:
        self._own.pop(seq.id, None)

    def observe(self, rows: list[tuple[object, TargetStep]]) -> None:
        """The committed sequence is tokens[:start] + step.token_ids + [next_token]; only what the
        index has not seen is appended (normally the accepted drafts and the new next token)."""
        for seq, step in rows:
            index = self._own[seq.id]
            known = index.docs.get(_OWN, [])
            start = step.start_position
            if start > len(known):  # a prefix-cache hit: the cached positions were never observed
                index.extend(_OWN, seq.token_ids[len(known):start])
                known = index.docs[_OWN]
            new = list(step.token_ids) + [step.next_token]
            index.extend(_OWN, new[len(known) - start:])

    def _tail(self, seq) -> tuple[SuffixIndex, list[int]]:
        index = self._own[seq.id]
        return index, index.docs.get(_OWN, [])


class SuffixProposer(_CopyingProposer):
    method = "suffix"

    def __init__(self, options: SuffixOptions = SuffixOptions()):
        super().__init__()
        options.check()
        self.options = options
        self.cache = OutputCache(options.cache_tokens, options.cache_requests) if options.cache_tokens else None

    def release(self, seq) -> None:
        """A finished sequence's output joins the shared cache (a preempted one restarts: not yet)."""
        index = self._own.pop(seq.id, None)
        if index is not None and self.cache is not None and getattr(seq, "finished", False):
            known = index.docs.get(_OWN, [])
            # the engine defers the rows of rounds without drafts: the sequence's tokens are the truth
            self.cache.add(known[len(seq.prompt_ids):] + seq.token_ids[len(known):])

    def remember(self, tokens: list[int]) -> None:
        """Put a text into the shared cache as if a request had produced it (warming, tests)."""
        if self.cache is not None:
            self.cache.add(tokens)

    def propose(self, seqs, num_drafts, params, generators) -> list[Draft]:
        o = self.options
        drafts = []
        for seq, k in zip(seqs, num_drafts):
            own, tail = self._tail(seq)
            indexes = [own] if self.cache is None else [own, self.cache.index]
            matches = find_matches(indexes, tail, 1, o.max_depth, o.max_candidates)
            tokens, _, backing = frequent_path(matches, k, o.spec_factor, o.spec_offset, o.min_prob)
            if self.cache is not None and tokens:
                for m in backing:
                    if m.tokens is not tail:
                        self.cache.touch(m.doc)
            drafts.append(Draft(tokens))
        return drafts


class NgramProposer(_CopyingProposer):
    method = "ngram"

    def __init__(self, options: NgramOptions = NgramOptions()):
        super().__init__()
        options.check()
        self.options = options

    def propose(self, seqs, num_drafts, params, generators) -> list[Draft]:
        o = self.options
        drafts = []
        for seq, k in zip(seqs, num_drafts):
            own, tail = self._tail(seq)
            matches = find_matches([own], tail, o.min_n, o.max_n, 8)
            if not matches:
                drafts.append(Draft([]))
                continue
            m = max(matches, key=lambda m: m.length)  # ties: the most recent
            drafts.append(Draft(m.tokens[m.end:m.end + k]))
        return drafts
