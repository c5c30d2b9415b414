"""Lossless means identical: speculative greedy output == plain greedy output, token for token."""
from __future__ import annotations

import pytest

from tests.doubles import DeviceKeyedReplay
from tools.tiny import corpus_text

from tests.spec.conftest import (ReplayProposer, assert_greedy_identity, eagle3_proposer, greedy, spec_engine,
                                 train_drafter)

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def plain(targets, prompt_ids):
    return {(name, i): eng.generate_all(ids, greedy(NEW_TOKENS)).token_ids
            for name, eng in targets.items() for i, ids in enumerate(prompt_ids)}


@pytest.mark.parametrize("target", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("variant", ["full", "offset"])
def test_eagle3_random_drafter_identity(targets, eagle3_dirs, prompt_ids, plain, target, variant):
    engine = targets[target]
    proposer = eagle3_proposer(engine, eagle3_dirs[(target, variant)])
    for k in range(1, 6):
        spec = spec_engine(engine, proposer, k)
        for i, ids in enumerate(prompt_ids):
            result = spec.generate_all(ids, greedy(NEW_TOKENS))
            assert result.token_ids == plain[(target, i)], f"k={k} prompt {i}"
            assert result.stats.method == "eagle3"
            assert result.stats.drafted >= result.stats.accepted >= 0


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
@pytest.mark.parametrize("target", ["llama", "qwen3"])
def test_eagle3_trained_drafter_identity_with_acceptance(targets, eagle3_dirs, prompt_ids, plain, target):
    """A drafter fitted to the target is accepted often: partial acceptance at every depth,
    rollback of both caches, and re-running the drafter on accepted rows all get exercised."""
    engine = targets[target]
    proposer = eagle3_proposer(engine, eagle3_dirs[(target, "full")])
    text = corpus_text(20_000)
    held_out = [engine.tokenizer.encode(text[i:i + 200]) for i in range(1000, 20_000, 3000)]
    train_drafter(engine, proposer, held_out)
    # two training prompts (partly memorised: partial acceptance) and the unseen test prompts
    cases = [(ids, plain[(target, i)]) for i, ids in enumerate(prompt_ids)]
    cases += [(ids, engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids) for ids in held_out[:2]]
    engines = ((f"k={k}", spec_engine(engine, proposer, k)) for k in (1, 2, 3, 4, 5))
    accepted, drafted = assert_greedy_identity(engines, cases, NEW_TOKENS)
    # both branches of verification must have run for this test to mean anything
    assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.parametrize("right", ["always", "never", "partly"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_drafts_verified_where_they_are_made_on_the_device(targets, prompt_ids, plain, right, k, monkeypatch):
    """Greedy rounds whose drafts stay on the device (engine/spec_round.py `_round_on_device`: the verify pass takes
    them as its inputs, one read back after it) give plain greedy's tokens, alone and batched, with
    drafts always right, never right and right at two positions of three; the host path never ran."""
    engine = targets["qwen3"]
    continuations = {tuple(ids): plain[("qwen3", i)] for i, ids in enumerate(prompt_ids)}
    right_at = {"always": lambda i: True, "never": lambda i: False, "partly": lambda i: i % 3 != 2}[right]
    proposer = DeviceKeyedReplay(continuations, engine.model.vocab_size, wrong_at=lambda i: not right_at(i))
    spec = spec_engine(engine, proposer, k)
    host_rounds, host_propose = [], spec.runner.propose  # (a round that drafts nothing goes there)
    monkeypatch.setattr(spec.runner, "propose",
                        lambda seqs, counts: host_rounds.append(counts) if any(counts) else host_propose(seqs, counts))
    alone = [spec.generate_all(ids, greedy(NEW_TOKENS)) for ids in prompt_ids]
    together = spec.generate_batch(prompt_ids, greedy(NEW_TOKENS))
    assert not host_rounds  # (the double would have failed the round: its drafts are not read back)
    for i, (one, batched) in enumerate(zip(alone, together)):
        assert one.token_ids == batched.token_ids == plain[("qwen3", i)], f"prompt {i}"
        if right == "always":
            assert one.stats.accepted == one.stats.drafted and one.stats.rounds == -(-(NEW_TOKENS - 1) // (k + 1))
        elif right == "never":
            assert one.stats.accepted == 0 < one.stats.drafted
        else:
            assert 0 < one.stats.accepted < one.stats.drafted


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_always_right_proposer_accepts_everything(targets, prompt_ids, plain, k):
    engine = targets["qwen3"]
    for i, ids in enumerate(prompt_ids):
        cont = plain[("qwen3", i)]
        result = spec_engine(engine, ReplayProposer(cont, engine.model.vocab_size), k).generate_all(ids, greedy(NEW_TOKENS))
        assert result.token_ids == cont
        assert result.stats.accepted == result.stats.drafted
        # the first token comes from prefill; each round then yields k + 1 tokens (fewer at the end)
        assert result.stats.rounds == -(-(NEW_TOKENS - 1) // (k + 1))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_always_wrong_proposer_accepts_nothing(targets, prompt_ids, plain, k):
    engine = targets["qwen3"]
    for i, ids in enumerate(prompt_ids):
        cont = plain[("qwen3", i)]
        wrong = ReplayProposer(cont, engine.model.vocab_size, right_at=lambda j: False)
        result = spec_engine(engine, wrong, k).generate_all(ids, greedy(NEW_TOKENS))
        assert result.token_ids == cont
        assert result.stats.accepted == 0
        assert result.stats.rounds == NEW_TOKENS - 1


@pytest.mark.parametrize("reject_at", [0, 1, 2, 3])
def test_rejection_at_every_depth(targets, prompt_ids, plain, reject_at):
    """Drafts right except at chain position `reject_at` (mod 4): rollback at each depth."""
    engine = targets["llama"]
    ids = prompt_ids[1]
    cont = plain[("llama", 1)]
    proposer = ReplayProposer(cont, engine.model.vocab_size, right_at=lambda j: j % 4 != reject_at)
    result = spec_engine(engine, proposer, 4).generate_all(ids, greedy(NEW_TOKENS))
    assert result.token_ids == cont
    assert 0 < result.stats.accepted < result.stats.drafted


def test_penalties_stop_strings_and_logprobs_under_speculation(targets, prompt_ids):
    """Penalties are computed on the committed sequence (drafts included as they are accepted),
    stop strings and max_tokens are checked between accepted tokens, and logprobs come from the
    target's verify pass: all identical to plain decoding."""
    engine = targets["qwen3"]
    ids = prompt_ids[0]
    params = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, logprobs=True, top_logprobs=3)
    base = engine.generate_all(ids, greedy(40, **params))
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    for proposer in (ReplayProposer(base.token_ids, engine.model.vocab_size),
                     ReplayProposer(base.token_ids, engine.model.vocab_size, right_at=lambda j: j % 3 != 1)):
        spec = spec_engine(engine, proposer, 3)
        result = spec.generate_all(ids, greedy(40, **params))
        assert result.token_ids == base.token_ids
        for a, b in zip(result.logprobs, base.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-9)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        if stop.strip():
            with_stop = engine.generate_all(ids, greedy(40, stop=[stop], **params))
            spec_stop = spec.generate_all(ids, greedy(40, stop=[stop], **params))
            assert spec_stop.text == with_stop.text and stop not in spec_stop.text
            assert spec_stop.token_ids == with_stop.token_ids
        for n in (1, 2, 5, 7):
            short = spec.generate_all(ids, greedy(n, **params))
            assert short.token_ids == base.token_ids[:n]
            assert short.finish_reason.value == "length"
