"""/v1/chat/completions through the official openai client against the live server."""
from __future__ import annotations

import math
import re

from server_helpers import SERVED_NAME, USER_MESSAGES, pick_stop, sse_payloads

GREEDY = dict(model=SERVED_NAME, messages=USER_MESSAGES, temperature=0.0)


def stream_text(client, **kwargs) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_non_stream_shape_and_usage(client):
    out = client.chat.completions.create(max_tokens=8, **GREEDY)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]+", out.id)
    assert out.object == "chat.completion" and out.model == SERVED_NAME
    assert out.created > 0 and out.system_fingerprint
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 0 and 1 <= out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_stream_matches_non_stream(client):
    full = client.chat.completions.create(max_tokens=16, **GREEDY)
    text, chunks = stream_text(client, max_tokens=16, **GREEDY)
    assert text == full.choices[0].message.content
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_max_tokens_gives_length(client):
    out = client.chat.completions.create(max_tokens=5, extra_body={"ignore_eos": True}, **GREEDY)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    newer = client.chat.completions.create(max_completion_tokens=3, extra_body={"ignore_eos": True}, **GREEDY)
    assert newer.usage.completion_tokens == 3


def test_stop_string_cuts_before_match(client):
    kwargs = dict(max_tokens=24, extra_body={"ignore_eos": True}, **GREEDY)
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = pick_stop(text)
    expected = text[:text.find(stop)]

    out = client.chat.completions.create(stop=stop, **kwargs)
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason == "stop"

    streamed, chunks = stream_text(client, stop=[stop, "never-seen-stop"], **kwargs)
    assert streamed == expected  # nothing of the stop string leaked into any delta
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_include_usage(client, http):
    chunks = list(client.chat.completions.create(
        max_tokens=4, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and 1 <= last.usage.completion_tokens <= 4
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens

    # The raw stream: `data: {json}` events, "usage": null on each chunk, then [DONE].
    with http.stream("POST", "/v1/chat/completions", json={
            **GREEDY, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_no_usage_field_without_include_usage(http):
    with http.stream("POST", "/v1/chat/completions", json={**GREEDY, "max_tokens": 2, "stream": True}) as r:
        payloads = sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    assert all("usage" not in c for c in payloads[:-1])


def test_logprob_tokens_join_to_the_content(client, engine, monkeypatch):
    """The end token (EOS or a stop_token_ids entry) is left out of logprobs, as OpenAI leaves it out:
    the logprob tokens join to exactly the content."""
    plain = client.chat.completions.create(max_tokens=12, logprobs=True, **GREEDY).choices[0]
    tokens = [e.token for e in plain.logprobs.content]
    stop_id = engine.tokenizer.encode(tokens[4])[0]  # a token the greedy reply writes after some content
    kwargs = dict(max_tokens=12, logprobs=True, extra_body={"stop_token_ids": [stop_id]}, **GREEDY)
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.finish_reason == "stop" and out.message.content
    assert "".join(e.token for e in out.logprobs.content) == out.message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(streamed) == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == [e.token for e in out.logprobs.content]

    plain_logits = engine.model.logits
    eos = engine.tokenizer.eos_token_ids[0]

    def eos_first(hidden):  # a model whose first choice is end-of-sequence
        logits = plain_logits(hidden).clone()
        logits[..., eos] += 100.0
        return logits

    monkeypatch.setattr(engine.model, "logits", eos_first, raising=False)
    ended = client.chat.completions.create(max_tokens=12, logprobs=True, **GREEDY).choices[0]
    assert ended.finish_reason == "stop" and ended.message.content == "" and ended.logprobs.content == []


def test_logprobs_and_top_logprobs(client):
    out = client.chat.completions.create(max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        if "\ufffd" not in entry.token:  # a token that holds part of a character has no text of its own
            assert entry.bytes == list(entry.token.encode("utf-8"))
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)

    chunks = list(client.chat.completions.create(max_tokens=6, logprobs=True, top_logprobs=2, stream=True,
                                                 **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(len(e.top_logprobs) == 2 for e in streamed)

    plain = client.chat.completions.create(max_tokens=2, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(max_tokens=2, **GREEDY).choices[0].logprobs is None


def test_seed_reproducible_sampling(client):
    kwargs = dict(model=SERVED_NAME, messages=USER_MESSAGES, temperature=1.0, max_tokens=12,
                  extra_body={"ignore_eos": True})
    first = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    again = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    other = client.chat.completions.create(seed=99, **kwargs).choices[0].message.content
    assert first == again
    assert first != other  # 12 near-uniform draws from ~500 tokens do not collide by chance


def test_content_parts_and_short_model_name(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a function "},
                                          {"type": "text", "text": "that parses arguments."}]}]
    joined = client.chat.completions.create(model="tiny-qwen3", messages=parts, temperature=0.0, max_tokens=6)
    plain = client.chat.completions.create(max_tokens=6, **GREEDY)
    assert joined.choices[0].message.content == plain.choices[0].message.content
    assert joined.model == SERVED_NAME


def test_sampling_fields_accepted(client):
    out = client.chat.completions.create(
        max_tokens=4, temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.2, seed=3,
        user="someone", extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "unknown_field": 1},
        model=SERVED_NAME, messages=USER_MESSAGES)
    assert out.usage.completion_tokens >= 1


def test_null_optional_fields_mean_defaults(http):
    nulls = {name: None for name in ("max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                                     "stream_options", "logprobs", "top_logprobs", "user", "ignore_eos")}
    response = http.post("/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": USER_MESSAGES, **nulls, "max_completion_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None


def test_openapi_schema_renders(http):
    paths = http.get("/openapi.json").json()["paths"]
    assert "/v1/chat/completions" in paths and "/v1/completions" in paths


def test_logprob_bytes_rebuild_the_text(client):
    """Each token's `bytes` are its raw bytes, so they join to the response text even where a
    token holds only part of a UTF-8 character (its `token` text is then U+FFFD)."""
    out = client.chat.completions.create(max_tokens=24, logprobs=True, **GREEDY)
    joined = b"".join(bytes(e.bytes) for e in out.choices[0].logprobs.content)
    assert joined.decode("utf-8", errors="replace") == out.choices[0].message.content


def test_debug_log_splits_a_streamed_requests_first_token_time(client, monkeypatch):
    """Under VERISPEC_DEBUG=1 each request's first token logs where its time went on the server's
    side: reading it, preparing it, then the engine's queue to the event loop; the parts add up."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("verispec")
    logger.addHandler(handler)
    monkeypatch.setenv("VERISPEC_DEBUG", "1")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        stream_text(client, max_tokens=2, **GREEDY)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [r for r in records if r.startswith("first token")]
    assert len(lines) == 1, records
    total, reading, preparing, engine = map(float, re.findall(r"([0-9.]+) ms", lines[0]))
    assert 0 < reading < total and 0 < preparing < total and 0 < engine < total
    assert abs(reading + preparing + engine - total) < 0.2
