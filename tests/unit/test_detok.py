"""Incremental detokenization, stop strings, and the output builder that decides when to finish."""
from __future__ import annotations

import random

import pytest
import torch

from verispec.engine.detok import IncrementalDetokenizer, StopMatcher
from verispec.engine.output import OutputBuilder
from verispec.sampling.params import SamplingParams
from verispec.sampling.sampler import TokenHistory
from verispec.engine.types import FinishReason
from verispec.loading.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
MULTIBYTE_TEXT = "héllo 世界 🙂 naïve Ω≈ç √ 日本語のテキスト 👍🏽 ok"
CHAR_POOL = list("abc xyz.,!?\n") + ["é", "ü", "Ω", "世", "界", "日", "本", "🙂", "👍🏽", "𝔘", "∑"]


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


def stream(tok: Tokenizer, ids: list[int], chunk_sizes=None) -> list[str]:
    """Feed ids in chunks (default one by one); return every delta, the final flush included."""
    detok = IncrementalDetokenizer(tok)
    deltas, i, sizes = [], 0, iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


# ---- IncrementalDetokenizer -----------------------------------------------------------------

def test_multibyte_text_one_token_at_a_time(tok):
    ids = tok.encode(MULTIBYTE_TEXT)
    # the fixture is meaningful only if some characters are split over several tokens
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    deltas = stream(tok, ids)
    assert "".join(deltas) == MULTIBYTE_TEXT == tok.decode(ids)
    assert not any(REPLACEMENT in d for d in deltas)


def test_random_valid_text_random_chunking(tok):
    rng = random.Random(0)
    for _ in range(100):
        text = "".join(rng.choice(CHAR_POOL) for _ in range(rng.randrange(1, 30)))
        ids = tok.encode(text)
        deltas = stream(tok, ids, [rng.randrange(1, 4) for _ in ids])
        assert "".join(deltas) == text
        assert not any(REPLACEMENT in d for d in deltas), (text, deltas)


def test_random_token_ids_concatenate_to_full_decode(tok):
    """Arbitrary ids (invalid UTF-8 included, special tokens included): the deltas still add up."""
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert "".join(stream(tok, ids, [rng.randrange(1, 3) for _ in ids])) == tok.decode(ids)


def test_incomplete_character_waits_then_flush_releases_it(tok):
    ids = tok.encode("a🙂")
    head = ids[:-1]  # "a" plus an incomplete 4-byte sequence
    detok = IncrementalDetokenizer(tok)
    released = "".join(detok.add([i]) for i in head)
    assert released == "a"
    tail = detok.flush()
    assert released + tail == tok.decode(head)
    assert tail.startswith(REPLACEMENT)


def test_special_tokens_produce_no_text(tok):
    eos = tok.eos_token_ids[0]
    ids = tok.encode("hi") + [eos] + tok.encode(" there")
    assert "".join(stream(tok, ids)) == "hi there"


# ---- StopMatcher ----------------------------------------------------------------------------

def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Final output for a whole text: cut before the earliest occurrence of any stop string."""
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[:min(hits)], True) if hits else (text, False)


def longest_partial(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop."""
    best = 0
    for s in stops:
        for k in range(1, len(s)):
            if text.endswith(s[:k]):
                best = max(best, k)
    return best


def run_matcher(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out, stopped = [], False
    for c in chunks:
        released, stopped = m.feed(c)
        out.append(released)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return out, stopped


def test_stop_string_split_across_chunks():
    out, stopped = run_matcher(["STOP"], ["hello wor", "ld ST", "O", "P more"])
    assert stopped
    assert out == ["hello wor", "ld ", "", ""]
    assert "".join(out) == "hello world "


def test_partial_stop_is_held_then_released_when_it_diverges():
    m = StopMatcher(["STOP"])
    assert m.feed("abcST") == ("abc", False)
    assert m.feed("O") == ("", False)
    assert m.feed("x") == ("STOx", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"


def test_earliest_of_several_stops_wins():
    assert "".join(run_matcher(["world", "lo"], ["hel", "lo world"])[0]) == "hel"
    assert "".join(run_matcher(["abcd", "c"], ["ab", "c"])[0]) == "ab"
    assert "".join(run_matcher(["abc", "ab"], ["xa", "bc"])[0]) == "x"


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)


class CountingStop(str):
    """A stop string that counts the characters a matcher reads of it (one per index, a slice's length)."""

    reads = 0

    def __getitem__(self, index):
        part = str.__getitem__(self, index)
        CountingStop.reads += len(part)
        return part


def test_stop_matching_is_linear_in_the_new_text():
    """31 long stops that the text follows for thousands of characters (a stop equal to the
    output plus one more character): each token's work stays a few character reads per stop,
    however much is held back (the old matcher re-searched all held text on every token)."""
    num_chars, num_stops = 1000, 31
    output = "".join("ab🙂"[i % 3] for i in range(num_chars))
    stops = [CountingStop(output + "\u0000" + str(i)) for i in range(num_stops)]
    m = StopMatcher(stops)
    CountingStop.reads = 0
    assert all(m.feed(c) == ("", False) for c in output)
    # KMP: at most two characters of a stop read per character fed, two per failure-table entry
    assert 0 < CountingStop.reads <= 4 * num_chars * num_stops
    assert m.num_held == num_chars
    assert m.feed("x") == (output + "x", False)
    assert m.num_held == 0


def test_held_back_text_is_bounded_by_the_longest_stop():
    rng = random.Random(4)
    stops = ["ab" * 20, "aab" * 5, "🙂a🙂"]
    m = StopMatcher(stops)
    for _ in range(5000):
        released, stopped = m.feed("".join(rng.choice("ab🙂") for _ in range(rng.randrange(1, 4))))
        if stopped:
            m = StopMatcher(stops)
        assert m.num_held <= m.max_len - 1


def test_overlapping_and_unicode_stops_spanning_tokens():
    # the stop's own prefix repeats inside it: a failed partial match must not skip a real one
    assert run_matcher(["aab"], ["a", "a", "a", "b", "c"]) == (["", "", "a", ""], True)
    assert run_matcher(["abab"], ["ab", "a", "bab"]) == (["", "", ""], True)
    assert run_matcher(["🙂👍🏽"], ["x🙂", "👍", "🏽y"]) == (["x", "", ""], True)
    assert run_matcher(["日本語"], ["日本", "の日", "本語です"]) == (["", "日本の", ""], True)
    # one stop inside another: the earliest start wins when both end in one feed
    assert "".join(run_matcher(["xyz", "y"], ["x", "yz"])[0]) == ""
    assert "".join(run_matcher(["xyz", "yq"], ["xy", "q"])[0]) == "x"


@pytest.mark.parametrize("seed,alphabet,max_text,max_stop,max_cuts", [
    (2, "abc ", 40, 5, 8),
    # stops whose own prefixes repeat (the case a resumable search gets wrong first), unicode characters
    (5, "aa\U0001f642\u00e9", 60, 7, 10),
])
def test_stop_matcher_random_against_reference(seed, alphabet, max_text, max_stop, max_cuts):
    """Random text, stops and chunking: the released text always equals the whole-text reference,
    and everything is released except a tail that could still start a stop string."""
    rng = random.Random(seed)
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, max_text)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, max_stop)))
                 for _ in range(rng.randrange(1, 4))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, max_cuts))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        m = StopMatcher(stops)
        released, fed, stopped = "", "", False
        for c in chunks:
            fed += c
            out, stopped = m.feed(c)
            released += out
            if stopped:
                break
            assert released == fed[:len(fed) - longest_partial(fed, stops)], (stops, chunks)
        if stopped:
            # cut before the earliest stop in the text fed so far
            assert (released, stopped) == reference_stop(fed, stops), (text, stops, chunks)
        else:
            assert released + m.flush() == text


# ---- OutputBuilder --------------------------------------------------------------------------

def builder(tok: Tokenizer, max_new: int = 100, **params) -> OutputBuilder:
    history = TokenHistory(tok.vocab_size, [], torch.device("cpu"))
    return OutputBuilder(tok, SamplingParams(**params), max_new, history, tok.eos_token_ids)


def test_eos_inside_a_multi_token_push(tok):
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    eos = tok.eos_token_ids[0]
    out = builder(tok)
    chunk = out.push([a, eos, b])
    assert chunk.token_ids == [a, eos]
    assert out.token_ids == [a, eos]
    assert chunk.finish_reason is FinishReason.STOP
    assert chunk.text == "a" and out.text == "a"
    assert out.history.output_counts[b] == 0 and out.history.output_counts[eos] == 1


def test_ignore_eos_keeps_going(tok):
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    eos = tok.eos_token_ids[0]
    out = builder(tok, ignore_eos=True)
    chunk = out.push([a, eos, b])
    assert chunk.token_ids == [a, eos, b]
    assert chunk.finish_reason is None


def test_stop_token_id_finishes(tok):
    ids = tok.encode("one two three")
    stop_id = ids[2]
    out = builder(tok, stop_token_ids=[stop_id])
    chunk = out.push(ids)
    assert chunk.token_ids == ids[:3]
    assert chunk.finish_reason is FinishReason.STOP
    assert out.text == tok.decode(ids[:2])


def test_stop_string_cuts_text_and_drops_later_tokens(tok):
    ids = tok.encode("hello world, and more text")
    out = builder(tok, stop=["wor"])
    chunks = [out.push([i]) for i in ids[:3]]  # a few one by one, then the rest at once
    chunks.append(out.push(ids[3:]))
    assert out.finish_reason is FinishReason.STOP
    assert out.text == "hello "
    assert "".join(c.text for c in chunks) == "hello "
    # tokens end with the one that completed the stop string
    n = len(out.token_ids)
    assert "wor" in tok.decode(ids[:n]) and "wor" not in tok.decode(ids[:n - 1])


def test_max_tokens_inside_a_push_flushes_held_text(tok):
    ids = tok.encode("abc xy and so on")
    n = len(tok.encode("abc xy"))
    assert tok.encode("abc xy") == ids[:n]
    out = builder(tok, max_new=n, stop=["xyz"])
    chunk = out.push(ids)
    assert chunk.token_ids == ids[:n]
    assert chunk.finish_reason is FinishReason.LENGTH
    assert out.text == "abc xy"  # "xy" was held (could start "xyz") and is released at the end


def test_max_tokens_flushes_incomplete_character(tok):
    ids = tok.encode("a🙂")
    out = builder(tok, max_new=len(ids) - 1)
    for i in ids[:-1]:
        out.push([i])
    assert out.finish_reason is FinishReason.LENGTH
    assert out.text == tok.decode(ids[:-1])


def test_multibyte_stream_through_builder(tok):
    ids = tok.encode(MULTIBYTE_TEXT)
    out = builder(tok, max_new=len(ids), stop=["never appears"])
    texts = [out.push([i]).text for i in ids]
    assert out.finish_reason is FinishReason.LENGTH
    assert "".join(texts) == out.text == MULTIBYTE_TEXT
    assert not any(REPLACEMENT in t for t in texts)


def test_logprobs_only_for_emitted_tokens(tok):
    ids = tok.encode("abc")
    eos = tok.eos_token_ids[0]
    pushed = [ids[0], eos, ids[1]]
    raw = torch.randn(3, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    out = builder(tok, logprobs=True, top_logprobs=2)
    chunk = out.push(pushed, raw)
    assert [lp.token_id for lp in chunk.logprobs] == [ids[0]]  # the end token has none
    for row, lp in zip(raw, chunk.logprobs):
        assert lp.logprob == pytest.approx(float(torch.log_softmax(row, -1)[lp.token_id]), abs=1e-6)
        assert len(lp.top) == 2


def test_cancel_flushes_and_marks_cancelled(tok):
    ids = tok.encode("abc S")
    out = builder(tok, stop=["STOP"])
    out.push(ids)
    assert out.text == "abc "  # " S" ... "S" held back as a possible start of "STOP"
    chunk = out.cancel()
    assert chunk.finish_reason is FinishReason.CANCELLED
    assert out.text == "abc S"


@pytest.mark.parametrize("stop", [[], ["\u2603never"]])
def test_rounds_of_tokens_add_up_to_the_decode_of_what_was_emitted(tok, stop):
    """Rounds of 1-4 tokens (a speculative round's accepted drafts + bonus) pushed whole: without
    stop strings a round is detokenized at once, with them token by token; either way the chunks'
    text is the decode of the emitted tokens, max_tokens cuts mid-round, penalties count them all."""
    rng = random.Random(3)
    for _ in range(60):
        text = "".join(rng.choice(CHAR_POOL) for _ in range(rng.randrange(5, 40)))
        ids = tok.encode(text)
        max_new = rng.randrange(1, len(ids) + 2)
        out = builder(tok, max_new=max_new, stop=stop)
        texts, i = [], 0
        while not out.done and i < len(ids):
            n = rng.randrange(1, 5)
            texts.append(out.push(ids[i:i + n]).text)
            i += n
        emitted = ids[:max_new]
        assert out.token_ids == emitted
        assert "".join(texts) == out.text == tok.decode(emitted)
        assert sum(int(out.history.output_counts[t]) for t in set(emitted)) == len(emitted)
