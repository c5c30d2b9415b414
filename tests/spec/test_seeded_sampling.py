"""Seeded sampling is fixed per (request, position): a seeded request's text is the same alone, in a
batch and with any proposer (always-right and always-wrong replays, suffix decoding, an EAGLE3
drafter that samples its drafts), and the samples still follow the target's distribution
(chi-square over seeds). float64 on the CPU."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.doubles import KeyedReplay
from tests.spec.conftest import eagle3_proposer, spec_engine
from tests.spec.test_sampling import CHI2_CRIT_5DF_P001, P, chi_square
from verispec.sampling.params import SamplingParams
from verispec.sampling.seeded import inverse_cdf_sample, position_uniform, seeded_sample
from verispec.spec.suffix import SuffixOptions, SuffixProposer

NEW_TOKENS = 32
TARGET = "qwen3"


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(**dict(dict(max_tokens=NEW_TOKENS, temperature=1.0, top_k=40, seed=seed,
                                      ignore_eos=True), **kw))


# a mix of processing steps that come before the sample
REQUESTS = [seeded(3), seeded(11, temperature=0.7, top_p=0.9, repetition_penalty=1.2),
            seeded(5, min_p=0.05, frequency_penalty=0.3, logit_bias={7: 2.0}, logprobs=True)]


def test_position_uniform_is_a_fixed_uniform_per_seed_and_position():
    draws = [position_uniform(s, t) for s in range(50) for t in range(50)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert position_uniform(7, 12) == position_uniform(7, 12)
    assert position_uniform(-(2**63), 0) != position_uniform(2**64 - 1, 0)


def test_inverse_cdf_sample_follows_the_intervals_and_skips_zero_mass():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0], dtype=torch.float64)
    assert inverse_cdf_sample(probs, 0.0) == 1
    assert inverse_cdf_sample(probs, 0.2499) == 1
    assert inverse_cdf_sample(probs, 0.25) == 3
    assert inverse_cdf_sample(probs, 1.0 - 2**-53) == 3
    assert inverse_cdf_sample(probs * 3.0, 0.3) == 3  # unnormalised: intervals scale with the total


@pytest.mark.parametrize("over", ["seeds", "positions"])
def test_seeded_samples_follow_the_distribution(over):
    n = 20_000
    draws = ((s, 17) for s in range(n)) if over == "seeds" else ((42, t) for t in range(n))
    counts = Counter(seeded_sample(P, seed, position) for seed, position in draws)
    assert chi_square(counts, P, n) < CHI2_CRIT_5DF_P001


def test_a_biased_sampler_fails_the_same_check():
    """The check has teeth: the distribution of the first 0.9 of [0, 1) is not P."""
    n = 20_000
    counts = Counter(inverse_cdf_sample(P, 0.9 * position_uniform(s, 17)) for s in range(n))
    assert chi_square(counts, P, n) > CHI2_CRIT_5DF_P001 * 10


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_engine_seeded_first_token_follows_the_target(targets, prompt_ids):
    engine = targets[TARGET]
    ids = prompt_ids[0]
    with torch.no_grad():
        seq = torch.tensor([ids])
        hidden = engine.model(seq, torch.arange(seq.shape[1])[None], engine.model.make_cache(seq.shape[1])).hidden
        logits = engine.model.logits(hidden[0, -1]).double()
    top = torch.topk(logits, 4)
    target = torch.softmax(top.values, -1)
    n = 600
    counts: Counter = Counter()
    for seed in range(n):
        token = engine.generate_all(ids, SamplingParams(seed=seed, temperature=1.0, top_k=4, max_tokens=1)).token_ids[0]
        counts[top.indices.tolist().index(token)] += 1
    assert chi_square(counts, target, n) < 16.27  # 3 degrees of freedom, p = 0.001


@pytest.fixture(scope="module")
def alone(targets, prompt_ids) -> list:
    """Each (prompt, request) generated alone without speculation."""
    engine = targets[TARGET]
    return [engine.generate_all(ids, p) for ids in prompt_ids for p in REQUESTS]


def pairs(prompt_ids):
    return [(ids, p) for ids in prompt_ids for p in REQUESTS]


def check(results, alone, what: str) -> None:
    bad = [i for i, (r, a) in enumerate(zip(results, alone)) if r.token_ids != a.token_ids]
    assert not bad, f"{what}: requests {bad} changed"
    for r, a in zip(results, alone):
        if a.logprobs:
            assert [x.logprob for x in r.logprobs] == [x.logprob for x in a.logprobs], what


def test_seeded_text_is_the_same_in_a_batch(targets, prompt_ids, alone):
    engine = targets[TARGET]
    prompts, params = zip(*pairs(prompt_ids))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    results = engine.generate_batch(list(prompts) + [prompt_ids[1]], list(params) + [greedy])
    check(results[:-1], alone, "batched")


def test_two_seeds_give_different_text(targets, prompt_ids):
    engine = targets[TARGET]
    texts = {tuple(engine.generate_all(prompt_ids[0], seeded(seed)).token_ids) for seed in (1, 2, 3)}
    assert len(texts) == 3


@pytest.mark.parametrize("proposer", ["right", "wrong", "suffix", "suffix-warm", "eagle3"])
def test_seeded_text_is_the_same_speculating(targets, prompt_ids, eagle3_dirs, alone, proposer):
    engine = targets[TARGET]
    work = pairs(prompt_ids)
    if proposer in ("right", "wrong"):  # replays are keyed by prompt: one engine per request kind
        results = [None] * len(work)
        for j, p in enumerate(REQUESTS):
            rows = [i for i, (_, q) in enumerate(work) if q is p]
            known = {tuple(work[i][0]): alone[i].token_ids for i in rows}
            replay = KeyedReplay(known, engine.model.vocab_size, wrong_at=lambda i: proposer == "wrong")
            spec = spec_engine(engine, replay, 3)
            for i, r in zip(rows, spec.generate_batch([work[i][0] for i in rows], p)):
                results[i] = r
        check(results, alone, f"replay {proposer}")
        accepted = sum(r.stats.accepted for r in results)
        assert (accepted > 0) == (proposer == "right")
        return
    if proposer == "eagle3":
        spec = spec_engine(engine, eagle3_proposer(engine, eagle3_dirs[(TARGET, "full")]), 3)
    else:
        suffix = SuffixProposer(SuffixOptions(cache_tokens=1 << 14))
        if proposer == "suffix-warm":  # the cache holds the exact outputs: long right drafts
            for (ids, _), a in zip(work, alone):
                suffix.remember(ids + a.token_ids)
        spec = spec_engine(engine, suffix, 4)
    check([spec.generate_all(ids, p) for ids, p in work], alone, f"{proposer}, alone")
    results = spec.generate_batch([ids for ids, _ in work], [p for _, p in work])
    check(results, alone, f"{proposer}, batched")
    assert sum(r.stats.drafted for r in results) > 0
    if proposer == "suffix-warm":
        assert sum(r.stats.accepted for r in results) > 0
