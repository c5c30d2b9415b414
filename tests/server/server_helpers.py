"""Helpers for the server tests: a live uvicorn server, SSE parsing, engine doubles and spies."""
from __future__ import annotations

import contextlib
import inspect
import json
import socket
import threading
import time
from typing import Iterator

import httpx
import openai
import pytest
import torch
import uvicorn

from verispec.engine.client import EngineClient, EngineDescription
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


def engine_client_gaps(engine) -> list[str]:
    """What `engine` lacks of the EngineClient protocol: members that are missing, and methods whose
    parameters (names, kinds, which have defaults) differ from the protocol's. [] when it has it all."""
    gaps = []
    for name, member in vars(EngineClient).items():
        if name.startswith("_"):
            continue
        if not hasattr(engine, name):
            gaps.append(f"{name}: missing")
        elif not isinstance(member, property):
            expected = _parameters(member)[1:]  # without self: the engine's is a bound method
            actual = _parameters(getattr(engine, name))
            if actual != expected:
                gaps.append(f"{name}: parameters {actual}, the protocol's {expected}")
    return gaps


def _parameters(fn) -> list[tuple]:
    return [(p.name, p.kind.name, p.default is inspect.Parameter.empty)
            for p in inspect.signature(fn).parameters.values()]


class AnyGrammar:
    """A double's grammar library: accepts every grammar (the real one is llguidance's)."""

    def check(self, spec) -> None:
        pass


class EngineDouble:
    """The whole EngineClient surface (verispec/engine/client.py) for engine doubles: a subclass
    writes `generate` (its chunks in order, the last with a finish_reason) and `submit` plays it on
    a thread of its own, as the real engine's worker hands chunks to sinks. Serve a double with
    create_app(..., merge_chunks=False) to keep the chunk boundaries it scripts."""

    model_name = "double"
    max_model_len = 1024
    default_seed: int | None = None
    grammars = AnyGrammar()
    # what describe() reports (the chat page's header)
    method = "ar"
    num_drafts = 0
    device = torch.device("cpu")
    dtype: torch.dtype | None = None

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def describe(self) -> EngineDescription:
        return EngineDescription(self.method, self.num_drafts, str(self.device), None,
                                 str(self.dtype).removeprefix("torch.") if self.dtype is not None else None)

    def check_prompt_ids(self, prompt_ids: list[int]) -> None:
        pass

    def resolve_max_tokens(self, num_prompt_tokens: int, params) -> int:
        return params.max_tokens or 64

    def generate(self, prompt_ids, params, cancel=None) -> Iterator[GenerationChunk]:
        raise NotImplementedError

    def submit(self, prompt_ids, params, sink, cancel=None) -> threading.Thread:
        self.check_prompt_ids(prompt_ids)
        self.resolve_max_tokens(len(prompt_ids), params)
        cancel = cancel or threading.Event()

        def play() -> None:
            try:
                for chunk in self.generate(prompt_ids, params, cancel):
                    sink(chunk)
                    if chunk.finish_reason is not None:
                        return
                sink(RuntimeError(f"{type(self).__name__}.generate ended without a finish_reason"))
            except BaseException as exc:  # noqa: BLE001 - the request's error, as the engine hands it on
                sink(exc)

        thread = threading.Thread(target=play, name="engine-double", daemon=True)
        thread.start()
        return thread

    def load_stats(self) -> dict:
        return {"running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 0, "preemptions": 0,
                "drafts": None, "prefix_cache": None}

    def prewarm(self) -> float:
        return 0.0

    def failure(self) -> str | None:
        return None

    def shutdown(self) -> None:
        pass

    def close(self) -> None:
        pass


class ScriptedEngine(EngineDouble):
    """An engine double that plays back chosen text pieces, one chunk per piece, so tests can make
    the output split at exactly the awkward places they want (served with merge_chunks=False)."""

    model_name = "scripted"

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer)
        self.pieces: list[str] = ["hello"]
        self.prewarmed = False

    def generate(self, prompt_ids, params, cancel=None):
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            stats = GenerationStats(prompt_tokens=len(prompt_ids), generated_tokens=len(self.pieces)) if last else None
            yield GenerationChunk([1], piece, None, FinishReason.STOP if last else None, stats)

    def prewarm(self) -> float:
        self.prewarmed = True
        return 0.0
