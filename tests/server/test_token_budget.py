"""A prompt that cannot fit the context is refused before it is tokenized in full: by its length, or
by counting tokens on bounded slices and stopping once the count passes the context. A counting
tokenizer shows how much text was tokenized before the 400."""
from __future__ import annotations

import pytest

from verispec.server.errors import APIError
from verispec.server.prepare import prepare_chat, prepare_completion
from verispec.server.schema import ChatCompletionRequest, CompletionRequest
from verispec.server.token_budget import TOKENS_PER_CUT_SLACK, PromptBudget, max_prompt_chars

EMOJI = "\U0001F600"  # four UTF-8 bytes: several tokens each in a byte-level vocabulary


class CountingHF:
    """A Hugging Face tokenizer that records the length of every text it encodes."""

    def __init__(self, hf):
        self._hf = hf
        self.encoded_chars: list[int] = []

    def encode(self, text, *args, **kwargs):
        self.encoded_chars.append(len(text))
        return self._hf.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._hf, name)


@pytest.fixture
def counting(engine, monkeypatch) -> CountingHF:
    counter = CountingHF(engine.tokenizer.hf)
    monkeypatch.setattr(engine.tokenizer, "hf", counter)
    return counter


def budget_of(engine) -> PromptBudget:
    return PromptBudget.for_tokenizer(engine.tokenizer, engine.max_model_len)


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_prompt_over_the_context_is_refused_after_bounded_tokenizing(engine, counting, endpoint):
    budget = budget_of(engine)
    prompt = EMOJI * (budget.max_chars - 200)  # passes the character gate: only counting can refuse it
    if endpoint == "completion":
        call, param = lambda: prepare_completion(CompletionRequest(prompt=prompt, max_tokens=1), engine, budget), "prompt"
    else:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": prompt}], max_tokens=1)
        call, param = lambda: prepare_chat(request, engine, budget), "messages"
    with pytest.raises(APIError) as refused:
        call()
    assert (refused.value.status_code, refused.value.param, refused.value.code) == (400, param, "context_length_exceeded")
    assert max(counting.encoded_chars) <= budget.slice_chars
    # refusing tokenizes the slices up to the one that passes the context: one, as an emoji is 4 tokens here
    assert sum(counting.encoded_chars) <= budget.slice_chars < len(prompt) // 10


def test_prompt_that_fits_is_tokenized_whole_once_counted(engine, counting):
    budget = budget_of(engine)
    prompt = "ab " * 400  # longer than a slice, fewer tokens than the context
    prepared = prepare_completion(CompletionRequest(prompt=prompt, max_tokens=1), engine, budget)
    assert prepared.prompt_ids == engine.tokenizer.encode(prompt, add_special_tokens=True)
    assert len(counting.encoded_chars) > 2 and counting.encoded_chars[-1] == len(prompt)


def test_character_gate_refuses_without_tokenizing(engine, counting):
    budget = budget_of(engine)
    with pytest.raises(APIError) as refused:
        budget.check("x" * (budget.max_chars + 1), engine.tokenizer.encode, "prompt")
    assert refused.value.code == "context_length_exceeded" and counting.encoded_chars == []


def test_character_gate_is_the_longest_token_times_the_context_without_a_normalizer(engine):
    hf = engine.tokenizer.hf
    longest = max(len(piece) for piece in hf.get_vocab())
    assert hf.backend_tokenizer.normalizer is None  # the tiny byte-level vocabulary
    assert max_prompt_chars(engine.tokenizer, 1000) == 1000 * longest


TEXTS = {
    "prose": "The quick brown fox jumps over the lazy dog, again and again. " * 400,
    "code": "def f(x):\n    return {'a': [x, x + 1]}  # note\n\n" * 400,
    "emoji": EMOJI * 9000,
    "cjk": "\u4e2d\u6587\u6587\u672c\u3002" * 3000,
    "combining marks": "e\u0301a\u0308 " * 4000,
    "spaces": "a" + " " * 20000 + "b" + "\n" * 5000,
    "digits": "1234567890" * 3000,
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_counting_in_slices_never_refuses_a_text_of_exactly_the_context(engine, name):
    """Slices may tokenize to a few more tokens than the whole text: the slack per cut covers it, so a
    prompt whose real count fits is never refused by the count."""
    text = TEXTS[name]
    whole = len(engine.tokenizer.encode(text))
    exact = PromptBudget(max_tokens=whole, max_chars=10**9)
    for slice_chars in (1024, 4000, exact.slice_chars):  # many cuts, and few
        assert exact.count_past_limit(text, engine.tokenizer.encode, slice_chars) is None
    over = PromptBudget(max_tokens=whole // 2, max_chars=10**9)
    assert over.count_past_limit(text, engine.tokenizer.encode, 1024) is not None


def test_slices_are_cut_before_whitespace(engine):
    seen: list[str] = []

    def encode(text):
        seen.append(text)
        return engine.tokenizer.encode(text)

    budget = PromptBudget(max_tokens=10**9, max_chars=10**9)
    text = "word " * 10000
    assert budget.count_past_limit(text, encode) is None
    assert "".join(seen) == text and all(piece.startswith(" ") for piece in seen[1:])
    assert TOKENS_PER_CUT_SLACK > 0
