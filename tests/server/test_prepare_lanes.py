"""A large request's tokenizing cannot hold up a small one's preparation: small bodies have a lane of
their own. Shown with events, not clocks: large work blocks until released, and the small request
must finish while it is still blocked (the guards only keep a broken build from hanging the run)."""
from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from server_helpers import SERVED_NAME, live_server
from verispec.server.app import create_app
from verispec.server.prepare_lanes import LARGE_BODY_BYTES, PrepareLanes

HANG_GUARD_S = 60
COMPLETION_PATH = "/v1/completions"
SMALL = {"model": SERVED_NAME, "prompt": "def f(x):", "max_tokens": 2}


class Gate:
    """Counts what the test waits for; blocks the large work until `release` is set."""

    def __init__(self):
        self.release = threading.Event()
        self._changed = threading.Condition()
        self.num_blocked = 0  # large work items waiting for the release
        self.num_entered = 0  # generation requests whose handler has started

    def block(self) -> None:
        with self._changed:
            self.num_blocked += 1
            self._changed.notify_all()
        self.release.wait(2 * HANG_GUARD_S)

    def enter(self) -> None:
        with self._changed:
            self.num_entered += 1
            self._changed.notify_all()

    def wait_until(self, predicate) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, HANG_GUARD_S)


def test_small_work_runs_while_large_work_waits():
    gate = Gate()

    def large(i: int) -> int:
        gate.block()
        return i

    async def scenario() -> None:
        lanes = PrepareLanes(large_body_bytes=100)
        try:
            larges = [asyncio.ensure_future(lanes.run(101, large, i)) for i in range(3)]
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, gate.wait_until, lambda: gate.num_blocked >= 1)
            assert await asyncio.wait_for(lanes.run(100, str.upper, "small"), HANG_GUARD_S) == "SMALL"
            assert not any(task.done() for task in larges)
            assert gate.num_blocked == 1  # large work shares one thread: the others wait their turn
        finally:
            gate.release.set()
        assert await asyncio.gather(*larges) == [0, 1, 2]
        lanes.shutdown()

    asyncio.run(scenario())


class BlockingHF:
    """A Hugging Face tokenizer that blocks on any text holding `marker` until the gate opens."""

    def __init__(self, hf, marker: str, gate: Gate):
        self._hf, self._marker, self._gate = hf, marker, gate

    def encode(self, text, *args, **kwargs):
        if self._marker in text:
            self._gate.block()
        return self._hf.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._hf, name)


def test_small_request_is_answered_while_two_large_prompts_tokenize(engine, monkeypatch):
    """Two large prompts stuck in tokenizing used to hold both preparation threads, so every other
    request waited for them; now a small request is prepared and answered meanwhile."""
    gate = Gate()
    monkeypatch.setattr(engine.tokenizer, "hf", BlockingHF(engine.tokenizer.hf, "BIG", gate))
    # "\u00e9" escapes make the body large while the prompt stays under the character gate
    large_body = json.dumps({"model": SERVED_NAME, "prompt": "BIG " + "\u00e9 " * 8000, "max_tokens": 1})
    assert len(large_body.encode()) > LARGE_BODY_BYTES
    with live_server(create_app(engine, SERVED_NAME)) as srv:
        failure = engine.failure
        monkeypatch.setattr(engine, "failure", lambda: (gate.enter(), failure())[1])  # each handler asks once

        def post_large() -> httpx.Response:
            return httpx.post(srv.url + COMPLETION_PATH, content=large_body, timeout=3 * HANG_GUARD_S,
                              headers={"content-type": "application/json"})

        with ThreadPoolExecutor(2) as pool:
            larges = [pool.submit(post_large) for _ in range(2)]
            try:
                assert gate.wait_until(lambda: gate.num_entered >= 2 and gate.num_blocked >= 1)
                small = httpx.post(srv.url + COMPLETION_PATH, json=SMALL, timeout=HANG_GUARD_S)
                assert small.status_code == 200, small.text
                assert not any(request.done() for request in larges)  # still tokenizing
            finally:
                gate.release.set()
            for request in larges:
                response = request.result()
                assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
        assert httpx.get(srv.url + "/health").status_code == 200
