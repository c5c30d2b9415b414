"""Tool calls and structured output through the official openai client against a live server.

The tiny model is random, so only the grammar makes its calls valid: a forced call's arguments must
validate against the tool's schema (jsonschema), a json_schema response against its schema; a
streamed call assembles to the non-streamed one; auto calls are parsed out of scripted replies; bad
fields are 400s naming them, and the server keeps serving.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from server_helpers import SERVED_NAME, live_server, openai_client
from verispec.engine.engine import load_engine
from verispec.server.app import create_app

ALARM = {"type": "object", "properties": {
    "hour": {"type": "integer", "minimum": 0, "maximum": 23}, "label": {"type": "string", "maxLength": 8},
    "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3}},
    "required": ["hour", "label", "days"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "metric": {"type": "boolean"}},
           "required": ["city", "metric"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm", "parameters": ALARM}},
         {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
SCHEMAS = {"set_alarm": ALARM, "get_weather": WEATHER}
ASK = [{"role": "user", "content": "Wake me at seven on Monday."}]
BASE = dict(model=SERVED_NAME, messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=160)
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_calls(message, allowed: set[str]) -> list[tuple[str, dict]]:
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def assemble_stream(chunks) -> tuple[str, list[tuple[str, str]], str]:
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
                if d.function.name:  # the first delta of a call: its id, type and name
                    assert entry["name"] is None and d.id and d.type == "function"
                    entry["name"] = d.function.name
                entry["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


def test_named_tool_choice_returns_a_valid_call(client):
    out = client.chat.completions.create(tool_choice=NAMED, **BASE)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert [name for name, _ in check_calls(choice.message, {"get_weather"})][0] == "get_weather"


def test_required_with_one_call_at_most(client):
    out = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **BASE)
    assert out.choices[0].finish_reason == "tool_calls"
    assert len(check_calls(out.choices[0].message, set(SCHEMAS))) == 1


def test_required_sampled_calls_validate(client):
    for seed in range(3):
        out = client.chat.completions.create(tool_choice="required", seed=seed, parallel_tool_calls=False,
                                             **{**BASE, "temperature": 1.0, "max_tokens": 200})
        assert out.choices[0].finish_reason == "tool_calls"
        assert len(check_calls(out.choices[0].message, set(SCHEMAS))) == 1


def test_streamed_call_assembles_to_the_non_streamed_one(client):
    for choice in (NAMED, "required"):
        full = client.chat.completions.create(tool_choice=choice, parallel_tool_calls=False, **BASE)
        chunks = list(client.chat.completions.create(tool_choice=choice, parallel_tool_calls=False, stream=True,
                                                     **BASE))
        content, calls, finish = assemble_stream(chunks)
        message = full.choices[0].message
        assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert content == (message.content or "") and finish == full.choices[0].finish_reason == "tool_calls"


@pytest.fixture(scope="module")
def newline_then_end_client(tiny_model_dir):
    """A server whose model, wherever the grammar lets it, writes a newline and then ends: what a real
    model does after a call (`</tool_call>` "\\n" `<|im_end|>`). Its logits are the tiny model's plus a
    large bias for the newline token and a smaller one for end-of-sequence."""
    engine = load_engine(str(tiny_model_dir), dtype="float32", device="cpu")
    (newline,) = engine.tokenizer.encode("\n")
    eos = engine.tokenizer.eos_token_ids
    plain_logits = engine.model.logits

    def biased_logits(hidden):
        logits = plain_logits(hidden).clone()
        logits[..., newline] += 40.0
        logits[..., eos] += 20.0
        return logits

    engine.model.logits = biased_logits
    with live_server(create_app(engine, SERVED_NAME)) as srv:
        yield openai_client(srv)
    engine.shutdown()


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_call_with_parallel_calls_on_ends_after_the_call(newline_then_end_client, choice):
    """parallel_tool_calls left at its default (true): a newline after the call must not force a
    second call; the reply is one call, no leaked text, finish_reason tool_calls; streamed alike."""
    kwargs = dict(tool_choice=choice, **BASE)
    out = newline_then_end_client.chat.completions.create(**kwargs)
    choice_out = out.choices[0]
    allowed = {"get_weather"} if choice is NAMED else set(SCHEMAS)
    assert len(check_calls(choice_out.message, allowed)) == 1, choice_out.message
    assert choice_out.finish_reason == "tool_calls" and choice_out.message.content is None
    content, calls, finish = assemble_stream(newline_then_end_client.chat.completions.create(stream=True, **kwargs))
    assert calls == [(c.function.name, c.function.arguments) for c in choice_out.message.tool_calls]
    assert content == "" and finish == "tool_calls"


def test_named_call_is_one_call_even_with_parallel_calls_on(client):
    for stream in (False, True):
        kwargs = dict(tool_choice=NAMED, parallel_tool_calls=True, **BASE)
        if stream:
            content, calls, finish = assemble_stream(client.chat.completions.create(stream=True, **kwargs))
        else:
            out = client.chat.completions.create(**kwargs)
            check_calls(out.choices[0].message, {"get_weather"})
            content = out.choices[0].message.content or ""
            calls = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
            finish = out.choices[0].finish_reason
        assert [name for name, _ in calls] == ["get_weather"] and content == "" and finish == "tool_calls"


def test_json_schema_response_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                        "maxItems": 2}},
              "required": ["name", "age", "pets"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    for stream in (False, True):
        kwargs = dict(model=SERVED_NAME, messages=ASK, temperature=0.0, max_tokens=120, response_format=fmt)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kwargs) if c.choices)
        else:
            out = client.chat.completions.create(**kwargs)
            assert out.choices[0].finish_reason == "stop"
            text = out.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)


def test_json_object_response_parses(client):
    out = client.chat.completions.create(model=SERVED_NAME, messages=ASK, temperature=0.0, max_tokens=200,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_history_with_calls_and_tool_results_renders(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "metric": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    out = client.chat.completions.create(**{**BASE, "messages": history, "max_tokens": 4})
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_and_auto_on_plain_text(client):
    for choice in ("none", "auto"):
        out = client.chat.completions.create(tool_choice=choice, **{**BASE, "max_tokens": 8})
        assert out.choices[0].message.tool_calls is None
        assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("pieces", [
    ["Let me", " set it.\n<tool_", "call>\n{\"name\": \"set_alarm\", \"arguments\": {\"hour\": 7, ",
     "\"label\": \"up\", \"days\": [\"mon\"]}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", ",
     "\"arguments\": {\"city\": \"Oslo\", \"metric\": true}}\n</tool", "_call>"],
    ["<tool_call>{\"name\": \"set_alarm\", \"arguments\": {\"hour\": 7, \"label\": \"up\", \"days\": []}}</tool_call>"],
])
def test_auto_calls_parsed_from_a_reply(scripted_server, scripted_engine, monkeypatch, pieces):
    monkeypatch.setattr(scripted_engine, "pieces", pieces)
    client = openai_client(scripted_server)
    kwargs = dict(model="scripted", messages=ASK, tools=TOOLS)
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    calls = check_calls(message, set(SCHEMAS))
    assert calls[0] == ("set_alarm", {"hour": 7, "label": "up", "days": ["mon"] if len(pieces) > 1 else []})
    assert full.choices[0].finish_reason == "tool_calls"
    assert message.content == ("Let me set it." if len(pieces) > 1 else None)
    content, streamed, finish = assemble_stream(client.chat.completions.create(stream=True, **kwargs))
    assert streamed == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert content == (message.content or "") and finish == "tool_calls"


def test_malformed_call_stays_content(scripted_server, scripted_engine, monkeypatch):
    text = 'Oops <tool_call>{"name": "set_alarm", "arguments": {</tool_call>'
    monkeypatch.setattr(scripted_engine, "pieces", [text])
    out = openai_client(scripted_server).chat.completions.create(model="scripted", messages=ASK, tools=TOOLS)
    assert out.choices[0].message.content == text and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"


SCHEMA_NOT = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
BAD = [
    # (id, extra body fields, param)
    ("unknown tool_choice name", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("tool_choice word", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tools not a list", {"tools": {"type": "function"}}, "tools"),
    ("tool type", {"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ("tool name", {"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ("tool without function", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("duplicate tool", {"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ("parameters not a schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    ("unsupported keyword in forced tool", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": SCHEMA_NOT}}], "tool_choice": "required"}, "tools[0].function.parameters"),
    ("response_format type", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("response_format not an object", {"response_format": "json"}, "response_format"),
    ("json_schema without schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("unsupported schema keyword", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA_NOT}}}, "response_format.json_schema.schema"),
    ("invalid schema type", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format.json_schema.schema"),
    ("forced call and json together", {"tools": TOOLS, "tool_choice": "required",
                                       "response_format": {"type": "json_object"}}, "response_format"),
    ("parallel_tool_calls not bool", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize("name,extra,param", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tool_and_format_fields_are_400s(http, client, name, extra, param, stream):
    body = {"model": SERVED_NAME, "messages": ASK, "max_tokens": 2, "stream": stream, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split("[")[0].split(".")[0] in error["message"]
    # and the server keeps serving
    assert client.chat.completions.create(model=SERVED_NAME, messages=ASK, max_tokens=2).choices


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "nope"}}, **BASE)
    assert err.value.body["param"] == "tool_choice"
