"""Model-free drafting (--suffix, --ngram, and --suffix beside EAGLE3) is lossless: speculative
greedy output == plain greedy output token for token (float64), alone and in mixed batches, with a
shared cache warmed with the exact outputs (drafts right) or with wrong ones, under grammars,
stops, penalties and logprobs; sampling keeps the target's distribution (chi-square)."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from tests.spec.conftest import eagle3_proposer, greedy, spec_engine
from tests.spec.second_token import CHI2_CRIT_3DF_P001, samples_after, second_token_counts, second_token_target
from tests.spec.test_constrained_identity import check_valid, constrained
from tests.spec.test_sampling import chi_square
from verispec.sampling.params import SamplingParams
from verispec.spec.composite import LongestDraft, Member
from verispec.spec.suffix import NgramOptions, NgramProposer, SuffixOptions, SuffixProposer

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def plain(targets, prompt_ids):
    return {(name, i): targets[name].generate_all(ids, greedy(NEW_TOKENS)).token_ids
            for name in ("llama", "qwen3") for i, ids in enumerate(prompt_ids)}


@pytest.mark.parametrize("target", ["llama", "qwen3"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_suffix_greedy_identity(targets, prompt_ids, plain, target, k):
    """A cold cache: drafts come from each sequence's own repetitions and from the outputs that
    finished before it (the cache fills as the prompts run)."""
    engine = targets[target]
    spec = spec_engine(engine, SuffixProposer(), k)
    drafted = 0
    cached = 0
    for i, ids in enumerate(prompt_ids + prompt_ids[1:2]):  # the repeat starts from the prefix cache
        result = spec.generate_all(ids, greedy(NEW_TOKENS))
        assert result.token_ids == plain[(target, i if i < len(prompt_ids) else 1)], f"k={k} prompt {i}"
        assert result.stats.method == "suffix"
        drafted += result.stats.drafted
        cached += result.stats.cached_tokens
    assert drafted > 0 and cached > 0


def _shifted(tokens: list[int], vocab: int) -> list[int]:
    return [(t + 1) % vocab for t in tokens]


@pytest.mark.parametrize("k", [2, 5])
def test_warm_cache_right_and_wrong(targets, prompt_ids, plain, k):
    """Warmed with each prompt + its exact output, the cache's long matches draft right: nearly
    everything is accepted. Warmed with wrong continuations, drafts are rejected: same output."""
    engine = targets["qwen3"]
    vocab = engine.model.vocab_size
    right = SuffixProposer()
    wrong = SuffixProposer(SuffixOptions(min_prob=0.0))
    for i, ids in enumerate(prompt_ids):
        right.remember(ids + plain[("qwen3", i)])
        wrong.remember(ids + _shifted(plain[("qwen3", i)], vocab))
    right_spec, wrong_spec = spec_engine(engine, right, k), spec_engine(engine, wrong, k)
    accepted = drafted = rejected = 0
    for i, ids in enumerate(prompt_ids):
        expected = plain[("qwen3", i)]
        result = right_spec.generate_all(ids, greedy(NEW_TOKENS))
        assert result.token_ids == expected
        accepted += result.stats.accepted
        drafted += result.stats.drafted
        bad = wrong_spec.generate_all(ids, greedy(NEW_TOKENS))
        assert bad.token_ids == expected
        rejected += bad.stats.drafted - bad.stats.accepted
    assert drafted > 0 and accepted >= 0.9 * drafted, (accepted, drafted)
    assert rejected > 0


def test_mixed_batch_equals_each_alone(targets, prompt_ids, plain):
    """Suffix sequences batched with each other: greedy, greedy with penalties and logprobs, a stop
    string, and sampled rows; every greedy row equals its plain output alone."""
    engine = targets["llama"]
    proposer = SuffixProposer()
    for i, ids in enumerate(prompt_ids[:2]):
        proposer.remember(ids + plain[("llama", i)][:NEW_TOKENS // 2])  # right for a while, then silent
    extra = dict(repetition_penalty=1.2, frequency_penalty=0.3, logprobs=True, top_logprobs=2)
    base_pen = engine.generate_all(prompt_ids[1], greedy(NEW_TOKENS, **extra))
    text = engine.generate_all(prompt_ids[0], greedy(NEW_TOKENS)).text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    with_stop = engine.generate_all(prompt_ids[0], greedy(NEW_TOKENS, stop=[stop]))
    for k in (2, 4):
        spec = spec_engine(engine, proposer, k)
        prompts = list(prompt_ids) + [prompt_ids[1], prompt_ids[0], prompt_ids[2], prompt_ids[0]]
        params = [greedy(NEW_TOKENS)] * 3 + [greedy(NEW_TOKENS, **extra), greedy(NEW_TOKENS, stop=[stop]),
                                             SamplingParams(temperature=0.8, seed=1, max_tokens=NEW_TOKENS),
                                             SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=NEW_TOKENS)]
        results = spec.generate_batch(prompts, params)
        for i in range(3):
            assert results[i].token_ids == plain[("llama", i)], f"k={k} prompt {i}"
        assert results[3].token_ids == base_pen.token_ids
        for a, b in zip(results[3].logprobs, base_pen.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-9)
        assert results[4].token_ids == with_stop.token_ids and results[4].text == with_stop.text
        assert all(len(r.token_ids) > 0 for r in results[5:])
        assert sum(r.stats.drafted for r in results) > 0


@pytest.mark.parametrize("k", [1, 4])
def test_ngram_greedy_identity(targets, prompt_ids, plain, k):
    engine = targets["qwen3"]
    for options in (NgramOptions(), NgramOptions(1, 2)):
        spec = spec_engine(engine, NgramProposer(options), k)
        results = spec.generate_batch(prompt_ids, greedy(NEW_TOKENS))
        for i, result in enumerate(results):
            assert result.token_ids == plain[("qwen3", i)], f"k={k} {options} prompt {i}"
            assert result.stats.method == "ngram"
        assert sum(r.stats.drafted for r in results) > 0


def test_suffix_beside_eagle3(targets, eagle3_dirs, prompt_ids, plain):
    """The composite: per sequence per round the longer draft of a warm suffix cache (right for the
    first half of each output, silent after) and a random EAGLE3 drafter; both are used."""
    engine = targets["qwen3"]
    suffix = SuffixProposer()
    for i, ids in enumerate(prompt_ids):
        suffix.remember(ids + plain[("qwen3", i)][:NEW_TOKENS // 2])
    eagle = eagle3_proposer(engine, eagle3_dirs[("qwen3", "full")])
    composite = LongestDraft([Member(suffix, 6), Member(eagle, 2)])
    calls = Counter()
    for member in composite.members:
        original = member.proposer.propose

        def counted(seqs, *a, _orig=original, _name=member.proposer.method):
            calls[_name] += len(seqs)
            return _orig(seqs, *a)
        member.proposer.propose = counted
    assert composite.method == "suffix+eagle3" and composite.capture_layers == eagle.capture_layers
    spec = spec_engine(engine, composite, 6)
    results = spec.generate_batch(prompt_ids, greedy(NEW_TOKENS))
    for i, result in enumerate(results):
        assert result.token_ids == plain[("qwen3", i)], f"prompt {i}"
    alone = [spec.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompt_ids]
    assert alone == [plain[("qwen3", i)] for i in range(len(prompt_ids))]
    assert calls["suffix"] > calls["eagle3"] > 0  # the model drafter only where the suffix fell short


def test_suffix_under_grammar(targets, prompt_ids):
    engine = targets["qwen3"]
    for i, ids in enumerate(prompt_ids[:2]):
        expected = engine.generate_all(ids, constrained())
        check_valid(expected)
        proposer = SuffixProposer()
        proposer.remember(ids + expected.token_ids)  # right drafts, then EOS-forbidden ones are cut
        for k in (1, 4):
            result = spec_engine(engine, proposer, k).generate_all(ids, constrained())
            assert result.token_ids == expected.token_ids
            check_valid(result)
            assert result.stats.accepted > 0


@pytest.mark.slow  # ~1 minute on two shared cores: 2,000+ seeded generations
def test_suffix_sampling_keeps_the_target_distribution(targets, prompt_ids):
    """The second token (the first one verified), given the first, follows the target's processed
    distribution when the cache always drafts the target's second most likely token (one-hot
    draft: accepted with probability p, else resampled from p without it)."""
    engine = targets["qwen2"]
    ids = prompt_ids[0]
    first, top, target = second_token_target(engine, ids)
    drafted_token = int(top[1])
    proposer = SuffixProposer(SuffixOptions(cache_tokens=1 << 12))
    proposer.remember(ids + [first, drafted_token])
    results = samples_after(spec_engine(engine, proposer, 1), ids, first)
    accepted = sum(r.stats.accepted > 0 and r.token_ids[1] == drafted_token for r in results)
    assert 0 < accepted < len(results)
    assert chi_square(second_token_counts(results, top), target, len(results)) < CHI2_CRIT_3DF_P001


# ---- configuration and CLI -------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--suffix", "--ngram"], "--suffix and --ngram are two model-free proposers; use one of them"),
    (["--suffix-cache-tokens", "10"], "--suffix-cache-tokens needs --suffix"),
    (["--ngram-max", "3"], "--ngram-max needs --ngram"),
    (["--suffix", "--suffix-cache-tokens", "-1"], "--suffix-cache-tokens must be >= 0, got -1"),
    (["--ngram", "--ngram-min", "4", "--ngram-max", "2"],
     "--ngram-min and --ngram-max need 1 <= min <= max, got 4 and 2"),
    (["--ngram", "--ngram-min", "0"], "--ngram-min must be >= 1, got 0"),
    (["--suffix", "--no-spec"], "--no-spec turns speculation off; it cannot be combined with --mtp, --eagle3, "
                                "--suffix or --ngram"),
])
def test_cli_bad_model_free_flags_are_one_line(capsys, args, message):
    """Refused before any model loads (the model path does not exist)."""
    from verispec.cli import main as cli_main

    code = cli_main(["generate", "-m", "/nowhere/model", "--prompt", "x", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines() == [f"verispec: error: {message}"], err


def test_engine_config_builds_the_asked_proposer(qwen3_dir):
    from verispec.engine.engine import load_engine
    from verispec.errors import VerispecError

    engine = load_engine(str(qwen3_dir), dtype="float64", device="cpu", suffix=True, suffix_cache_tokens=0)
    assert engine.method == "suffix" and engine.num_drafts == 8 and engine.proposer.cache is None
    engine = load_engine(str(qwen3_dir), dtype="float64", device="cpu", ngram=True, ngram_min=1, ngram_max=3,
                         num_draft_tokens=4)
    assert engine.method == "ngram" and engine.num_drafts == 4 and engine.proposer.options == NgramOptions(1, 3)
    with pytest.raises(VerispecError, match="two model-free proposers"):
        load_engine(str(qwen3_dir), suffix=True, ngram=True)


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_cli_generate_json_reports_suffix(qwen3_dir):
    from tests.spec.mtp_checkpoints import run_cli

    common = ["generate", "-m", str(qwen3_dir), "--prompt", "def f", "--max-tokens", "24", "--json",
              "--dtype", "float64", "--device", "cpu", "--no-chat-template"]
    (spec_code, spec_out, spec_err), (base_code, base_out, base_err) = run_cli(
        common + ["--suffix", "--num-draft-tokens", "4"], common)
    assert spec_code == 0 and base_code == 0, spec_err + base_err
    out, ref = json.loads(spec_out), json.loads(base_out)
    assert out["token_ids"] == ref["token_ids"] and out["text"] == ref["text"]
    assert out["stats"]["method"] == "suffix" and ref["stats"]["method"] == "ar"
