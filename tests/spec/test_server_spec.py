"""The server streams speculative output, and its text equals the non-speculative response."""
from __future__ import annotations

import httpx
import pytest

from tests.server.server_helpers import live_server, openai_client
from tests.spec.conftest import ReplayProposer, eagle3_proposer, greedy, spec_engine
from verispec.server.app import create_app

MESSAGES = [{"role": "user", "content": "Write a function that parses arguments."}]


@pytest.mark.parametrize("drafter", ["eagle3", "replay-partial"])
def test_streamed_speculative_text_equals_plain_response(targets, eagle3_dirs, drafter):
    engine = targets["qwen3"]
    _, prompt = engine.tokenizer.chat_prompt_ids(MESSAGES)
    if drafter == "eagle3":
        proposer = eagle3_proposer(engine, eagle3_dirs[("qwen3", "full")])
    else:
        cont = engine.generate_all(prompt, greedy(48)).token_ids
        proposer = ReplayProposer(cont, engine.model.vocab_size, right_at=lambda j: j % 3 != 2)
    spec = spec_engine(engine, proposer, 3)
    request = dict(model="m", messages=MESSAGES, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    with live_server(create_app(engine, "m")) as plain_server:
        plain = openai_client(plain_server).chat.completions.create(**request)
    with live_server(create_app(spec, "m")) as spec_server:
        client = openai_client(spec_server)
        stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request)
        chunks = list(stream)
        scraped = httpx.get(spec_server.url + "/metrics").text
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 48
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    if drafter == "replay-partial":
        # accepted drafts arrive together: fewer content chunks than tokens (one per verify round)
        assert len(content_chunks) < 48
    method = "eagle3" if drafter == "eagle3" else "replay"
    assert f'verispec_spec_drafted_tokens_total{{method="{method}"}}' in scraped
