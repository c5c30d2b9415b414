"""Bad input answers OpenAI-style error JSON with a 4xx; engine crashes answer 500; serving goes on."""
from __future__ import annotations

import json

import openai
import pytest

from server_helpers import SERVED_NAME, USER_MESSAGES, sse_payloads

CHAT = {"model": SERVED_NAME, "messages": USER_MESSAGES, "max_tokens": 2}

BAD_CHAT_BODIES = [
    # (id, body, status, param, code)
    ("missing messages", {"model": SERVED_NAME}, 400, "messages", None),
    ("empty messages", {**CHAT, "messages": []}, 400, "messages", None),
    ("messages not a list", {**CHAT, "messages": "hello"}, 400, "messages", None),
    ("message without role", {**CHAT, "messages": [{"content": "hi"}]}, 400, "messages[0].role", None),
    ("unknown model", {**CHAT, "model": "no-such-model"}, 404, "model", "model_not_found"),
    ("negative temperature", {**CHAT, "temperature": -0.5}, 400, "temperature", None),
    ("temperature not a number", {**CHAT, "temperature": "hot"}, 400, "temperature", None),
    ("top_logprobs over 20", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("max_tokens beyond the context", {**CHAT, "max_tokens": 100_000}, 400, "max_tokens", "context_length_exceeded"),
    ("max_completion_tokens beyond the context", {**CHAT, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens", "context_length_exceeded"),
    ("max_tokens zero", {**CHAT, "max_tokens": 0}, 400, "max_tokens", None),
    ("max_completion_tokens zero", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("n above 16", {**CHAT, "n": 17}, 400, "n", None),
    ("n zero", {**CHAT, "n": 0}, 400, "n", None),
    ("stop of the wrong type", {**CHAT, "stop": 5}, 400, "stop", None),
    ("top_p of zero", {**CHAT, "top_p": 0}, 400, "top_p", None),
    ("image content part", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content", None),
]


def assert_error(response, status: int, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]
    assert error["param"] == param and error["code"] == code
    return error


@pytest.mark.parametrize("name,body,status,param,code", BAD_CHAT_BODIES, ids=[c[0] for c in BAD_CHAT_BODIES])
def test_bad_chat_request(http, name, body, status, param, code):
    error = assert_error(http.post("/v1/chat/completions", json=body), status, param, code)
    if name == "image content part":
        assert "image_url" in error["message"]
    if name == "temperature not a number":
        assert "temperature" in error["message"] and "hot" in error["message"]
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_bad_request_is_an_http_error_even_when_streaming(http, stream):
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "temperature": -1, "stream": stream}),
                 400, "temperature")
    assert_error(http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "x", "stream": stream,
                                                    "max_tokens": 5000}),
                 400, "max_tokens", "context_length_exceeded")


def test_malformed_json(http):
    for raw in ("{not json", '{"messages": [', ""):
        response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(response, 400)
    assert_error(http.post("/v1/chat/completions", json=[1, 2, 3]), 400)
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_json_body_without_content_type_is_415(http):
    """A page on any site may send a body without a content type and no CORS preflight: refused."""
    response = http.post("/v1/chat/completions", content=json.dumps(CHAT))
    assert_error(response, 415, code="unsupported_media_type")


def test_bad_completion_requests(http):
    base = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 2}
    assert_error(http.post("/v1/completions", json={**base, "logprobs": 21}), 400, "logprobs")
    assert_error(http.post("/v1/completions", json={**base, "prompt": ["a", "b"]}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={**base, "prompt": [10**9]}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={**base, "prompt": ""}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={**base, "prompt": [5] * 2000}), 400, "prompt",
                 "context_length_exceeded")
    assert_error(http.post("/v1/completions", json={**base, "prompt": {"a": 1}}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={"model": SERVED_NAME}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={**base, "n": -1}), 400, "n")
    assert_error(http.post("/v1/completions", json={**base, "model": "x"}), 404, "model", "model_not_found")
    assert http.post("/v1/completions", json=base).status_code == 200


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED_NAME, messages=USER_MESSAGES, temperature=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=USER_MESSAGES)
    assert info.value.body["code"] == "model_not_found"
    assert client.chat.completions.create(model=SERVED_NAME, messages=USER_MESSAGES, max_tokens=2).choices


# ---- crashes inside the engine ----------------------------------------------------------------

def crash_before_output(*args, **kwargs):  # in place of ModelRunner.prefill
    raise RuntimeError("simulated engine crash")


@pytest.mark.parametrize("stream", [False, True])
def test_engine_crash_is_500_then_serving_goes_on(http, engine, monkeypatch, stream):
    """A step that fails (here: the prompt's forward pass) fails its requests, and the engine goes on."""
    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "prefill", crash_before_output)
        error = assert_error(http.post("/v1/chat/completions", json={**CHAT, "stream": stream}), 500,
                             error_type="internal_error")
        assert "simulated engine crash" in error["message"]
    assert http.post("/v1/chat/completions", json={**CHAT, "stream": stream}).status_code == 200


def test_crash_mid_stream_sends_error_event_then_done(http, client, engine, monkeypatch):
    real_round = engine._round
    rounds = 0

    def crash_at_third_round(seqs, num_drafts):
        nonlocal rounds
        rounds += 1
        if rounds % 3 == 0:
            raise RuntimeError("simulated crash mid-stream")
        return real_round(seqs, num_drafts)

    body = {**CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True}
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_round", crash_at_third_round)
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            payloads = sse_payloads(r.iter_lines())
        assert payloads[-1] == "[DONE]"
        assert payloads[-2]["error"]["type"] == "internal_error"
        assert "simulated crash mid-stream" in payloads[-2]["error"]["message"]
        assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"

        with pytest.raises(openai.APIError, match="simulated crash mid-stream"):
            list(client.chat.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"}))
    good = client.chat.completions.create(model=SERVED_NAME, messages=USER_MESSAGES, max_tokens=3)
    assert good.usage.completion_tokens >= 1


def test_form_content_type_says_to_send_json(http):
    response = http.post("/v1/chat/completions", content=json.dumps(CHAT),
                         headers={"content-type": "application/x-www-form-urlencoded"})
    assert "Content-Type: application/json" in assert_error(response, 415, code="unsupported_media_type")["message"]
