"""Sampler: filters and penalties against hand computation, sampling frequencies against softmax
(chi-square), seeded determinism through the engine, and penalties/logprobs against transformers."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams
from verispec.sampling.sampler import (TokenHistory, apply_penalties, filter_logits, processed_probs, sample,
                                     token_logprobs)
from verispec.errors import InvalidRequestError

CPU = torch.device("cpu")
# chi-square critical values at significance 0.001, by degrees of freedom (scipy.stats.chi2.ppf)
CHI2_CRIT_0_001 = {2: 13.816, 3: 16.266, 5: 20.515}


def kept(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Token ids the sampler can still choose."""
    return set(torch.nonzero(processed_probs(logits, params) > 0).flatten().tolist())


# ---- filters --------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_the_k_largest(k):
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(20, generator=gen)
    expected = set(sorted(range(20), key=lambda i: -float(logits[i]))[:k])
    assert kept(logits, SamplingParams(top_k=k)) == expected


@pytest.mark.parametrize("k", [0, -1, 20, 50])
def test_top_k_disabled_or_at_least_vocab_keeps_all(k):
    logits = torch.randn(20, generator=torch.Generator().manual_seed(0))
    assert kept(logits, SamplingParams(top_k=k)) == set(range(20))


@pytest.mark.parametrize("top_p, num_kept", [(0.8, 2), (0.81, 3), (0.5, 1), (0.49, 1), (0.51, 2),
                                              (0.95, 3), (0.96, 4), (1.0, 4)])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, num_kept):
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # unsorted on purpose
    by_prob = [1, 3, 0, 2]
    assert kept(probs.log(), SamplingParams(top_p=top_p)) == set(by_prob[:num_kept])


def test_top_p_random_distributions_against_reference():
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(200):
        logits = torch.randn(30, generator=gen) * 2
        top_p = float(torch.rand((), generator=gen)) * 0.98 + 0.01
        probs = torch.softmax(logits.double(), -1)
        order = torch.argsort(probs, descending=True).tolist()
        cum = torch.cumsum(probs[order], 0)
        if (cum - top_p).abs().min() < 1e-5:
            continue  # too close to a boundary for float32 to decide
        n = int((cum < top_p).sum()) + 1
        assert kept(logits, SamplingParams(top_p=top_p)) == set(order[:n])
        checked += 1
    assert checked > 150


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_min_p_keeps_tokens_above_fraction_of_max(temperature):
    gen = torch.Generator().manual_seed(3)
    for min_p in (0.05, 0.2, 0.6):
        logits = torch.randn(40, generator=gen) * 2
        # min-p applies to the temperature-scaled distribution
        probs = torch.softmax(logits.double() / temperature, -1)
        threshold = min_p * probs.max()
        assert (probs - threshold).abs().min() > 1e-6
        expected = set(torch.nonzero(probs >= threshold).flatten().tolist())
        assert kept(logits, SamplingParams(min_p=min_p, temperature=temperature)) == expected


@pytest.mark.parametrize("min_p, num_kept", [(0.25, 4), (0.26, 2), (0.5, 2), (0.51, 1), (1.0, 1)])
def test_min_p_boundary_is_inclusive(min_p, num_kept):
    # probabilities [0.5, 0.25, 0.125, 0.125] are exact in float32, so p == min_p * p_max is exact
    logits = torch.tensor([3.0, 2.0, 1.0, 1.0]) * math.log(2.0)
    assert kept(logits, SamplingParams(min_p=min_p)) == set(range(num_kept))


def test_filtered_distribution_is_renormalised_softmax():
    logits = torch.tensor([3.0, 2.5, 1.0, 0.2, -1.0, -3.0])
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    p = torch.softmax(logits.double() / 0.7, -1)[:4]
    p = p / p.sum()
    cum = torch.cumsum(p, 0)
    n = int((cum < 0.9).sum()) + 1
    expected = torch.zeros(6, dtype=torch.float64)
    expected[:n] = p[:n] / p[:n].sum()
    torch.testing.assert_close(processed_probs(logits, params).double(), expected, atol=1e-6, rtol=1e-5)


def test_top_p_applies_after_top_k():
    """Order (as vLLM): top-k, then top-p on the renormalised top-k distribution."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # after top_k=3: [0.444, 0.333, 0.222]; mass before the third is 0.777 >= 0.75 -> 2 kept.
    # (top-p on the original distribution would keep 3: mass before the third is 0.7.)
    assert kept(probs.log(), SamplingParams(top_k=3, top_p=0.75)) == {0, 1}


def test_filter_logits_scales_by_temperature():
    logits = torch.tensor([1.0, -2.0, 0.5])
    torch.testing.assert_close(filter_logits(logits, SamplingParams(temperature=0.25)), logits / 0.25)


# ---- penalties ------------------------------------------------------------------------------

def hand_penalties(logits: list[float], prompt: list[int], output: list[int], rep: float, presence: float,
                   frequency: float) -> list[float]:
    out = []
    for tok, x in enumerate(logits):
        if tok in prompt or tok in output:
            x = x / rep if x > 0 else x * rep
        count = output.count(tok)
        x -= frequency * count
        if count:
            x -= presence
        out.append(x)
    return out


@pytest.mark.parametrize("rep, presence, frequency", [
    (1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.25), (1.0, -0.5, 0.0),
    (1.3, 0.5, 0.25), (1.5, -1.0, 1.75),
])
def test_penalties_match_hand_computation(rep, presence, frequency):
    vocab = 12
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3
    prompt = [1, 2, 2, 5]  # 1 and 5 appear only in the prompt
    output = [2, 3, 3, 3, 7]  # 3 and 7 only in the output
    history = TokenHistory(vocab, prompt, CPU)
    for t in output:
        history.add([t])
    params = SamplingParams(repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency)
    got = apply_penalties(logits, params, history)
    expected = hand_penalties(logits.tolist(), prompt, output, rep, presence, frequency)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=1e-6)
    assert not torch.equal(got, logits)


def test_penalties_do_not_modify_input_logits():
    logits = torch.randn(8, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    history = TokenHistory(8, [1, 2], CPU)
    history.add([3])
    apply_penalties(logits, SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0), history)
    assert torch.equal(logits, before)


# ---- sampling frequencies -------------------------------------------------------------------

def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1], dtype=torch.long)
    for _ in range(n):
        counts[sample(logits, params, gen)] += 1
    return counts


LOGITS6 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])


def test_sampling_matches_softmax_frequencies():
    counts = draw(LOGITS6, SamplingParams(temperature=1.0), 8000, seed=0)
    target = torch.softmax(LOGITS6.double(), -1)
    assert chi_square(counts, target) < CHI2_CRIT_0_001[5]
    # the check has power: the same draws are far from the distribution at another temperature
    assert chi_square(counts, torch.softmax(LOGITS6.double() / 0.7, -1)) > 10 * CHI2_CRIT_0_001[5]


def test_sampling_with_temperature_and_top_k_matches_filtered_softmax():
    counts = draw(LOGITS6, SamplingParams(temperature=0.7, top_k=4), 8000, seed=1)
    assert counts[4:].sum() == 0
    target = torch.softmax(LOGITS6[:4].double() / 0.7, -1)
    assert chi_square(counts[:4], target) < CHI2_CRIT_0_001[3]


def test_greedy_is_argmax():
    assert sample(LOGITS6.flip(0), SamplingParams(temperature=0), None) == 5


# ---- through the engine ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(qwen3_dir):
    return load_engine(str(qwen3_dir), dtype="float32", device="cpu", prefill_step_size=16)


@pytest.fixture(scope="module")
def hf_model(qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def prompt(length: int, seed: int, vocab: int = 500) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_seeded_sampling_is_deterministic(engine):
    ids = prompt(20, 0)

    def run(seed):
        return engine.generate_all(ids, SamplingParams(max_tokens=32, temperature=1.0, seed=seed,
                                                       ignore_eos=True)).token_ids

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-6])
def test_tiny_temperature_samples_greedily(engine, temperature):
    """logits / 1e-45 overflows float32; such temperatures must act as greedy, not crash."""
    ids = prompt(15, 3)
    got = engine.generate_all(ids, SamplingParams(max_tokens=8, temperature=temperature, seed=0, ignore_eos=True))
    want = engine.generate_all(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert got.token_ids == want.token_ids
    assert not SamplingParams(temperature=1e-3).greedy


def test_engine_default_seed_makes_unseeded_requests_deterministic(qwen3_dir):
    eng = load_engine(str(qwen3_dir), dtype="float32", device="cpu", seed=11)
    ids = prompt(20, 1)
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    assert eng.generate_all(ids, params).token_ids == eng.generate_all(ids, params).token_ids


def test_greedy_repetition_penalty_matches_transformers(engine, hf_model):
    """transformers' RepetitionPenaltyLogitsProcessor uses the same convention (prompt + output)."""
    for seed in range(2):
        ids = prompt(30, 10 + seed)
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48, pad_token_id=0,
                                    repetition_penalty=1.5)[0, len(ids):].tolist()
        got = engine.generate_all(ids, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                                                      repetition_penalty=1.5)).token_ids
        assert got == ref
        plain = engine.generate_all(ids, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)).token_ids
        assert plain != got  # the penalty changed something, so the comparison means something


def test_greedy_presence_frequency_penalties_match_reference_loop(engine, hf_model):
    """Greedy decoding with penalties, written out by hand over transformers' logits."""
    ids = prompt(25, 20)
    rep, presence, frequency = 1.2, 0.7, 0.4
    seq, out = list(ids), []
    with torch.inference_mode():
        for _ in range(40):
            logits = hf_model(torch.tensor([seq])).logits[0, -1].tolist()
            penalised = hand_penalties(logits, ids, out, rep, presence, frequency)
            tok = max(range(len(penalised)), key=penalised.__getitem__)
            out.append(tok)
            seq.append(tok)
    got = engine.generate_all(ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                  repetition_penalty=rep, presence_penalty=presence,
                                                  frequency_penalty=frequency)).token_ids
    assert got == out


def test_logprobs_match_transformers(engine, hf_model):
    ids = prompt(20, 30)
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, pad_token_id=0,
                                output_logits=True, return_dict_in_generate=True)
    result = engine.generate_all(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                     logprobs=True, top_logprobs=3))
    assert result.token_ids == ref.sequences[0, len(ids):].tolist()
    assert len(result.logprobs) == 12
    for lp, step_logits in zip(result.logprobs, ref.logits):
        ref_lp = torch.log_softmax(step_logits[0].double(), -1)
        assert lp.logprob == pytest.approx(float(ref_lp[lp.token_id]), abs=1e-5)
        top_ids = torch.topk(ref_lp, 3).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
        for t, v in lp.top:
            assert v == pytest.approx(float(ref_lp[t]), abs=1e-5)


def test_token_logprobs_by_hand():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    lp = token_logprobs(logits, 2, top_n=2)
    z = math.log(sum(math.exp(x) for x in (1.0, 3.0, 2.0, 0.0)))
    assert lp.token_id == 2
    assert lp.logprob == pytest.approx(2.0 - z, abs=1e-6)
    assert [t for t, _ in lp.top] == [1, 2]
    assert lp.top[0][1] == pytest.approx(3.0 - z, abs=1e-6)


# ---- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("param, value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5),
    ("temperature", -0.1), ("temperature", 2.5),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.5),
    ("frequency_penalty", 3.0), ("frequency_penalty", -3.0),
    ("top_logprobs", -1), ("top_logprobs", 21),
])
def test_invalid_sampling_params_name_the_param(param, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{param: value})
    assert info.value.param == param
    assert param in str(info.value)
    assert repr(value) in str(info.value)


def test_sampling_params_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=["", "y"]).stop == ["y"]
    assert SamplingParams(top_logprobs=2).logprobs is True
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.1).greedy
