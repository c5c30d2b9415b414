"""The EngineClient protocol (verispec/engine/client.py): the in-process engine and the server tests'
doubles have every member the server uses, with the protocol's parameters. The engine in its own
process is checked in test_engine_process.py (its fixture starts the process)."""
from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from paced_engine import PacedEngine
from server_helpers import USER_MESSAGES, EngineDouble, ScriptedEngine, engine_client_gaps, sse_payloads
from verispec.engine.client import EngineClient, EngineDescription
from verispec.engine.engine import Engine
from verispec.loading.tokenizer import Tokenizer

MEMBERS = ["tokenizer", "model_name", "max_model_len", "vocab_size", "grammars", "default_seed", "describe",
           "check_prompt_ids", "resolve_max_tokens", "submit", "load_stats", "failure", "prewarm", "shutdown",
           "close"]


def test_the_protocol_names_what_the_server_uses():
    """A change to the protocol is a change to what every engine and double must have: made on purpose."""
    assert sorted(g.split(":")[0] for g in engine_client_gaps(SimpleNamespace())) == sorted(MEMBERS)


def test_the_in_process_engine_is_an_engine_client(engine):
    assert isinstance(engine, Engine) and isinstance(engine, EngineClient)
    assert engine_client_gaps(engine) == []
    info = engine.describe()
    assert isinstance(info, EngineDescription)
    assert (info.method, info.num_drafts, info.device, info.device_name, info.dtype) == ("ar", 0, "cpu", None,
                                                                                        "float32")
    assert info.cache is not None and f"context {engine.max_model_len} tokens" in info.cache
    assert engine.default_seed == engine.config.seed and engine.vocab_size == engine.model.vocab_size


@pytest.mark.parametrize("make", [ScriptedEngine, lambda tok: PacedEngine(tok, method="eagle3", num_drafts=3),
                                  lambda tok: PacedEngine(tok, method="ar")], ids=["scripted", "paced", "paced-ar"])
def test_the_doubles_are_engine_clients(tiny_model_dir, make):
    double = make(Tokenizer.from_dir(tiny_model_dir))
    assert isinstance(double, EngineDouble) and isinstance(double, EngineClient)
    assert engine_client_gaps(double) == []
    assert isinstance(double.describe(), EngineDescription)


def test_the_check_sees_a_wrong_signature(tiny_model_dir):
    class OldDouble(ScriptedEngine):
        def submit(self, prompt_ids, params):  # no sink: the server could not use it
            raise NotImplementedError

    gaps = engine_client_gaps(OldDouble(Tokenizer.from_dir(tiny_model_dir)))
    assert len(gaps) == 1 and gaps[0].startswith("submit: parameters")


def test_a_double_served_without_merging_streams_one_delta_per_piece(scripted_engine, scripted_server, monkeypatch):
    """The doubles' submit hands over every piece at once; merge_chunks=False (conftest's scripted
    server) keeps them apart, so tests of awkward boundaries see exactly those boundaries."""
    monkeypatch.setattr(scripted_engine, "pieces", ["one", " two", " three", "!"] * 5)
    request = {"model": "scripted", "messages": USER_MESSAGES, "stream": True}
    with httpx.stream("POST", scripted_server.url + "/v1/chat/completions", json=request, timeout=30) as r:
        payloads = sse_payloads(r.iter_lines())
    deltas = [p["choices"][0]["delta"] for p in payloads[:-1] if p["choices"]]
    assert [d["content"] for d in deltas[1:] if d.get("content")] == scripted_engine.pieces
