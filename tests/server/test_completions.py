"""/v1/completions: text and token-id prompts, streaming, stop strings, legacy logprobs, echo."""
from __future__ import annotations

import math
import re

from server_helpers import SERVED_NAME, pick_stop, sse_payloads

PROMPT = "def parse_args(argv):\n    "
GREEDY = dict(model=SERVED_NAME, prompt=PROMPT, temperature=0.0)


def test_non_stream_shape(client):
    out = client.completions.create(max_tokens=6, **GREEDY)
    assert re.fullmatch(r"cmpl-[0-9a-f]+", out.id) and out.object == "text_completion"
    assert out.model == SERVED_NAME and out.system_fingerprint
    assert out.choices[0].finish_reason in ("stop", "length") and isinstance(out.choices[0].text, str)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_stream_matches_non_stream(client):
    full = client.completions.create(max_tokens=16, **GREEDY)
    chunks = list(client.completions.create(max_tokens=16, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "text_completion" for c in chunks)


def test_token_id_prompt_equals_text_prompt(client, engine):
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    by_ids = client.completions.create(model=SERVED_NAME, prompt=ids, temperature=0.0, max_tokens=8)
    by_text = client.completions.create(max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_max_tokens_and_stop(client):
    kwargs = dict(max_tokens=20, extra_body={"ignore_eos": True}, **GREEDY)
    out = client.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 20
    text = out.choices[0].text
    stop = pick_stop(text)
    cut = client.completions.create(stop=stop, **kwargs)
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stop=stop, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:text.find(stop)]


def test_legacy_logprobs(client):
    out = client.completions.create(max_tokens=5, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())
        best = max(top, key=top.get)  # greedy picked the most likely token
        assert best == token and math.isclose(top[best], value, abs_tol=1e-5)

    chunks = list(client.completions.create(max_tokens=5, logprobs=3, stream=True, **GREEDY))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_echo(client):
    plain = client.completions.create(max_tokens=4, **GREEDY)
    echoed = client.completions.create(max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_include_usage_raw(http):
    with http.stream("POST", "/v1/completions", json={
            **GREEDY, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}) as r:
        payloads = sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    assert all(c["usage"] is None for c in payloads[:-2])
    assert payloads[-2]["choices"] == [] and payloads[-2]["usage"]["completion_tokens"] >= 1
