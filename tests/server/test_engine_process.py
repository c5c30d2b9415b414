"""The engine in its own process (engine/process.py): the same outputs as the engine in the
server's process, requests refused before they start, a client that leaves frees its blocks, and a
dead engine process fails its open requests instead of hanging them."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.server.server_helpers import engine_client_gaps, live_server, openai_client
from verispec.config import EngineConfig
from verispec.engine.client import EngineClient
from verispec.engine.engine import Engine
from verispec.sampling.params import SamplingParams
from verispec.engine.process import EngineProcess, EngineProcessError
from verispec.errors import EngineUnavailableError, InvalidRequestError, ModelNotFoundError
from verispec.server.app import create_app

MAX_TOKENS = 12


def engine_config(model_dir, **overrides) -> EngineConfig:
    fields = dict(model=str(model_dir), device="cpu", dtype="float32", kv_cache_gb=0.05, max_model_len=256,
                  prefix_cache=False, max_num_seqs=8)
    fields.update(overrides)
    return EngineConfig(**fields)


@pytest.fixture(scope="module")
def engine_process(qwen3_dir):
    engine = EngineProcess(engine_config(qwen3_dir))
    yield engine
    engine.close()


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 5 for j in range(3 + 5 * i)] for i in range(n)]


def test_outputs_equal_the_in_process_engine_under_concurrent_clients(engine_process, qwen3_dir):
    """6 clients at once through HTTP and the engine process == each prompt alone in this process."""
    local = Engine.load(engine_config(qwen3_dir))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [local.generate_all(p, greedy).text for p in prompts(6)]
    local.shutdown()
    with live_server(create_app(engine_process, "tiny")) as server:
        client = openai_client(server)

        def ask(prompt_ids):
            reply = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                              temperature=0.0, extra_body={"ignore_eos": True})
            return reply.choices[0]

        with ThreadPoolExecutor(6) as pool:
            choices = list(pool.map(ask, prompts(6)))
    assert [c.finish_reason for c in choices] == ["length"] * 6
    assert [c.text for c in choices] == expected
    assert all(expected)


def test_requests_that_cannot_fit_are_refused_at_submit(engine_process):
    with pytest.raises(InvalidRequestError, match="context length"):
        engine_process.submit([5] * 300, SamplingParams(max_tokens=4), lambda item: None)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine_process.submit([10 ** 9], SamplingParams(max_tokens=4), lambda item: None)
    with live_server(create_app(engine_process, "tiny")) as server:
        with pytest.raises(openai.BadRequestError):
            openai_client(server).completions.create(model="tiny", prompt=[5] * 300, max_tokens=4)
        ok = openai_client(server).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3,
                                                      temperature=0.0)
        assert ok.choices[0].finish_reason in ("length", "stop")


def test_cancel_returns_the_blocks(engine_process):
    """A request cancelled mid-generation (a client that left) frees every block it held."""
    assert engine_process.load_stats()["kv_blocks_used"] == 0
    first = threading.Event()
    items = []

    def sink(item):
        items.append(item)
        first.set()

    cancel = threading.Event()
    engine_process.submit(list(range(5, 105)), SamplingParams(max_tokens=140, temperature=0.0, ignore_eos=True),
                          sink, cancel)
    assert first.wait(60)
    held = engine_process.load_stats()["kv_blocks_used"]
    assert held > 0
    cancel.set()
    deadline = time.monotonic() + 60
    while engine_process.load_stats()["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_process.load_stats()["kv_blocks_used"] == 0
    assert engine_process.load_stats()["running"] == 0


def test_a_dead_engine_process_fails_its_requests(qwen3_dir):
    engine = EngineProcess(engine_config(qwen3_dir, max_model_len=8192, kv_cache_gb=0.2))
    try:
        started, ended = threading.Event(), threading.Event()
        items = []

        def sink(item):
            items.append(item)
            started.set()
            if isinstance(item, BaseException):
                ended.set()

        # long enough to be still running when the process is killed just after its first chunk
        engine.submit(list(range(5, 50)), SamplingParams(max_tokens=engine.max_model_len - 45, temperature=0.0,
                                                         ignore_eos=True), sink)
        assert started.wait(60)
        os.kill(engine.pid, signal.SIGKILL)
        assert ended.wait(30), "the open request was never told the engine died"
        assert isinstance(items[-1], EngineProcessError)
        with pytest.raises(EngineProcessError, match="engine process"):
            engine.submit([5, 6, 7], SamplingParams(max_tokens=4), lambda item: None)
    finally:
        engine.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float) -> httpx.Response:
    return httpx.get(url, timeout=timeout)


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_a_stopped_or_dead_engine_process_never_freezes_or_hides(qwen3_dir, monkeypatch):
    """`verispec serve --engine-process` (run_server): with the child stopped (SIGSTOP), /health and
    /metrics still answer (nothing on the event loop waits for the child); once it is killed,
    /health is a 503 naming why, a request a 503 OpenAI-style error, and the server stops with an
    error (the command exits non-zero) instead of hiding a dead engine."""
    from verispec.server import lifecycle
    from verispec.server.app import run_server

    monkeypatch.setattr(lifecycle, "ENGINE_DEATH_GRACE_S", 10.0)  # room for the checks below
    engine = EngineProcess(engine_config(qwen3_dir))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    outcome = {}

    def serve() -> None:
        try:
            run_server(engine, "127.0.0.1", port, None, "tiny", prewarm=False)
        except Exception as exc:  # noqa: BLE001 - what the command would report
            outcome["error"] = exc

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if get(url + "/health", 1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server never became healthy"
                time.sleep(0.1)

        os.kill(engine.pid, signal.SIGSTOP)
        try:
            assert get(url + "/health", 10).json() == {"status": "ok"}
            assert get(url + "/metrics", 20).status_code == 200  # the last load it knew, not a 30 s wait
            assert get(url + "/health", 10).status_code == 200
        finally:
            os.kill(engine.pid, signal.SIGCONT)

        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (health := get(url + "/health", 10)).status_code == 200:
            assert time.monotonic() < deadline, "/health still says ok after the engine died"
            time.sleep(0.05)
        assert health.status_code == 503
        error = health.json()["error"]
        assert error["code"] == "engine_unavailable" and "engine process exited" in error["message"]
        reply = httpx.post(url + "/v1/chat/completions", timeout=10,
                           json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable_error"
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server kept running without its engine"
        assert isinstance(outcome.get("error"), EngineUnavailableError)
    finally:
        engine.close()
        thread.join(timeout=30)


def test_a_loading_error_is_raised_in_the_parent(tmp_path):
    with pytest.raises(ModelNotFoundError):
        EngineProcess(engine_config(tmp_path / "no-such-model"))


@pytest.mark.parametrize("flag, device_type, expected", [
    ([], "cuda", "process"), ([], "cpu", "thread"),
    (["--engine-process"], "cpu", "process"), (["--no-engine-process"], "cuda", "thread")])
def test_serve_default_engine_process_by_device(tiny_model_dir, monkeypatch, flag, device_type, expected):
    """`verispec serve` runs the engine in its own process with CUDA (measured to pay there) and in
    the server's process on a CPU, unless told; the flag wins either way."""
    import socket

    from verispec import cli
    from verispec.demo import default as demo_default
    from verispec.engine import process as process_module
    from verispec.server import app as app_module

    built = []

    class FakeProcess:
        def __init__(self, config, while_loading=None):
            built.append("process")
            raise RuntimeError("stop here")  # the real one would spawn a child

    real_load = Engine.load

    def load(config):
        built.append("thread")
        return real_load(config)

    monkeypatch.setattr(process_module, "EngineProcess", FakeProcess)
    monkeypatch.setattr(Engine, "load", staticmethod(load))
    monkeypatch.setattr(demo_default, "default_device_type", lambda device: device_type)
    monkeypatch.setattr(app_module.uvicorn.Server, "run", lambda self, *a, **kw: None)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # serve leaves this process's threads
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["serve", "-m", str(tiny_model_dir), "--dtype", "float32", "--no-prewarm", "--port", str(port), *flag]
    if expected == "process":
        with pytest.raises(RuntimeError, match="stop here"):
            cli.main(argv)
    else:
        assert cli.main(argv) == 0
    assert built == [expected]


def test_the_child_names_the_device_so_the_server_never_starts_cuda(engine_process, monkeypatch):
    """The chat page's header names the GPU; with the engine in its own process that name comes from
    the child, so the server process never calls into CUDA (which would take a context's memory)."""
    from types import SimpleNamespace

    import torch

    from verispec.server.chat_page import describe_server

    assert engine_process.describe().device_name is None  # a CPU engine names no GPU
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: pytest.fail("the server asked CUDA"))
    monkeypatch.setattr(engine_process, "device", torch.device("cuda", 0))
    monkeypatch.setattr(engine_process, "device_name", "NVIDIA H200")
    assert engine_process.describe().device == "cuda:0"
    state = SimpleNamespace(engine=engine_process, served_model_name="m", system_fingerprint="fp")
    assert describe_server(state)["device_name"] == "NVIDIA H200"


def test_the_proxy_is_an_engine_client(engine_process):
    """Everything the server uses of an engine (engine/client.py), with the same parameters."""
    assert isinstance(engine_process, EngineClient)
    assert engine_client_gaps(engine_process) == []
    info = engine_process.describe()
    assert (info.method, info.num_drafts, info.device, info.dtype) == ("ar", 0, "cpu", "float32")
    assert "up to 8 sequences at once, context 256 tokens" in info.cache
    assert engine_process.default_seed is None and engine_process.load_stats()["running"] == 0


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_the_draft_policy_described_is_the_one_in_use_after_its_costs_are_measured(qwen3_dir):
    """--draft-costs measure times the passes at the child's first step (prewarm's generation): the
    proxy's description (GET /v1/verispec/info, the start-up log) then names the measured table."""
    engine = EngineProcess(engine_config(qwen3_dir, suffix=True, num_draft_tokens=2, draft_costs="measure"))
    try:
        assert "chosen per round by cost (analytic" in engine.describe().cache
        engine.prewarm()
        assert "chosen per round by cost (table (measured on cpu)" in engine.describe().cache
    finally:
        engine.close()
