"""<think> handling: the parser on every split of the text, and reasoning_content over HTTP."""
from __future__ import annotations

import itertools

import httpx
import pytest

from server_helpers import SERVED_NAME, USER_MESSAGES, extra, openai_client, sse_payloads
from verispec.server.reasoning import ReasoningDelta, ReasoningParser, split_reasoning

CASES = [
    # (text, starts_in_reasoning, expected reasoning, expected content)
    ("<think>abc</think>answer", False, "abc", "answer"),
    ("abc</think>answer", True, "abc", "answer"),
    ("no tags at all", False, "", "no tags at all"),
    ("a < b </thin", False, "", "a < b </thin"),
    ("still thinking <th", True, "still thinking <th", ""),
    ("<think>x</think>y<think>z</think>w", False, "xz", "yw"),
]


def feed_pieces(pieces: list[str], starts_in_reasoning: bool) -> tuple[str, str, list]:
    parser = ReasoningParser(starts_in_reasoning)
    deltas = [parser.feed(p) for p in pieces] + [parser.flush()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), deltas


@pytest.mark.parametrize("text,eager,reasoning,content", CASES)
def test_parser_on_every_two_and_three_way_split(text, eager, reasoning, content):
    assert split_reasoning(text, eager) == ReasoningDelta(reasoning, content)
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        pieces = [text[:i], text[i:j], text[j:]]
        got_reasoning, got_content, deltas = feed_pieces(pieces, eager)
        assert (got_reasoning, got_content) == (reasoning, content), pieces
        for d in deltas:  # a tag is never shown, whole or in part across a boundary
            assert "<think>" not in d.reasoning + d.content and "</think>" not in d.reasoning + d.content


def test_parser_one_character_at_a_time_holds_back_only_tag_prefixes():
    parser = ReasoningParser()
    shown = []
    for ch in "<think>ab</think>c":
        d = parser.feed(ch)
        shown.append((d.reasoning, d.content))
    # "a" and "b" are shown as soon as they arrive; only a possible tag start is held back.
    assert shown[7] == ("a", "") and shown[8] == ("b", "")
    assert shown[-1] == ("", "c")


# ---- over HTTP, with an engine that plays back chosen pieces --------------------------------

def stream_deltas(http, body) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        payloads = sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]"
    return [p["choices"][0]["delta"] for p in payloads[:-1] if p["choices"]]


@pytest.fixture
def scripted_http(scripted_server):
    with httpx.Client(base_url=scripted_server.url, timeout=30) as c:
        yield c


AWKWARD = ["<", "think", ">a", "bc<", "/th", "ink>", "ans", "wer"]


def test_reasoning_content_non_stream(scripted_engine, scripted_server):
    scripted_engine.pieces = AWKWARD
    out = openai_client(scripted_server).chat.completions.create(model="scripted", messages=USER_MESSAGES)
    message = out.choices[0].message
    assert extra(message, "reasoning_content") == "abc" and message.content == "answer"


def test_reasoning_content_stream_at_awkward_boundaries(scripted_engine, scripted_http):
    scripted_engine.pieces = AWKWARD
    deltas = stream_deltas(scripted_http, {"model": "scripted", "messages": USER_MESSAGES})
    assert deltas[0] == {"role": "assistant", "content": ""}
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    content = [d["content"] for d in deltas[1:] if "content" in d]
    assert "".join(reasoning) == "abc" and "".join(content) == "answer"
    kinds = ["r" if "reasoning_content" in d else "c" for d in deltas[1:] if d]
    assert kinds == sorted(kinds, reverse=True)  # all reasoning first, then content
    assert not any("<" in text or ">" in text for text in reasoning + content)


def test_eager_think_streams_reasoning_at_once(scripted_engine, scripted_server, scripted_http):
    # The template ends the prompt with "<think>\n": the very first piece is reasoning.
    scripted_engine.pieces = ["ab", "c</th", "ink>answer"]
    body = {"model": "scripted", "messages": USER_MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}
    deltas = stream_deltas(scripted_http, body)
    assert deltas[1] == {"reasoning_content": "ab"}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "abc"
    assert "".join(d.get("content", "") for d in deltas) == "answer"

    scripted_engine.pieces = ["ab", "c</th", "ink>answer"]
    out = openai_client(scripted_server).chat.completions.create(
        model="scripted", messages=USER_MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert extra(out.choices[0].message, "reasoning_content") == "abc"
    assert out.choices[0].message.content == "answer"


def test_completions_do_not_parse_reasoning(scripted_engine, scripted_server):
    scripted_engine.pieces = AWKWARD
    out = openai_client(scripted_server).completions.create(model="scripted", prompt="hi")
    assert out.choices[0].text == "".join(AWKWARD)


def test_eager_think_with_the_real_model(client, engine):
    """With enable_thinking the server reads the greedy output as reasoning from its first token."""
    thinking = {"enable_thinking": True}
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=USER_MESSAGES, temperature=0.0, max_tokens=12,
        extra_body={"ignore_eos": True, "chat_template_kwargs": thinking})
    prompt_text, prompt_ids = engine.tokenizer.chat_prompt_ids(USER_MESSAGES, thinking)
    assert prompt_text.endswith("<think>\n")
    # The same generation through the raw endpoint, which never splits.
    raw = client.completions.create(model=SERVED_NAME, prompt=prompt_ids, temperature=0.0, max_tokens=12,
                                    extra_body={"ignore_eos": True}).choices[0].text
    expected = split_reasoning(raw, starts_in_reasoning=True)
    message = chat.choices[0].message
    assert (extra(message, "reasoning_content") or "") == expected.reasoning
    assert message.content == expected.content
    assert expected.reasoning and raw.startswith(expected.reasoning)

    streamed = list(client.chat.completions.create(
        model=SERVED_NAME, messages=USER_MESSAGES, temperature=0.0, max_tokens=12, stream=True,
        extra_body={"ignore_eos": True, "chat_template_kwargs": thinking}))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert extra(deltas[1], "reasoning_content")  # reasoning from the first generated chunk
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == expected.reasoning
