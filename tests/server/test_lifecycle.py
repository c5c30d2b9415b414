"""Client disconnects stop generation, the event loop stays free while the engine works, and
run_server prewarms before it listens."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from server_helpers import SERVED_NAME, USER_MESSAGES
from verispec.engine.types import FinishReason

LONG = {"model": SERVED_NAME, "prompt": "def main():", "max_tokens": 900, "ignore_eos": True,
        "temperature": 0}
STEP_DELAY_S = 0.01  # 900 slowed steps take 9 s or more: a generation that ends early was cancelled


def test_stream_closed_by_client_cancels_generation(server, http, spy):
    spy.step_delay_s = STEP_DELAY_S
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line]
            assert len(received) >= 2
    # Leaving the `with` closed the connection mid-stream.
    last = spy.wait_finished(timeout_s=5)
    assert last.finish_reason is FinishReason.CANCELLED
    assert last.stats.generated_tokens < LONG["max_tokens"]

    spy.step_delay_s = 0.0
    start = time.monotonic()
    next_one = http.post("/v1/completions", json={**LONG, "max_tokens": 3})
    assert next_one.status_code == 200 and time.monotonic() - start < 5


def test_non_stream_client_gone_cancels_generation(server, http, spy):
    spy.step_delay_s = STEP_DELAY_S
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=0.5)
    last = spy.wait_finished(timeout_s=5)
    assert last.finish_reason is FinishReason.CANCELLED
    spy.step_delay_s = 0.0
    assert http.post("/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200


def test_event_loop_free_while_generating(server, spy):
    spy.step_delay_s = STEP_DELAY_S
    first_line = threading.Event()

    def long_stream():
        with httpx.Client(base_url=server.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 200, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        first_line.set()

    worker = threading.Thread(target=long_stream)
    worker.start()
    assert first_line.wait(10)
    start = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 200
    assert time.monotonic() - start < 1.0
    assert not spy.finished  # the generation was still running meanwhile
    worker.join(30)
    assert spy.wait_finished().finish_reason is FinishReason.LENGTH


def test_concurrent_requests_are_served_one_after_another(server, spy):
    results = []

    def ask(i):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            results.append(c.post("/v1/chat/completions", json={
                "model": SERVED_NAME, "messages": USER_MESSAGES, "max_tokens": 4, "temperature": 0}).json())

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    texts = {r["choices"][0]["message"]["content"] for r in results}
    assert len(results) == 3 and len(texts) == 1  # same greedy answer each time: no state leaked


def test_run_server_prewarms_before_listening(monkeypatch, scripted_engine):
    from verispec.server import app as app_module

    calls = []
    monkeypatch.setattr(scripted_engine, "prewarm", lambda: calls.append("prewarm") or 0.01)
    monkeypatch.setattr(app_module.uvicorn.Server, "run", lambda self, *a, **kw: calls.append(
        ("listen", self.config.host, self.config.port, self.config.app.title)))
    app_module.run_server(scripted_engine, host="127.0.0.1", port=12345, api_key=None,
                          served_model_name="m", prewarm=True)
    assert calls == ["prewarm", ("listen", "127.0.0.1", 12345, "verispec")]

    calls.clear()
    app_module.run_server(scripted_engine, host="0.0.0.0", port=1, api_key="k", served_model_name=None,
                          prewarm=False)
    assert calls == [("listen", "0.0.0.0", 1, "verispec")]


def test_serve_max_request_bytes_flag(tiny_model_dir, monkeypatch, capsys):
    """`verispec serve --max-request-bytes N` reaches the app: a body over N bytes is a 413."""
    import asyncio
    import socket

    from verispec import cli
    from verispec.server import app as app_module

    served = []
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # serve leaves this process's threads
    monkeypatch.setattr(app_module.uvicorn.Server, "run", lambda self, *a, **kw: served.append(self.config.app))
    with socket.socket() as s:  # a port that is free now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["serve", "-m", str(tiny_model_dir), "--dtype", "float32", "--device", "cpu", "--no-prewarm",
            "--port", str(port)]
    assert cli.main([*argv, "--max-request-bytes", "0"]) == 2
    assert "--max-request-bytes must be >= 1" in capsys.readouterr().err
    assert cli.main([*argv, "--max-request-bytes", "300"]) == 0

    async def post(size: int) -> int:
        transport = httpx.ASGITransport(app=served[0])
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            body = {"model": SERVED_NAME, "prompt": "x" * size, "max_tokens": 1}
            return (await c.post("/v1/completions", json=body)).status_code

    assert asyncio.run(post(400)) == 413
    assert asyncio.run(post(10)) == 404  # under the cap: read and answered (the model name differs)
