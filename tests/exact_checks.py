"""What the exact-numerics tests (CPU and GPU) share: the request they repeat, how its output is
recorded bit for bit, and where two records part."""
from __future__ import annotations

from tools.tiny import corpus_text
from verispec.sampling.params import SamplingParams


def greedy_with_logprobs(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)


def corpus_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Prompts of the given token counts, each from its own stretch of the corpus."""
    ids = tokenizer.encode(corpus_text(20_000))
    return [ids[i * 300:i * 300 + n] for i, n in enumerate(lengths)]


def record(result) -> tuple:
    """Tokens and logprobs (with the top 2), compared bit for bit."""
    return result.token_ids, [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in result.logprobs]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check(got: list, want: list, what: str) -> None:
    bad = [(i, first_divergence(g[0], w[0])) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{what}: (prompt, first differing token) {bad}"
