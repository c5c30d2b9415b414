"""The `verispec` field of streamed chat choices, from a real speculating engine: its counts add up
to the engine's own statistics (accepted drafts, target passes, tokens)."""
from __future__ import annotations

import httpx

from tests.server.server_helpers import live_server, sse_payloads
from tests.spec.conftest import ReplayProposer, greedy, spec_engine
from verispec.server.app import create_app

MESSAGES = [{"role": "user", "content": "Write a function that parses arguments."}]


def test_stream_field_sums_to_the_engine_stats(targets):
    engine = targets["qwen3"]
    _, prompt = engine.tokenizer.chat_prompt_ids(MESSAGES)
    continuation = engine.generate_all(prompt, greedy(40)).token_ids
    # right on two positions of three: rounds accept 0, 1 or 2 of their 3 drafts
    proposer = ReplayProposer(continuation, engine.model.vocab_size, right_at=lambda j: j % 3 != 2)
    spec = spec_engine(engine, proposer, 3)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with live_server(create_app(spec, "m")) as server:
        info = httpx.get(server.url + "/v1/verispec/info").json()
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            payloads = sse_payloads(r.iter_lines())
    assert (info["method"], info["num_drafts"]) == ("replay", 3)
    fields = [p["choices"][0]["verispec"] for p in payloads[:-1] if p["choices"] and "verispec" in p["choices"][0]]
    stats = fields[-1]["stats"]
    assert sum(f["tokens"] for f in fields) == 40
    assert sum(f["drafted_tokens"] for f in fields) == stats["accepted"] > 0
    assert sum(f["rounds"] for f in fields) == stats["rounds"] < 39  # fewer passes than tokens: drafts landed
    assert all(0 <= f["drafted_tokens"] <= f["tokens"] for f in fields)
