"""Hostile and malformed requests: each gets its 4xx with OpenAI-style error JSON naming the field,
and the server answers a normal request right after."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server_helpers import SERVED_NAME, USER_MESSAGES

CHAT = {"model": SERVED_NAME, "messages": USER_MESSAGES, "max_tokens": 2}
COMPLETION = {"model": SERVED_NAME, "prompt": "def f(x):", "max_tokens": 2}
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"


def raw(body: dict, **replace: str) -> str:
    """The body as JSON text, with placeholder strings swapped for raw JSON (escapes json.dumps
    would never write, like a lone surrogate, or numbers Python would not produce)."""
    text = json.dumps(body)
    for placeholder, json_text in replace.items():
        text = text.replace(json.dumps(placeholder), json_text)
    return text


SURROGATE = '"a\\ud800b"'
HOSTILE = [
    # (id, path, raw JSON body, status, param, code)
    ("seed over 2**70", CHAT_PATH, raw({**CHAT, "seed": 1180591620717411303424}), 400, "seed", None),
    ("seed 2**64", COMPLETION_PATH, raw({**COMPLETION, "seed": 2**64}), 400, "seed", None),
    ("seed below -2**63", CHAT_PATH, raw({**CHAT, "seed": -2**63 - 1}), 400, "seed", None),
    ("surrogate in user message", CHAT_PATH,
     raw({**CHAT, "messages": [{"role": "user", "content": "S"}]}, S=SURROGATE), 400, "messages[0].content", None),
    ("surrogate in system message", CHAT_PATH,
     raw({**CHAT, "messages": [{"role": "system", "content": "S"}, *USER_MESSAGES]}, S=SURROGATE), 400,
     "messages[0].content", None),
    ("surrogate in content part", CHAT_PATH,
     raw({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "S"}]}]}, S=SURROGATE),
     400, "messages[0].content[0].text", None),
    ("surrogate in prompt", COMPLETION_PATH, raw({**COMPLETION, "prompt": "S"}, S=SURROGATE), 400, "prompt", None),
    ("surrogate in model", CHAT_PATH, raw({**CHAT, "model": "S"}, S=SURROGATE), 400, "model", None),
    ("surrogate in stop", CHAT_PATH, raw({**CHAT, "stop": ["S"]}, S=SURROGATE), 400, "stop[0]", None),
    ("surrogate in template kwargs key", CHAT_PATH,
     raw({**CHAT, "chat_template_kwargs": {"K": 1}}, K=SURROGATE), 400, "chat_template_kwargs", None),
    ("booleans as token ids", COMPLETION_PATH, raw({**COMPLETION, "prompt": [[False]]}), 400, "prompt", None),
    ("boolean token id", COMPLETION_PATH, raw({**COMPLETION, "prompt": [True, 5]}), 400, "prompt", None),
    ("stream as a string", CHAT_PATH, raw({**CHAT, "stream": "yes"}), 400, "stream", None),
    ("max_tokens as a string", CHAT_PATH, raw({**CHAT, "max_tokens": "5"}), 400, "max_tokens", None),
    ("max_tokens as a boolean", COMPLETION_PATH, raw({**COMPLETION, "max_tokens": True}), 400, "max_tokens", None),
    ("n as a float", CHAT_PATH, raw({**CHAT, "n": 1.5}), 400, "n", None),
    ("temperature as a boolean", CHAT_PATH, raw({**CHAT, "temperature": True}), 400, "temperature", None),
    ("stop_token_ids past the vocabulary", CHAT_PATH, raw({**CHAT, "stop_token_ids": [10**9]}), 400,
     "stop_token_ids", None),
    ("negative stop_token_ids", COMPLETION_PATH, raw({**COMPLETION, "stop_token_ids": [-1]}), 400,
     "stop_token_ids", None),
    ("top_logprobs without logprobs", CHAT_PATH, raw({**CHAT, "top_logprobs": 2}), 400, "top_logprobs", None),
    ("top_logprobs with logprobs false", CHAT_PATH, raw({**CHAT, "logprobs": False, "top_logprobs": 0}), 400,
     "top_logprobs", None),
    ("NaN temperature", CHAT_PATH, raw({**CHAT, "temperature": "X"}, X="NaN"), 400, "temperature", None),
    ("infinite repetition_penalty", CHAT_PATH, raw({**CHAT, "repetition_penalty": "X"}, X="Infinity"), 400,
     "repetition_penalty", None),
    ("tiny repetition_penalty", CHAT_PATH, raw({**CHAT, "repetition_penalty": 1e-300}), 400,
     "repetition_penalty", None),
    ("huge repetition_penalty", COMPLETION_PATH, raw({**COMPLETION, "repetition_penalty": 1e300}), 400,
     "repetition_penalty", None),
    ("huge max_tokens", CHAT_PATH, raw({**CHAT, "max_tokens": 10**30}), 400, "max_tokens",
     "context_length_exceeded"),
    ("empty prompt list", COMPLETION_PATH, raw({**COMPLETION, "prompt": []}), 400, "prompt", None),
    ("empty token list", COMPLETION_PATH, raw({**COMPLETION, "prompt": [[]]}), 400, "prompt", None),
    ("empty messages", CHAT_PATH, raw({**CHAT, "messages": []}), 400, "messages", None),
    ("a template of the client's own", CHAT_PATH,
     raw({**CHAT, "chat_template_kwargs": {"chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}x"
                                                            "{% endfor %}{% endfor %}"}}), 400, "chat_template_kwargs", None),
    ("tokenize in template kwargs", CHAT_PATH, raw({**CHAT, "chat_template_kwargs": {"tokenize": True}}), 400,
     "chat_template_kwargs", None),
    ("100k stop strings", COMPLETION_PATH, raw({**COMPLETION, "stop": [f"s{i}" for i in range(10**5)]}), 400,
     "stop", None),
    ("deeply nested JSON", CHAT_PATH, '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None, None),
    ("body is a string", CHAT_PATH, '"hello"', 400, None, None),
    ("role not a string", CHAT_PATH, raw({**CHAT, "messages": [{"role": 1, "content": "x"}]}), 400,
     "messages[0].role", None),
    ("NaN logit_bias", CHAT_PATH, raw({**CHAT, "logit_bias": {"5": "X"}}, X="NaN"), 400, "logit_bias", None),
    ("string logit_bias", COMPLETION_PATH, raw({**COMPLETION, "logit_bias": {"5": "-100"}}), 400, "logit_bias", None),
    ("logit_bias over 100", CHAT_PATH, raw({**CHAT, "logit_bias": {"5": 100.5}}), 400, "logit_bias", None),
    ("logit_bias key not a token id", CHAT_PATH, raw({**CHAT, "logit_bias": {"Paris": -100}}), 400, "logit_bias", None),
    ("logit_bias key past the vocabulary", CHAT_PATH, raw({**CHAT, "logit_bias": {"99999999": -100}}), 400,
     "logit_bias", None),
    ("empty response_format", CHAT_PATH, raw({**CHAT, "response_format": {}}), 400, "response_format.type", None),
    ("schema recursive without end", CHAT_PATH,
     raw({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
         "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}}), 400,
     "response_format.json_schema.schema", None),
    ("schema $defs recursive without end", CHAT_PATH,
     raw({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
         "$defs": {"node": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/node"}}},
         "$ref": "#/$defs/node"}}}}), 400, "response_format.json_schema.schema", None),
    ("tool parameters recursive without end", CHAT_PATH,
     raw({**CHAT, "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}}]}), 400,
     "tools[0].function.parameters", None),
]


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error
    return error


def assert_still_serving(http) -> None:
    response = http.post(CHAT_PATH, json=CHAT)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("name,path,body,status,param,code", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_request(http, name, path, body, status, param, code):
    response = http.post(path, content=body.encode("utf-8"), headers={"content-type": "application/json"})
    error = assert_error(response, status, param, code)
    if "surrogate" in name:  # ours, or pydantic's own check of constrained strings
        assert "surrogate" in error["message"] or "unicode" in error["message"]
    assert_still_serving(http)


@pytest.mark.parametrize("stream", [False, True])
def test_hostile_request_refused_before_a_stream_starts(http, stream):
    body = raw({**COMPLETION, "stream": stream, "seed": 2**64})
    assert_error(http.post(COMPLETION_PATH, content=body, headers={"content-type": "application/json"}),
                 400, "seed", None)


def test_trace_is_405_with_allow(http):
    response = http.request("TRACE", CHAT_PATH)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["message"]
    assert http.request("TRACE", "/v1/models").headers["allow"] == "GET"


def test_body_over_the_cap_is_413_without_reading_it(server, http):
    big = raw({**COMPLETION, "prompt": "x" * (9 * 1024 * 1024)})  # over the 8 MiB default
    start = time.monotonic()
    response = http.post(COMPLETION_PATH, content=big, headers={"content-type": "application/json"})
    assert_error(response, 413, None, "request_too_large")
    assert time.monotonic() - start < 5

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * (1024 * 1024)

    response = http.post(COMPLETION_PATH, content=chunked(), headers={"content-type": "application/json"})
    assert_error(response, 413, None, "request_too_large")
    assert_still_serving(http)


def test_long_prompt_refused_by_length_while_the_loop_stays_free(server, http):
    """A prompt under the byte cap but longer than any prompt the context can take is refused
    before tokenizing; /health answers meanwhile."""
    body = raw({**COMPLETION, "prompt": "word " * (1500 * 1024)})  # 7.5 MB
    answers = []

    def health_while_busy():
        time.sleep(0.05)
        start = time.monotonic()
        answers.append((httpx.get(server.url + "/health", timeout=10).status_code, time.monotonic() - start))

    checker = threading.Thread(target=health_while_busy)
    checker.start()
    start = time.monotonic()
    response = http.post(COMPLETION_PATH, content=body, headers={"content-type": "application/json"})
    elapsed = time.monotonic() - start
    checker.join(10)
    assert_error(response, 400, "prompt", "context_length_exceeded")
    assert elapsed < 5  # tokenizing 7.5 MB takes ~20 s on this machine
    assert answers and answers[0][0] == 200 and answers[0][1] < 1.0
    by_ids = raw({**COMPLETION, "prompt": [5] * (2500 * 1024)})  # 7.5 MB of token ids
    start = time.monotonic()
    assert_error(http.post(COMPLETION_PATH, content=by_ids, headers={"content-type": "application/json"}), 400,
                 "prompt", "context_length_exceeded")
    assert time.monotonic() - start < 10
    chat = raw({**CHAT, "messages": [{"role": "user", "content": "word " * (1500 * 1024)}]})
    assert_error(http.post(CHAT_PATH, content=chat, headers={"content-type": "application/json"}), 400,
                 "messages", "context_length_exceeded")


def test_max_request_bytes_is_configurable(engine):
    from server_helpers import live_server
    from verispec.server.app import create_app

    with live_server(create_app(engine, SERVED_NAME, max_request_bytes=1000)) as small:
        with httpx.Client(base_url=small.url, timeout=30) as c:
            assert c.post(COMPLETION_PATH, json=COMPLETION).status_code == 200
            big = {**COMPLETION, "prompt": "x" * 1000}
            error = assert_error(c.post(COMPLETION_PATH, json=big), 413, None, "request_too_large")
            assert "1000 bytes" in error["message"]


def test_openapi_documents_what_the_server_answers(http):
    schema = http.get("/openapi.json").json()
    for path in (CHAT_PATH, COMPLETION_PATH):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413"} <= responses.keys() and "422" not in responses
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
        assert "text/event-stream" in responses["200"]["content"]
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components
    assert components["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    prompt_branches = components["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt_branches
    assert all(b.get("minLength") == 1 or b.get("minItems") == 1 for b in prompt_branches)


def test_openapi_allows_no_response_format_the_server_refuses(http):
    """The document's response_format schema refuses what the server answers with a 400, and allows
    what it serves (checked with jsonschema, as a client generated from the document would)."""
    import jsonschema

    request = http.get("/openapi.json").json()["components"]["schemas"]["ChatCompletionRequest"]
    document = request["properties"]["response_format"]
    for refused in ({}, {"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(refused, document)
        assert http.post(CHAT_PATH, json={**CHAT, "response_format": refused}).status_code == 400
    for served in ({"type": "text"}, {"type": "json_object"}, None,
                   {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}):
        jsonschema.validate(served, document)
        assert http.post(CHAT_PATH, json={**CHAT, "response_format": served}).status_code == 200
    logit_bias = request["properties"]["logit_bias"]
    jsonschema.validate({"5": -100, "7": 2.5}, logit_bias)
    for refused in ({"x": 1}, {"5": 101}, {"5": "1"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(refused, logit_bias)


def test_logit_bias_is_honoured(client, engine):
    """A -100 ban on the greedy answer's first token changes the answer; +100 on one token forces it."""
    from verispec.sampling.params import SamplingParams

    prompt_ids = engine.tokenizer.encode("def f(x):", add_special_tokens=True)
    first = engine.generate_all(prompt_ids, SamplingParams(max_tokens=1, temperature=0)).token_ids[0]
    completion = dict(model=SERVED_NAME, prompt=prompt_ids, max_tokens=1, temperature=0, logprobs=0)
    plain = client.completions.create(**completion).choices[0].logprobs.tokens
    banned = client.completions.create(**completion, logit_bias={str(first): -100}).choices[0].logprobs.tokens
    assert plain == [engine.tokenizer.token_text(first)] and banned != plain
    forced = client.chat.completions.create(model=SERVED_NAME, messages=USER_MESSAGES, max_tokens=4, temperature=0,
                                            logit_bias={"300": 100}, logprobs=True, extra_body={"ignore_eos": True})
    assert [t.token for t in forced.choices[0].logprobs.content] == [engine.tokenizer.token_text(300)] * 4
