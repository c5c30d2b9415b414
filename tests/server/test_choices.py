"""`n` > 1 through the official openai client: n choices of one prompt, each its own sequence in the
engine's batch; with a seed, choice i samples exactly as a lone request with seed + i would."""
from __future__ import annotations

import openai
import pytest

from server_helpers import SERVED_NAME, USER_MESSAGES

CHAT = dict(model=SERVED_NAME, messages=USER_MESSAGES, extra_body={"ignore_eos": True})
PROMPT = "def parse_args(argv):\n    "
SAMPLED = dict(temperature=1.0, max_tokens=10)


def chat_text(client, **kwargs) -> list[str]:
    out = client.chat.completions.create(**CHAT, **kwargs)
    assert [c.index for c in out.choices] == list(range(len(out.choices)))
    return [c.message.content for c in out.choices]


def streamed_choices(chunks, field) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (field(choice) or "")
    return texts


def test_greedy_choices_equal_the_single_answer_and_usage_sums(client, spy):
    single = client.chat.completions.create(**CHAT, temperature=0.0, max_tokens=6)
    num_before = len(spy.finished)
    many = client.chat.completions.create(**CHAT, temperature=0.0, max_tokens=6, n=3)
    assert len(spy.finished) - num_before == 3  # three sequences went through the engine
    assert [c.message.content for c in many.choices] == [single.choices[0].message.content] * 3
    assert all(c.finish_reason == "length" for c in many.choices)
    assert many.usage.prompt_tokens == single.usage.prompt_tokens  # the shared prompt counts once
    assert many.usage.completion_tokens == 3 * single.usage.completion_tokens == 18
    assert many.usage.total_tokens == many.usage.prompt_tokens + many.usage.completion_tokens


def test_seeded_choice_i_equals_a_lone_request_with_seed_plus_i(client):
    many = chat_text(client, n=4, seed=500, **SAMPLED)
    alone = [chat_text(client, seed=500 + i, **SAMPLED)[0] for i in range(4)]
    assert many == alone
    assert len(set(many)) == 4  # 10 near-uniform draws each: distinct choices, not copies
    assert chat_text(client, n=4, seed=500, **SAMPLED) == many  # reproducible


def test_streamed_choices_carry_their_index(client):
    expected = chat_text(client, n=3, seed=7, **SAMPLED)
    chunks = list(client.chat.completions.create(**CHAT, n=3, seed=7, stream=True,
                                                 stream_options={"include_usage": True}, **SAMPLED))
    assert streamed_choices(chunks, lambda c: c.delta.content) == dict(enumerate(expected))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert sorted(roles) == [0, 1, 2] and finishes == [0, 1, 2]
    assert all(len(c.choices) <= 1 for c in chunks)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 3 * SAMPLED["max_tokens"]
    single = client.chat.completions.create(**CHAT, max_tokens=1)
    assert usage.prompt_tokens == single.usage.prompt_tokens


def test_completions_choices_stream_and_logprobs(client):
    kwargs = dict(model=SERVED_NAME, prompt=PROMPT, seed=11, logprobs=2, extra_body={"ignore_eos": True},
                  **SAMPLED)
    out = client.completions.create(n=2, **kwargs)
    assert [c.index for c in out.choices] == [0, 1]
    alone = [client.completions.create(**{**kwargs, "seed": 11 + i}).choices[0] for i in range(2)]
    assert [c.text for c in out.choices] == [a.text for a in alone]
    assert [c.logprobs.tokens for c in out.choices] == [a.logprobs.tokens for a in alone]
    assert out.usage.completion_tokens == 2 * SAMPLED["max_tokens"]

    chunks = list(client.completions.create(n=2, stream=True, **kwargs))
    assert streamed_choices(chunks, lambda c: c.text) == {0: out.choices[0].text, 1: out.choices[1].text}
    offsets = {0: [], 1: []}
    for chunk in chunks:
        for c in chunk.choices:
            offsets[c.index] += c.logprobs.text_offset if c.logprobs else []
    assert [offsets[0], offsets[1]] == [c.logprobs.text_offset for c in out.choices]  # per-choice offsets


def test_echo_is_sent_for_every_choice(client):
    out = client.completions.create(model=SERVED_NAME, prompt=PROMPT, n=2, echo=True, max_tokens=3)
    assert all(c.text.startswith(PROMPT) for c in out.choices)
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=PROMPT, n=2, echo=True, max_tokens=3,
                                            stream=True))
    assert streamed_choices(chunks, lambda c: c.text).keys() == {0, 1}
    assert all(text.startswith(PROMPT) for text in streamed_choices(chunks, lambda c: c.text).values())


@pytest.mark.parametrize("n,seed", [(0, None), (17, None), (3, 2**64 - 2)])
def test_bad_n_or_seed_range(client, n, seed):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**CHAT, n=n, seed=seed, max_tokens=2)
    assert info.value.body["param"] == ("seed" if seed else "n")
    assert client.chat.completions.create(**CHAT, n=2, seed=2**64 - 2, max_tokens=2).choices


def test_client_leaving_cancels_every_choice(server, http, spy):
    """One choice finishing must not stop the others, but a client leaving stops them all."""
    spy.step_delay_s = 0.01  # 600 slowed steps take 6 s or more: a choice that ends early was cancelled
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 600, "ignore_eos": True, "n": 3,
            "stream": True, "temperature": 0}
    num_before = len(spy.finished)
    with http.stream("POST", "/v1/completions", json=body) as r:
        received = [line for line, _ in zip(r.iter_lines(), range(8)) if line]
        assert len(received) >= 3
    spy.wait_finished(num_before + 3, timeout_s=10)
    last = spy.finished[num_before:]
    assert [c.finish_reason.value for c in last] == ["cancelled"] * 3
    assert all(c.stats.generated_tokens < 600 for c in last)


def test_server_default_seed_gives_distinct_choices(client, engine, monkeypatch):
    """With `--seed S` and no request seed, choice i samples with S + i, not n copies of S."""
    from dataclasses import replace

    monkeypatch.setattr(engine, "config", replace(engine.config, seed=42))
    many = chat_text(client, n=3, **SAMPLED)
    assert many == [chat_text(client, seed=42 + i, **SAMPLED)[0] for i in range(3)]
    assert len(set(many)) == 3
    assert chat_text(client, **SAMPLED) == many[:1]  # one choice: the default seed as before
