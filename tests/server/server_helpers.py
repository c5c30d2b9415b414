"""Helpers for the server tests: a live uvicorn server, SSE parsing, engine doubles and spies."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Iterator

import httpx
import openai
import pytest
import uvicorn

from verispec.engine.types import FinishReason, GenerationChunk, GenerationStats
from verispec.loading.tokenizer import Tokenizer

SERVED_NAME = "test-org/tiny-qwen3"
USER_MESSAGES = [{"role": "user", "content": "Write a function that parses arguments."}]


class LiveServer:
    """uvicorn in a background thread on a socket bound before start (no port race)."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the live server did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


@contextlib.contextmanager
def live_server(app) -> Iterator[LiveServer]:
    server = LiveServer(app).start()
    try:
        yield server
    finally:
        server.stop()


def openai_client(server: LiveServer, api_key: str = "unused") -> openai.OpenAI:
    # No retries: a retried 500 would hide which request failed.
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def sse_payloads(lines: Iterator[str]) -> list:
    """Raw SSE lines -> the decoded `data:` payloads ("[DONE]" kept as a string)."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def pick_stop(text: str) -> str:
    """A 2-char stop string from the middle of the output: plain characters, not at the start."""
    for start in range(max(3, len(text) // 3), len(text) - 2):
        candidate = text[start:start + 2]
        if candidate.isprintable() and "\ufffd" not in candidate and text.find(candidate) >= 3:
            return candidate
    pytest.skip("the greedy output has no usable stop string")


def extra(obj, name: str):
    """A field the openai types do not declare (e.g. reasoning_content)."""
    return (obj.model_extra or {}).get(name)


class GenerationSpy:
    """Wraps engine.generate: records each generation's last chunk; `step_delay_s` slows every
    engine step (install() patches engine.step too) and every chunk handed to the server."""

    def __init__(self, engine, step_delay_s: float = 0.0):
        self.real_generate = engine.generate
        self.real_step = getattr(engine, "step", None)
        self.step_delay_s = step_delay_s
        self.finished: list[GenerationChunk] = []
        self.num_chunks: list[int] = []

    def install(self, engine, monkeypatch) -> "GenerationSpy":
        monkeypatch.setattr(engine, "generate", self.generate)
        if self.real_step is not None:
            monkeypatch.setattr(engine, "step", self.step)
        self.real_submit = getattr(engine, "submit", None)
        if self.real_submit is not None:  # the server hands requests to submit()
            monkeypatch.setattr(engine, "submit", self.submit)
        return self

    def submit(self, prompt_ids, params, sink, cancel=None):
        count = 0

        def spied(item):
            nonlocal count
            if not isinstance(item, BaseException):
                count += 1
                if item.finish_reason is not None:
                    self.finished.append(item)
                    self.num_chunks.append(count)
            sink(item)

        return self.real_submit(prompt_ids, params, spied, cancel)

    def step(self):
        time.sleep(self.step_delay_s)
        return self.real_step()

    def generate(self, prompt_ids, params, cancel=None):
        count = 0
        gen = self.real_generate(prompt_ids, params, cancel)
        try:
            for chunk in gen:
                count += 1
                if chunk.finish_reason is not None:
                    self.finished.append(chunk)
                    self.num_chunks.append(count)
                time.sleep(self.step_delay_s)
                yield chunk
        finally:
            gen.close()

    def wait_finished(self, count: int = 1, timeout_s: float = 10.0) -> GenerationChunk:
        deadline = time.monotonic() + timeout_s
        while len(self.finished) < count:
            assert time.monotonic() < deadline, "the generation did not finish in time"
            time.sleep(0.02)
        return self.finished[count - 1]


class ScriptedEngine:
    """An engine double that plays back chosen text pieces, one chunk per piece.

    It has the same surface the server uses (tokenizer, limits, checks, generate, prewarm), so
    tests can make the output split at exactly the awkward places they want.
    """

    model_name = "scripted"
    max_model_len = 1024

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pieces: list[str] = ["hello"]
        self.prewarmed = False

    def check_prompt_ids(self, prompt_ids: list[int]) -> None:
        pass

    def resolve_max_tokens(self, num_prompt_tokens: int, params) -> int:
        return params.max_tokens or 64

    def generate(self, prompt_ids, params, cancel=None):
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            stats = GenerationStats(prompt_tokens=len(prompt_ids), generated_tokens=len(self.pieces)) if last else None
            yield GenerationChunk([1], piece, None, FinishReason.STOP if last else None, stats)

    def prewarm(self) -> float:
        self.prewarmed = True
        return 0.0
