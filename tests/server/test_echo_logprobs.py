"""/v1/completions with `echo` and `logprobs`: the prompt's tokens and their logprobs lead the
completion's (OpenAI's legacy API; lm-evaluation-harness `local-completions` scores loglikelihood
this way), checked with the official client against transformers' own log-softmax of the same
checkpoint's prompt logits."""
from __future__ import annotations

import math

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from server_helpers import SERVED_NAME

PROMPT = "def parse_args(argv):\n    parser = argparse."
GREEDY = dict(model=SERVED_NAME, temperature=0.0)
# the server's model runs in float32, the reference in float64
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def prompt_ids(engine) -> list[int]:
    return engine.tokenizer.encode(PROMPT, add_special_tokens=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompt_ids) -> torch.Tensor:
    """[P - 1, V]: log-probabilities of each next prompt token, from transformers in float64."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64)
    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[0, :-1].log_softmax(-1)


def check_prompt_part(lp, engine, prompt_ids, reference, top_n):
    """The first len(prompt_ids) entries are the prompt's tokens, scored as the reference scores them."""
    num = len(prompt_ids)
    assert lp.tokens[:num] == [engine.tokenizer.token_text(t) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for position, token_id in enumerate(prompt_ids[1:]):
        expected = float(reference[position, token_id])
        assert math.isclose(lp.token_logprobs[position + 1], expected, abs_tol=TOLERANCE)
        values, ids = reference[position].topk(top_n)
        # keyed by text, as OpenAI's format is: tokens of one text (partial UTF-8 bytes) share a key
        expected_top = {engine.tokenizer.token_text(i): v for i, v in zip(ids.tolist(), values.tolist())}
        assert lp.top_logprobs[position + 1] == pytest.approx(expected_top, abs=TOLERANCE)


def test_echo_with_logprobs_scores_the_prompt(client, engine, prompt_ids, reference):
    plain = client.completions.create(prompt=PROMPT, max_tokens=4, logprobs=2, extra_body={"ignore_eos": True},
                                      **GREEDY).choices[0]
    for _ in range(2):  # the second time the prompt is in the prefix cache: scoring computes it anyway
        out = client.completions.create(prompt=PROMPT, max_tokens=4, logprobs=2, echo=True,
                                        extra_body={"ignore_eos": True}, **GREEDY).choices[0]
        lp = out.logprobs
        assert out.text == PROMPT + plain.text == "".join(lp.tokens)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert len(lp.tokens) == len(prompt_ids) + 4
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        check_prompt_part(lp, engine, prompt_ids, reference, 2)
        num = len(prompt_ids)  # the completion's entries are those it has without echo
        assert lp.tokens[num:] == plain.logprobs.tokens
        assert lp.token_logprobs[num:] == plain.logprobs.token_logprobs


def test_max_tokens_zero_returns_the_prompt_alone(client, engine, prompt_ids, reference):
    out = client.completions.create(prompt=PROMPT, max_tokens=0, logprobs=1, echo=True, **GREEDY)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(prompt_ids)
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    check_prompt_part(choice.logprobs, engine, prompt_ids, reference, 1)


def test_loglikelihood_as_evaluation_harnesses_ask(client, engine, prompt_ids, reference):
    """lm-evaluation-harness local-completions: token ids, max_tokens 1, echo, logprobs 1; it sums
    token_logprobs[context:-1] and calls the continuation greedy when each is its row's best."""
    context = 5
    out = client.completions.create(prompt=prompt_ids, max_tokens=1, logprobs=1, echo=True, **GREEDY)
    lp = out.choices[0].logprobs
    continuation = lp.token_logprobs[context:-1]
    expected = [float(reference[p - 1, prompt_ids[p]]) for p in range(context, len(prompt_ids))]
    assert len(continuation) == len(expected)
    assert math.isclose(sum(continuation), sum(expected), abs_tol=TOLERANCE * len(expected))
    greedy = [float(reference[p - 1].max()) for p in range(context, len(prompt_ids))]
    assert [max(top.values()) for top in lp.top_logprobs[context:-1]] == pytest.approx(greedy, abs=TOLERANCE)


def test_streamed_prompt_logprobs_come_first(client, engine, prompt_ids, reference):
    kwargs = dict(prompt=PROMPT, max_tokens=4, logprobs=2, echo=True, extra_body={"ignore_eos": True}, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].text.startswith(PROMPT) and len(chunks[0].logprobs.tokens) >= len(prompt_ids)
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [c.logprobs for c in chunks if c.logprobs]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for s in streamed for v in getattr(s, key)] == getattr(whole.logprobs, key)
    zero = [c.choices[0] for c in client.completions.create(
        prompt=PROMPT, max_tokens=0, logprobs=1, echo=True, stream=True, **GREEDY) if c.choices]
    assert "".join(c.text for c in zero) == PROMPT and zero[-1].finish_reason == "length"
    check_prompt_part(zero[0].logprobs, engine, prompt_ids, reference, 1)


def test_every_choice_carries_the_prompt(client, engine, prompt_ids, reference):
    out = client.completions.create(prompt=PROMPT, max_tokens=3, logprobs=1, echo=True, n=2, seed=5,
                                    temperature=1.0, model=SERVED_NAME, extra_body={"best_of": 2})
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.text.startswith(PROMPT) and "".join(choice.logprobs.tokens[:len(prompt_ids)]) == PROMPT
        check_prompt_part(choice.logprobs, engine, prompt_ids, reference, 1)


@pytest.mark.parametrize("body, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=0, echo=True), "max_tokens"),
    (dict(max_tokens=0, logprobs=1), "max_tokens"),
    (dict(max_tokens=2, logprobs=1, echo=True, extra_body={"best_of": 3}), "best_of"),
    (dict(max_tokens=2, n=2, extra_body={"best_of": 1}), "best_of"),
])
def test_refused_combinations_name_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt=PROMPT, **GREEDY, **body)
    assert info.value.status_code == 400 and info.value.body["param"] == param
