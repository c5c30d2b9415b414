"""Speculative sampling keeps the target distribution exactly (chi-square tests, fixed seeds)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.doubles import PerSequence

from tests.spec.conftest import eagle3_proposer, spec_engine
from tests.spec.second_token import CHI2_CRIT_3DF_P001, samples_after, second_token_counts, second_token_target
from verispec.sampling.params import SamplingParams
from verispec.spec.verify import verify_sampling

P = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10], dtype=torch.float64)
Q = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.10, 0.20], dtype=torch.float64)
CHI2_CRIT_5DF_P001 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi_square(counts: Counter, probs: torch.Tensor, n: int) -> float:
    expected = probs * n
    observed = torch.tensor([counts.get(i, 0) for i in range(len(probs))], dtype=torch.float64)
    mask = expected > 0
    return float(((observed[mask] - expected[mask]) ** 2 / expected[mask]).sum())


def first_token_counts(verify, n: int, draft_probs: torch.Tensor | None, seed: int) -> Counter:
    gen = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    for _ in range(n):
        if draft_probs is None:
            draft = [int(torch.argmax(Q))]  # a deterministic (one-hot) draft
        else:
            draft = [int(torch.multinomial(draft_probs, 1, generator=gen))]
        accepted, token = verify(draft, None if draft_probs is None else draft_probs[None],
                                 lambda i: P, gen)
        counts[draft[0] if accepted else token] += 1
    return counts


@pytest.mark.parametrize("draft_probs", [Q, None], ids=["sampled-draft", "one-hot-draft"])
def test_rejection_sampling_keeps_target_distribution(draft_probs):
    n = 20_000
    counts = first_token_counts(verify_sampling, n, draft_probs, seed=7)
    assert chi_square(counts, P, n) < CHI2_CRIT_5DF_P001


def wrong_ratio_verify(draft_ids, draft_probs, target_probs, generator):
    """A plausible bug: accepting with min(1, q/p) instead of min(1, p/q)."""
    p = target_probs(0)
    d = draft_ids[0]
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if u < min(1.0, float(draft_probs[0, d]) / float(p[d])):
        return 1, d
    residual = torch.clamp(p - draft_probs[0], min=0)
    return 0, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def test_chi_square_detects_a_wrong_acceptance_ratio():
    n = 20_000
    counts = first_token_counts(wrong_ratio_verify, n, Q, seed=7)
    assert chi_square(counts, P, n) > CHI2_CRIT_5DF_P001 * 10


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_multi_draft_joint_distribution():
    """Two drafts: the pair of emitted tokens follows p(x1) p(x2 | x1) exactly."""
    p2 = {a: torch.roll(P, a) for a in range(6)}  # a different second-step target for each first token
    n = 30_000
    gen = torch.Generator().manual_seed(11)
    counts: Counter = Counter()
    for _ in range(n):
        d1 = int(torch.multinomial(Q, 1, generator=gen))
        d2 = int(torch.multinomial(Q, 1, generator=gen))
        probs = torch.stack([Q, Q])
        accepted, token = verify_sampling([d1, d2], probs, lambda i: P if i == 0 else p2[d1], gen)
        if accepted == 0:
            first = token
            second = int(torch.multinomial(p2[first], 1, generator=gen))  # the next round's token
        else:
            first, second = d1, (d2 if accepted == 2 else token)
        counts[first * 6 + second] += 1
    joint = torch.stack([P[a] * p2[a] for a in range(6)]).flatten()
    expected = joint * n
    observed = torch.tensor([counts.get(i, 0) for i in range(36)], dtype=torch.float64)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 70.0  # 35 degrees of freedom: critical value at p = 0.001 is 66.6; margin for seeds


@pytest.mark.slow  # 30-70 s on the 2-core CI machine: `make test-slow` runs it
def test_engine_speculative_sampling_with_eagle3_drafter(targets, eagle3_dirs, prompt_ids):
    """End to end through the engine with a real EAGLE3 drafter: the second generated token (the
    first one that goes through verification), given the first, follows the target's processed
    distribution. top_k keeps the support small enough for a chi-square test."""
    engine = targets["qwen2"]
    ids = prompt_ids[0]
    params = dict(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)  # token 2 is verified
    first = engine.generate_all(ids, SamplingParams(temperature=0.0, max_tokens=1)).token_ids[0]
    with torch.no_grad():
        seq = torch.tensor([ids + [first]])
        cache = engine.model.make_cache(seq.shape[1])
        hidden = engine.model(seq, torch.arange(seq.shape[1])[None], cache).hidden
        logits = engine.model.logits(hidden[0, -1]).double()
    top = torch.topk(logits, 4)
    target = torch.softmax(top.values, -1)
    spec = spec_engine(engine, eagle3_proposer(engine, eagle3_dirs[("qwen2", "full")]), 1)
    counts: Counter = Counter()
    n = 0
    for seed in range(2500):
        # condition on the first token: prefill samples it; keep only runs where it equals `first`
        result = spec.generate_all(ids, SamplingParams(seed=seed, **params))
        if result.token_ids[0] != first:
            continue
        n += 1
        second = result.token_ids[1]
        assert second in top.indices.tolist()
        counts[top.indices.tolist().index(second)] += 1
        if n >= 600:
            break
    assert n >= 300
    assert spec.generate_all(ids, SamplingParams(seed=0, **params)).stats.drafted == 1
    chi2 = chi_square(counts, target, n)
    assert chi2 < 16.27  # 3 degrees of freedom, p = 0.001


class FixedDistributionProposer(PerSequence):
    """Drafts one token from a fixed q over the target's own top-k support (a distorted p), so
    acceptance and residual sampling both matter: a wrong ratio or a q ignored shows up."""

    method = "fixed-q"
    capture_layers = ()

    def __init__(self, q_full: torch.Tensor):
        super().__init__()
        self.q_full = q_full

    def draft(self, num_drafts, params, generator):
        from verispec.spec.proposer import Draft
        token = int(torch.multinomial(self.q_full, 1, generator=generator))
        return Draft([token], self.q_full[None].float())


@pytest.mark.slow  # 30-70 s on the 2-core CI machine: `make test-slow` runs it
def test_engine_rejection_sampling_with_overlapping_draft_distribution(targets, prompt_ids):
    engine = targets["qwen2"]
    ids = prompt_ids[0]
    first, top, target = second_token_target(engine, ids)
    q_full = torch.zeros(engine.model.vocab_size, dtype=torch.float64)
    q_full[top] = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)  # ranks reversed-ish
    results = samples_after(spec_engine(engine, FixedDistributionProposer(q_full), 1), ids, first)
    assert 0 < sum(r.stats.accepted for r in results) < len(results)
    assert chi_square(second_token_counts(results, top), target, len(results)) < CHI2_CRIT_3DF_P001
