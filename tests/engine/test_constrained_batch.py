"""Grammars inside the batch, and the forced-call grammar of every tool syntax.

A constrained sequence's output alone == its output inside a batch of mixed constrained and
unconstrained requests (float64), plain and speculating (always-right / always-wrong replays); the
unconstrained requests are unchanged by their neighbours' grammars. And for each tool-call syntax,
the grammar of a forced call makes even a random model emit a call that the same syntax's parser
reads back, with arguments that validate against the tool's schema (jsonschema).
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.engine.test_batch_identity import SHAPE, TEXTS, KeyedReplay, spec
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.engine.types import FinishReason
from verispec.grammar.spec import json_object_grammar, json_schema_grammar, lark_grammar
from verispec.server.tools.parsers import FORMATS, MistralFormat
from verispec.server.tools.request import special_token_marker

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "label": {"enum": ["x", "y"]}, "note": {"type": "string", "maxLength": 5}},
          "required": ["id", "label", "note"], "additionalProperties": False}
TOOL = {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                     "label": {"type": "string", "maxLength": 6},
                                     "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "maxItems": 2},
                                     "loud": {"type": "boolean"}},
    "required": ["hour", "label", "days", "loud"], "additionalProperties": False}}
NEW = 64


@pytest.fixture(scope="module")
def engine(tiny_models) -> Engine:
    d = tiny_models.get("batch-qwen3", "qwen3", **SHAPE)
    return load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8, max_num_batched_tokens=24)


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=NEW, temperature=0.0, grammar=json_schema_grammar(SCHEMA)),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=NEW, temperature=0.9, seed=5, grammar=json_schema_grammar(SCHEMA)),
        SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.2,
                       grammar=json_object_grammar()),
    ]


def check_batch(engine: Engine, prompts, params, label: str) -> list:
    alone = [engine.generate_all(ids, p) for ids, p in zip(prompts, params)]
    together = engine.generate_batch(prompts, params)  # submitted at once; a failed request raises here
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.token_ids == a.token_ids, f"{label}: request {i} differs in the batch"
        assert b.finish_reason == a.finish_reason
    assert engine.blocks.num_used == 0
    return alone


def test_constrained_alone_equals_inside_a_mixed_batch(engine):
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    params = mixed_params()
    alone = check_batch(engine, prompts, params, "plain")
    for i in (0, 2):  # the schema-constrained ones: valid JSON, ended by the grammar
        assert alone[i].finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(alone[i].text), SCHEMA)
    # the greedy constrained continuations, replayed right and wrong inside the batch
    continuations = {tuple(ids): r.token_ids for ids, r in zip(prompts, alone)}
    v = engine.model.vocab_size
    for name, right in (("right", True), ("wrong", False)):
        spec_engine = spec(engine, KeyedReplay(continuations, v, wrong_at=lambda i: not right), 3)
        check_batch(spec_engine, prompts, params, name)
        # speculation changes nothing for greedy requests (sampling tokens depend on the drafts per round)
        for i in (0, 1, 4):
            assert spec_engine.generate_all(prompts[i], params[i]).token_ids == alone[i].token_ids, (name, i)


def forced_call_grammar(engine: Engine, fmt):
    marker = special_token_marker(engine.tokenizer)
    return lark_grammar(fmt.grammar([TOOL], False, marker), f"{fmt.name} tool call", "tools")


@pytest.mark.parametrize("name", ["hermes", "qwen3_xml", "llama3_json", "mistral", "mistral_v11", "gemma4"])
def test_forced_call_grammar_parses_back_and_validates(engine, name):
    fmt = MistralFormat("[ARGS]") if name == "mistral_v11" else FORMATS[name]
    grammar = forced_call_grammar(engine, fmt)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=200, temperature=0.0 if i == 0 else 1.0, seed=i, grammar=grammar)
        result = engine.generate_all(ids, params)
        assert result.finish_reason is FinishReason.STOP, (name, result.text)
        reply = fmt.parse(result.text, [TOOL])
        assert [c.name for c in reply.calls] == ["set_alarm"], (name, result.text)
        assert reply.content == ""
        jsonschema.validate(json.loads(reply.calls[0].arguments), TOOL["parameters"])
