"""Connections and shutdown (server/lifecycle.py, server/body_limit.py): idle and half-sent
connections are closed, a body that stops arriving is a 408, the app's shutdown closes an engine it
owns, the shutdown's wait for streams is bounded, and `serve` picks the CPU thread count for the host."""
from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
import torch
import uvicorn

from verispec.engine import cpu_threads
from verispec.server import body_limit, lifecycle
from verispec.server.app import create_app
from verispec.server.body_limit import BodyLimitMiddleware
from server_helpers import ScriptedEngine, live_server


@pytest.fixture
def timed_server(scripted_engine, monkeypatch):
    """The app under `verispec serve`'s uvicorn settings, with a short head deadline."""
    monkeypatch.setattr(lifecycle, "HEAD_TIMEOUT_S", 0.3)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    server = uvicorn.Server(lifecycle.uvicorn_config(create_app(scripted_engine, "m"), host, port))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    for _ in range(300):
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.TransportError:
            threading.Event().wait(0.05)
    yield host, port
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def closed_by_server(conn: socket.socket) -> bool:
    conn.settimeout(30)  # a bound on the test, not a timing assertion: the server closes long before
    try:
        while conn.recv(1024):  # what is left of an earlier response (its body may come apart), then the end
            pass
        return True
    except ConnectionResetError:  # closed with a reset (the server had unread bytes): closed all the same
        return True
    except socket.timeout:
        return False


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: localhost\r\n"], ids=["idle", "half-sent head"])
def test_connections_without_a_whole_request_head_are_closed(timed_server, sent):
    with socket.create_connection(timed_server) as conn:
        conn.sendall(sent)
        assert closed_by_server(conn)
    # the server keeps serving
    assert httpx.get("http://%s:%d/health" % timed_server, timeout=10).status_code == 200


def test_a_connection_half_sent_after_a_response_is_closed(timed_server):
    with socket.create_connection(timed_server) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        conn.settimeout(30)
        assert b"200 OK" in conn.recv(4096)
        conn.sendall(b"GET /health HTTP/1.1\r\n")  # uvicorn's keep-alive timer stops here
        assert closed_by_server(conn)


def test_a_body_that_stops_arriving_is_a_408(monkeypatch):
    monkeypatch.setattr(body_limit, "BODY_READ_TIMEOUT_S", 0.05)
    parts = [{"type": "http.request", "body": b'{"model": ', "more_body": True}]

    async def receive():
        if parts:
            return parts.pop()
        await asyncio.Event().wait()  # the client never sends the rest

    sent = []

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        pytest.fail("the app ran on a body that never arrived")

    scope = {"type": "http", "headers": [(b"content-type", b"application/json")], "method": "POST", "path": "/"}
    asyncio.run(BodyLimitMiddleware(app, 1 << 20)(scope, receive, send))
    assert sent[0]["status"] == 408
    assert b"request_timeout" in sent[1]["body"]


def test_shutdown_is_bounded_and_closes_an_owned_engine(scripted_engine, tiny_model_dir):
    config = lifecycle.uvicorn_config(create_app(scripted_engine, "m"), "127.0.0.1", 1)
    assert config.timeout_graceful_shutdown == lifecycle.SHUTDOWN_GRACE_S
    assert config.timeout_keep_alive == lifecycle.KEEP_ALIVE_S

    from verispec.loading.tokenizer import Tokenizer

    closed = []

    class Owned(ScriptedEngine):
        def close(self) -> None:
            closed.append(True)

    with live_server(create_app(Owned(Tokenizer.from_dir(tiny_model_dir)), "m", owns_engine=True)):
        pass
    assert closed == [True]
    with live_server(create_app(Owned(Tokenizer.from_dir(tiny_model_dir)), "m")):
        pass
    assert closed == [True]  # an engine the app was only lent stays open


def test_engine_watch_stops_the_server_once_the_engine_dies():
    class Dying:
        reason = None

        def failure(self):
            return self.reason

    engine, stopped = Dying(), threading.Event()
    watch = lifecycle.EngineWatch(engine, stopped.set, poll_s=0.01, grace_s=0)
    assert not watch.check()
    engine.reason = "the engine process exited (exit code -9)"
    watch.start()
    assert stopped.wait(30)
    assert watch.reason == engine.reason
    watch.close()


def test_serving_threads_leave_a_core_free_unless_told(monkeypatch):
    assert [cpu_threads.threads_for_host(n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # restored after the test, whatever set_serving_threads writes
    monkeypatch.setenv(cpu_threads.CHOSEN_BY_SERVE, "")  # (so is its mark)
    assert cpu_threads.set_serving_threads() is None and calls == []
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads.set_serving_threads() == 1 and calls == [1]
    import os

    assert os.environ["OMP_NUM_THREADS"] == "1"  # an engine process spawned next starts with it


def test_a_model_on_the_layer_kernel_serves_on_every_core_unless_the_user_chose(monkeypatch):
    import os

    threads = [4]
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.append(n))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads[-1])
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's: left alone
    monkeypatch.setenv(cpu_threads.CHOSEN_BY_SERVE, "")  # restored after the test, whatever serve writes
    assert cpu_threads.use_every_core_for_layer_kernel() is None and threads == [4]
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads.set_serving_threads() == 1  # serve's choice: one core left free ...
    assert cpu_threads.use_every_core_for_layer_kernel() == 2  # ... until the layer kernel runs the model
    assert threads[-1] == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    assert cpu_threads.use_every_core_for_layer_kernel() is None  # already every core
