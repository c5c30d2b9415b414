"""logit_bias is honoured with speculation on, and speculation stays lossless: the biased
distribution is the target's, in verification as in plain decoding."""
from __future__ import annotations

import pytest

from tests.spec.conftest import ReplayProposer, greedy, spec_engine
from verispec.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def qwen3(targets):
    return targets["qwen3"]


def test_greedy_logit_bias_with_speculation_equals_plain(qwen3, prompt_ids):
    engine, prompt = qwen3, prompt_ids[0]
    unbiased = engine.generate_all(prompt, greedy(24)).token_ids
    ban = {unbiased[0]: -100.0, unbiased[3]: -100.0}
    biased = engine.generate_all(prompt, greedy(24, logit_bias=ban)).token_ids
    assert biased[0] != unbiased[0] and not set(ban) & set(biased)  # honoured without speculation
    # a drafter that proposes the unbiased output (now wrong), and one that proposes the biased output
    for continuation in (unbiased, biased):
        spec = spec_engine(engine, ReplayProposer(continuation, engine.model.vocab_size), 3)
        result = spec.generate_all(prompt, greedy(24, logit_bias=ban))
        assert result.token_ids == biased
        assert result.stats.drafted > 0


def test_sampled_logit_bias_with_speculation_keeps_to_the_favoured_tokens(qwen3, prompt_ids):
    """+100 on two tokens leaves the rest e^-100 as likely: a verification that sampled from the
    unbiased target would accept the replayed drafts, which are other tokens."""
    engine, prompt = qwen3, prompt_ids[0]
    unbiased = engine.generate_all(prompt, greedy(24)).token_ids
    favoured = sorted({5, 9} - set(unbiased[:1]))[:2] or [5, 9]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True,
                            logit_bias={t: 100.0 for t in favoured})
    spec = spec_engine(engine, ReplayProposer(unbiased, engine.model.vocab_size), 3)
    for runner in (engine, spec):
        tokens = runner.generate_all(prompt, params).token_ids
        assert len(tokens) == 24 and set(tokens) <= set(favoured)


@pytest.mark.parametrize("bias, message", [({5: float("nan")}, "between"), ({5: 100.5}, "between"),
                                           ({5: "1"}, "between"), ({-1: 1.0}, "token ids"),
                                           ({True: 1.0}, "token ids")])
def test_bad_logit_bias_is_refused(bias, message):
    with pytest.raises(Exception, match=message) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"


def test_logit_bias_past_the_vocabulary_is_refused_by_the_engine(qwen3, prompt_ids):
    with pytest.raises(Exception, match="logit_bias") as info:
        qwen3.submit(prompt_ids[0], greedy(4, logit_bias={10**6: 1.0}), lambda item: None)
    assert info.value.param == "logit_bias"
