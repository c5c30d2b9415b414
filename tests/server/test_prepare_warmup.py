"""`verispec serve` prepares one chat request before serving (server/prepare.py warm_up_preparation),
so the template's compile and the tokenizer's first calls are not the first client's."""
from __future__ import annotations

from verispec.errors import InvalidRequestError
from verispec.server import prepare
from verispec.server.token_budget import PromptBudget


def test_the_warm_up_prepares_a_real_chat_request(engine, monkeypatch):
    budget = PromptBudget.for_tokenizer(engine.tokenizer, engine.max_model_len)
    seen = []
    real = prepare.prepare_chat

    def spy(request, eng, bud):
        seen.append(real(request, eng, bud))
        return seen[-1]

    monkeypatch.setattr(prepare, "prepare_chat", spy)
    assert prepare.warm_up_preparation(engine, budget) >= 0
    assert len(seen) == 1 and seen[0].prompt_ids  # rendered and tokenized, through the server's own path
    assert seen[0].prompt_ids == real(prepare.ChatCompletionRequest(
        messages=[prepare.ChatMessage(role="user", content="Hello")], max_tokens=1), engine, budget).prompt_ids


def test_a_model_whose_template_cannot_render_it_still_serves(engine, monkeypatch):
    def refuse(*args):
        raise InvalidRequestError("this model has no chat template", param="messages")

    monkeypatch.setattr(prepare, "prepare_chat", refuse)
    budget = PromptBudget.for_tokenizer(engine.tokenizer, engine.max_model_len)
    assert prepare.warm_up_preparation(engine, budget) >= 0  # logged under VERISPEC_DEBUG=1, not raised
