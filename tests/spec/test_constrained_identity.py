"""Speculation under a grammar: constrained speculative greedy == constrained plain greedy, token for
token (float64), for every proposer (random EAGLE3 drafters, always-right / always-wrong replays,
rejection at every depth, the Qwen3.5 MTP head, the Gemma 4 assistant); the outputs validate against
the schema (jsonschema, the external oracle); drafts the grammar forbids are cut, never verified."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.spec.conftest import ReplayProposer, eagle3_proposer, greedy, spec_engine
from tools.tiny import (build_tiny_gemma4, build_tiny_gemma4_assistant, build_tiny_qwen3_5, random_mtp_head,
                                write_mtp_sidecar)
from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams
from verispec.engine.types import FinishReason
from verispec.grammar.spec import json_object_grammar, json_schema_grammar
from verispec.spec.gemma4_assistant import AssistantProposer, load_assistant
from verispec.spec.mtp import MtpProposer, load_mtp_head

# bounded everywhere, so even a random model completes it well inside max_tokens
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["alpha", "beta", "gamma"]},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["name", "count", "kind", "ok", "tags"], "additionalProperties": False}
MAX_TOKENS = 96


def constrained(**kw) -> SamplingParams:
    return greedy(MAX_TOKENS, grammar=json_schema_grammar(SCHEMA), **kw)


def check_valid(result) -> None:
    assert result.finish_reason is FinishReason.STOP, (result.finish_reason, result.text)
    jsonschema.validate(json.loads(result.text), SCHEMA)


@pytest.fixture(scope="module")
def plain_constrained(targets, prompt_ids):
    out = {}
    for name in ("llama", "qwen3"):
        for i, ids in enumerate(prompt_ids):
            result = targets[name].generate_all(ids, constrained())
            check_valid(result)  # the grammar ended it (ignore_eos is set: EOS could not have)
            out[(name, i)] = result.token_ids
    return out


def test_constrained_output_differs_from_unconstrained(targets, prompt_ids, plain_constrained):
    """The mask really acts: the unconstrained greedy text of a random model is not this JSON."""
    free = targets["qwen3"].generate_all(prompt_ids[0], greedy(MAX_TOKENS)).token_ids
    assert free[:len(plain_constrained[("qwen3", 0)])] != plain_constrained[("qwen3", 0)]


@pytest.mark.parametrize("target", ["llama", "qwen3"])
def test_eagle3_under_grammar(targets, eagle3_dirs, prompt_ids, plain_constrained, target):
    engine = targets[target]
    proposer = eagle3_proposer(engine, eagle3_dirs[(target, "offset")])
    for k in (1, 3):
        spec = spec_engine(engine, proposer, k)
        for i, ids in enumerate(prompt_ids):
            result = spec.generate_all(ids, constrained())
            assert result.token_ids == plain_constrained[(target, i)], f"k={k} prompt {i}"
            check_valid(result)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_always_right_and_always_wrong_replays(targets, prompt_ids, plain_constrained, k):
    engine = targets["qwen3"]
    for i, ids in enumerate(prompt_ids):
        expected = plain_constrained[("qwen3", i)]
        right = spec_engine(engine, ReplayProposer(expected, engine.model.vocab_size), k).generate_all(ids, constrained())
        assert right.token_ids == expected
        # past the end the replay drafts id 0, an EOS this grammar allows once complete; the target
        # may pick the other EOS there, so at most that one draft goes unaccepted
        assert 0 <= right.stats.drafted - right.stats.accepted <= 1 and right.stats.accepted > 0
        wrong_proposer = ReplayProposer(expected, engine.model.vocab_size, right_at=lambda j: False)
        wrong = spec_engine(engine, wrong_proposer, k).generate_all(ids, constrained())
        assert wrong.token_ids == expected
        assert wrong.stats.accepted == 0
        # a wrong draft the grammar forbids is cut before verification, so fewer are drafted than asked
        assert wrong.stats.drafted < k * wrong.stats.rounds


@pytest.mark.parametrize("reject_at", [0, 1, 2])
def test_rejection_at_every_depth(targets, prompt_ids, plain_constrained, reject_at):
    engine = targets["llama"]
    expected = plain_constrained[("llama", 1)]
    proposer = ReplayProposer(expected, engine.model.vocab_size, right_at=lambda j: j % 3 != reject_at)
    result = spec_engine(engine, proposer, 3).generate_all(prompt_ids[1], constrained())
    assert result.token_ids == expected
    assert 0 < result.stats.accepted < result.stats.drafted


def test_forbidden_drafts_are_cut_and_eos_waits_for_completion(targets, prompt_ids, plain_constrained):
    """A proposer that drafts EOS everywhere: EOS is forbidden while the JSON is incomplete, so every
    draft is cut (none verified) and the output is still the constrained greedy one, ended by the
    grammar with finish_reason stop. Without ignore_eos the same holds (EOS never wins early)."""
    engine = targets["qwen3"]
    eos = engine.eos_token_ids[0]
    expected = plain_constrained[("qwen3", 0)]

    class EosProposer(ReplayProposer):
        def draft(self, num_drafts, params, generator):
            draft = super().draft(num_drafts, params, generator)
            draft.token_ids = [eos] * num_drafts
            return draft

    for ignore_eos in (True, False):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=ignore_eos,
                                grammar=json_schema_grammar(SCHEMA))
        result = spec_engine(engine, EosProposer(expected, engine.model.vocab_size), 3).generate_all(
            prompt_ids[0], params)
        assert result.token_ids == expected
        assert result.stats.drafted == 0
        check_valid(result)


def test_sampling_under_grammar_stays_valid(targets, prompt_ids, plain_constrained):
    """Seeded sampling, plain and speculative (rejection sampling against the masked target):
    every output is valid JSON under the schema."""
    engine = targets["qwen3"]
    expected = plain_constrained[("qwen3", 0)]
    spec = spec_engine(engine, ReplayProposer(expected, engine.model.vocab_size, right_at=lambda j: j % 2 == 0), 3)
    for seed in range(4):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, ignore_eos=True,
                                grammar=json_schema_grammar(SCHEMA))
        for eng in (engine, spec):
            check_valid(eng.generate_all(prompt_ids[seed % len(prompt_ids)], params))
    any_object = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=3, grammar=json_object_grammar())
    result = engine.generate_all(prompt_ids[0], any_object)
    if result.finish_reason is FinishReason.STOP:  # an unbounded object may run out of tokens first
        assert isinstance(json.loads(result.text), dict)


def test_mtp_head_under_grammar(tmp_path_factory, tokenizer_dir):
    d = tmp_path_factory.mktemp("qwen3_5-grammar")
    build_tiny_qwen3_5(d, seed=31, tokenizer_dir=tokenizer_dir)
    write_mtp_sidecar(d / "mtp.safetensors", random_mtp_head(json.loads((d / "config.json").read_text()), seed=4))
    engine = load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8)
    ids = engine.tokenizer.encode("def fibonacci(n):")
    expected = engine.generate_all(ids, constrained())
    check_valid(expected)
    mtp = MtpProposer(load_mtp_head(d, engine.model), num_real_tokens=engine.num_real_tokens)
    for k in (1, 2):
        assert spec_engine(engine, mtp, k).generate_all(ids, constrained()).token_ids == expected.token_ids


def test_gemma4_assistant_under_grammar(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("gemma4-grammar")
    build_tiny_gemma4(root / "target", seed=41, tokenizer_dir=tokenizer_dir)
    config = json.loads((root / "target" / "config.json").read_text())
    build_tiny_gemma4_assistant(root / "assistant", config, seed=42)
    engine = load_engine(str(root / "target"), dtype="float64", device="cpu", prefill_step_size=8)
    ids = engine.tokenizer.encode("def fibonacci(n):")
    expected = engine.generate_all(ids, constrained())
    check_valid(expected)
    assistant = AssistantProposer(load_assistant(root / "assistant", engine.model), engine.model,
                                  engine.num_real_tokens)
    result = spec_engine(engine, assistant, 2).generate_all(ids, constrained())
    assert result.token_ids == expected.token_ids
