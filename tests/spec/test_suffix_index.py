"""The suffix index behind --suffix / --ngram: matches and counts against a brute-force scan of the
tokens, the draft's scoring on hand-checked cases, and the shared cache's eviction bounds."""
from __future__ import annotations

import random

import pytest

from verispec.spec.suffix import NgramOptions, NgramProposer, OutputCache, SuffixOptions, SuffixProposer
from verispec.spec.suffix_index import ANCHOR_LENGTHS, SuffixIndex, find_matches, frequent_path


def brute_force_matches(tokens: list[int], max_depth: int) -> set[tuple[int, int]]:
    """Every earlier occurrence (end, exact match length <= max_depth) of the tail's longest suffix
    at the longest anchor length that has one: what find_matches returns with no limit."""
    n = len(tokens)

    def length_at(end: int) -> int:
        length = 0
        while length < min(max_depth, end) and tokens[end - 1 - length] == tokens[n - 1 - length]:
            length += 1
        return length

    lengths = {end: length_at(end) for end in range(1, n)}  # end < n: some token followed
    for anchor in reversed([a for a in ANCHOR_LENGTHS if a <= max_depth]):
        found = {(end, length) for end, length in lengths.items() if length >= anchor}
        if found:
            return found
    return set()


@pytest.mark.parametrize("vocab", [2, 3, 5, 20])
def test_matches_equal_a_brute_force_scan(vocab):
    rng = random.Random(vocab)
    for trial in range(30):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        index = SuffixIndex()
        # grown in pieces, as observe does
        cut = sorted(rng.sample(range(len(tokens) + 1), min(3, len(tokens) + 1)))
        for a, b in zip([0] + cut, cut + [len(tokens)]):
            index.extend(7, tokens[a:b])
        assert index.docs[7] == tokens
        for max_depth in (3, 32):
            found = find_matches([index], tokens, 1, max_depth, limit=10_000)
            assert {(m.end, m.length) for m in found} == brute_force_matches(tokens, max_depth), (trial, tokens)
            ends = [m.end for m in found]
            assert ends == sorted(ends, reverse=True)  # most recent first


def test_limit_keeps_the_most_recent_occurrences():
    tokens = [1, 2, 9] * 20 + [1, 2]
    index = SuffixIndex()
    index.extend(0, tokens)
    found = find_matches([index], tokens, 1, 32, limit=4)
    assert [m.end for m in found] == [59, 56, 53, 50]


def test_counts_and_threshold_shape_the_draft():
    # "1 2 3" occurred twice before: both continue with 4, then 6 and 5 (a 1/2 share each)
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3]
    index = SuffixIndex()
    index.extend(0, tokens)
    matches = find_matches([index], tokens, 1, 32, 32)
    assert sorted((m.end, m.length) for m in matches) == [(3, 3), (8, 3)]
    drafts, score, backing = frequent_path(matches, 8, 1.0, 0.0, 0.1)
    assert drafts == [4, 6, 1]  # capped at the match length (3); the tie goes to the most recent
    assert score == pytest.approx(1 + 0.5 + 0.5)
    assert [m.end for m in backing] == [8]
    # a threshold above the split stops the draft before it
    assert frequent_path(matches, 8, 1.0, 0.0, 0.6)[0] == [4]
    # the draft count caps it; a larger spec factor lets a short match draft longer
    assert frequent_path(matches, 2, 1.0, 0.0, 0.1)[0] == [4, 6]
    assert frequent_path(matches, 8, 2.0, 0.0, 0.1)[0] == [4, 6, 1, 2, 3]  # up to the sequence's end


def test_longer_match_wins_over_more_frequent_shorter_one():
    # the tail "7 8" matches once with two tokens (-> 5) and often with one ("8" -> 0)
    tokens = [8, 0, 8, 0, 8, 0, 7, 8, 5, 3, 7, 8]
    index = SuffixIndex()
    index.extend(0, tokens)
    matches = find_matches([index], tokens, 1, 32, 32)
    assert {(m.end, m.length) for m in matches} == {(8, 2)}
    assert frequent_path(matches, 4, 1.0, 0.0, 0.1)[0] == [5, 3]


def test_nothing_matches_nothing_drafted():
    index = SuffixIndex()
    index.extend(0, list(range(50)))
    assert find_matches([index], index.docs[0], 1, 32, 32) == []
    assert frequent_path([], 8, 1.0, 0.0, 0.1) == ([], 0.0, [])


def test_output_cache_eviction_bounds():
    cache = OutputCache(max_tokens=100, max_requests=5)
    rng = random.Random(0)
    outputs = [[rng.randrange(50) for _ in range(rng.randrange(5, 40))] for _ in range(200)]
    for i, out in enumerate(outputs):
        cache.add(out)
        assert cache.index.num_tokens <= 100 and len(cache) <= 5
        live = list(cache.index.docs.values())
        assert live == [o for o in outputs[:i + 1] if o in live]  # the newest ones, in order
        # removed documents' entries are dropped by rebuilds: the index stays proportional to the live tokens
        assert cache.index.num_entries <= len(ANCHOR_LENGTHS) * 2 * max(cache.index.num_tokens, 1024)
    for m in find_matches([cache.index], outputs[-1][:3], 1, 32, 1000):
        assert m.doc in cache.index.docs
    assert len(cache.index.docs) == len(cache)
    too_long = OutputCache(max_tokens=10, max_requests=5)
    too_long.add(list(range(11)))  # longer than the whole cache: not kept
    assert len(too_long) == 0


def test_output_cache_keeps_what_is_used():
    cache = OutputCache(max_tokens=1000, max_requests=2)
    cache.add([1, 2, 3])
    cache.add([4, 5, 6])
    first = next(iter(cache.index.docs))
    cache.touch(first)
    cache.add([7, 8, 9])  # the least recently used ([4, 5, 6]) goes
    assert sorted(cache.index.docs.values()) == [[1, 2, 3], [7, 8, 9]]


class _Seq:
    def __init__(self, id, prompt_ids):
        self.id, self.prompt_ids, self.token_ids, self.finished = id, prompt_ids, list(prompt_ids), True


class _Step:
    def __init__(self, token_ids, start_position, next_token):
        self.token_ids, self.start_position, self.next_token = token_ids, start_position, next_token


def test_suffix_proposer_drafts_from_own_tokens_and_the_shared_cache():
    proposer = SuffixProposer(SuffixOptions(cache_tokens=1000))
    seq = _Seq(1, [10, 11, 12, 13, 10, 11])
    proposer.start(seq)
    proposer.observe([(seq, _Step(seq.prompt_ids[:4], 0, 10)), (seq, _Step([10, 11], 4, 12))])
    # the tail "10 11 12" occurred at the start: "13 10 11 12 ..." follows, capped by the match length
    assert proposer.propose([seq], [8], [None], [None])[0].token_ids == [13, 10, 11]
    assert proposer.propose([seq], [2], [None], [None])[0].token_ids == [13, 10]
    seq.token_ids = seq.prompt_ids + [12, 40, 41]
    proposer.observe([(seq, _Step([12, 40], 6, 41))])
    proposer.release(seq)
    assert list(proposer.cache.index.docs.values()) == [[12, 40, 41]]  # the output joined the cache
    other = _Seq(2, [99, 12])
    proposer.start(other)
    proposer.observe([(other, _Step([99, 12], 0, 40))])
    assert proposer.propose([other], [4], [None], [None])[0].token_ids == [41]  # "12 40" -> 41, from the cache
    fresh = _Seq(3, [1, 2, 3])
    proposer.start(fresh)
    proposer.observe([(fresh, _Step([1, 2, 3], 0, 4))])
    assert proposer.propose([fresh], [4], [None], [None])[0].token_ids == []  # nothing matches: no drafts


def test_ngram_proposer_copies_the_longest_recent_match():
    proposer = NgramProposer(NgramOptions(min_n=2, max_n=3))
    seq = _Seq(1, [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7])
    proposer.start(seq)
    proposer.observe([(seq, _Step(seq.prompt_ids[:-1], 0, 7))])
    # "5 6 7" (n = 3) is absent at the tail ("2 6 7"); n = 2 "6 7": most recent at end 8 -> "1 2 6 7"
    assert proposer.propose([seq], [4], [None], [None])[0].token_ids == [1, 2, 6, 7]
    lone = _Seq(2, [1, 2, 3, 1])
    proposer.start(lone)
    proposer.observe([(lone, _Step([1, 2, 3], 0, 1))])
    assert proposer.propose([lone], [4], [None], [None])[0].token_ids == []  # one token matched: below min_n


@pytest.mark.parametrize("vocab", [2, 7, 300])
def test_bulk_appends_index_what_token_by_token_appends_do(vocab):
    """A long append (hashed with numpy into sorted arrays) and the same tokens appended a few at a
    time (the dict): every lookup finds the same occurrences, in the same order, also where bulk and
    small appends mix in one document and across documents."""
    rng = random.Random(vocab)
    docs = {d: [rng.randrange(vocab) for _ in range(rng.randrange(1, 700))] for d in (3, 5, 9)}
    bulk, small, mixed = SuffixIndex(), SuffixIndex(), SuffixIndex()
    for doc, tokens in docs.items():
        bulk.extend(doc, tokens)
        for i in range(0, len(tokens), 5):
            small.extend(doc, tokens[i:i + 5])
        cut = rng.randrange(len(tokens) + 1)
        mixed.extend(doc, tokens[:cut // 2])
        mixed.extend(doc, tokens[cut // 2:cut])
        mixed.extend(doc, tokens[cut:])
    assert bulk._runs[16] and not small._runs[1]  # both stores are exercised
    for trial in range(60):
        doc = rng.choice(list(docs))
        tokens = docs[doc]
        tail = tokens[:rng.randrange(1, len(tokens) + 1)] if trial % 2 else [rng.randrange(vocab) for _ in range(20)]
        for max_depth, limit in ((32, 10_000), (8, 5)):
            want = [(m.doc, m.end, m.length) for m in find_matches([small], tail, 1, max_depth, limit)]
            for index in (bulk, mixed):
                got = [(m.doc, m.end, m.length) for m in find_matches([index], tail, 1, max_depth, limit)]
                assert got == want, (trial, max_depth)
    for index in (bulk, small):
        index.remove(5)
    tail = docs[5][:50]
    assert ([(m.doc, m.end) for m in find_matches([bulk], tail, 1, 32, 100)] ==
            [(m.doc, m.end) for m in find_matches([small], tail, 1, 32, 100)])


def test_a_long_prompt_is_indexed_in_sorted_arrays_not_one_dict_entry_per_anchor():
    rng = random.Random(1)
    tokens = [rng.randrange(1000) for _ in range(30_000)]
    index = SuffixIndex()
    index.extend(0, tokens)
    assert sum(len(e) for e in index._entries.values()) == 0
    assert index.num_entries == sum(len(tokens) - a + 1 for a in ANCHOR_LENGTHS)
    index.extend(0, tokens[:3])  # a round's tokens: the dict
    found = find_matches([index], index.docs[0], 1, 32, 32)
    assert [(m.end, m.length) for m in found][:1] == [(3, 3)]


def test_many_bulk_documents_keep_few_sorted_runs_and_the_same_lookups():
    """Each cached output is a bulk append; runs merge as they come (each at least twice the next
    newer one's size), so a lookup searches a few of them, not one per output, and finds what the
    token-by-token index finds, in its order, also after removals rebuild the index."""
    rng = random.Random(2)
    bulk, small = SuffixIndex(), SuffixIndex()
    docs = {d: [rng.randrange(50) for _ in range(rng.randrange(64, 200))] for d in range(1, 301)}
    for doc, tokens in docs.items():
        bulk.extend(doc, tokens)
        for i in range(0, len(tokens), 7):
            small.extend(doc, tokens[i:i + 7])
    assert all(len(runs) <= 12 for runs in bulk._runs.values()), {a: len(r) for a, r in bulk._runs.items()}
    rebuilds, rebuild = [], bulk._rebuild
    bulk._rebuild = lambda: (rebuilds.append(bulk._num_dead), rebuild())
    for doc in range(1, 301):  # two in three removed: the dead outnumber the live, a rebuild follows
        if doc % 3:
            bulk.remove(doc)
            small.remove(doc)
    assert rebuilds and bulk._num_dead < rebuilds[-1]
    assert all(len(runs) <= 12 for runs in bulk._runs.values())
    for trial in range(40):
        tokens = docs[rng.randrange(3, 301, 3)]
        tail = tokens[:rng.randrange(1, len(tokens) + 1)]
        want = [(m.doc, m.end, m.length) for m in find_matches([small], tail, 1, 32, 64)]
        assert [(m.doc, m.end, m.length) for m in find_matches([bulk], tail, 1, 32, 64)] == want, trial
