"""Live-server fixtures: a tiny random model served by uvicorn on 127.0.0.1, driven by real clients.

Helpers live in server_helpers.py (importable by name from these tests under plain `pytest` too).
"""
from __future__ import annotations

from typing import Iterator

import httpx
import openai
import pytest

from server_helpers import SERVED_NAME, GenerationSpy, ScriptedEngine, live_server, openai_client
from verispec.engine.engine import load_engine
from verispec.loading.tokenizer import Tokenizer
from verispec.server.app import create_app


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tools.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-qwen3")
    build_tiny_model(path, "qwen3")
    return path


@pytest.fixture(scope="session")
def engine(tiny_model_dir):
    return load_engine(str(tiny_model_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def server(engine):
    with live_server(create_app(engine, SERVED_NAME)) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="session")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture
def spy(engine, monkeypatch):
    return GenerationSpy(engine).install(engine, monkeypatch)


@pytest.fixture(scope="session")
def scripted_engine(tiny_model_dir) -> ScriptedEngine:
    return ScriptedEngine(Tokenizer.from_dir(tiny_model_dir))


@pytest.fixture(scope="session")
def scripted_server(scripted_engine):
    with live_server(create_app(scripted_engine, "scripted", merge_chunks=False)) as srv:
        yield srv
