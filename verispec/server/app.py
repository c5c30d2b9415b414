"""The FastAPI app around one engine, and `run_server` for the CLI."""
from __future__ import annotations

import sys
from contextlib import asynccontextmanager
from typing import Sequence

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from verispec import log
from verispec.engine.client import EngineClient
from verispec.errors import EngineUnavailableError
from verispec.server.auth import ApiKeyMiddleware
from verispec.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from verispec.server.bridge import EngineBridge
from verispec.server.chat_page import build_page_router
from verispec.server.content_type import JsonContentTypeMiddleware
from verispec.server.engine_stats import EngineStatsReader
from verispec.server.errors import install_error_handlers
from verispec.server.host_check import HostCheckMiddleware, HostPolicy
from verispec.server.lifecycle import EngineWatch, close_engine, uvicorn_config
from verispec.server.metrics import MetricsMiddleware
from verispec.server.openapi import install_openapi
from verispec.server.routes import JSON_BODY_PATHS, build_router
from verispec.server.schema import request_field_names
from verispec.server.prepare import warm_up_preparation
from verispec.server.state import ServerState
from verispec.server.token_budget import PromptBudget


def create_app(engine: EngineClient, served_model_name: str | None = None, api_key: str | list[str] | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, merge_chunks: bool = True,
               bind_host: str = "127.0.0.1", allowed_hosts: Sequence[str] = (),
               cors_origins: Sequence[str] = (), owns_engine: bool = False) -> FastAPI:
    """An OpenAI-compatible app serving `engine` as model `served_model_name` (default: engine.model_name).
    api_key: one key or several (each client its own; the prefix cache is shared per key).
    bind_host, allowed_hosts: the Host names answered (server/host_check.py); cors_origins: the
    origins whose pages may call the API from a browser (none: CORS off).
    merge_chunks=False streams every engine chunk as its own delta even when they pile up (tests
    whose engine double scripts the chunk boundaries). owns_engine: the app's shutdown closes the
    engine (`verispec serve`: uvicorn re-raises SIGTERM after its shutdown, so code after it never runs)."""
    state = ServerState(engine, served_model_name or engine.model_name, EngineBridge(engine, merge_chunks),
                        PromptBudget.for_tokenizer(engine.tokenizer, engine.max_model_len), EngineStatsReader(engine))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.bridge.shutdown()
        state.engine_stats.shutdown()
        if owns_engine:
            await close_engine(engine)

    # No /docs or /redoc: FastAPI's pages load Swagger UI from a CDN (broken offline, and a third
    # party's script on this origin); the document itself is /openapi.json.
    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.verispec = state
    install_error_handlers(app, request_field_names())
    app.include_router(build_router(state))
    app.include_router(build_page_router(state))
    install_openapi(app)
    # Added innermost first. A request passes: metrics, Host, CORS, API key, content type, body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.add_middleware(JsonContentTypeMiddleware, json_paths=JSON_BODY_PATHS)
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if api_keys:  # outside the body limit: a client without the key is refused before any reading
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
    if cors_origins:  # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    app.add_middleware(HostCheckMiddleware, policy=HostPolicy(bind_host, tuple(allowed_hosts)))
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)  # outermost: counts 401s too
    return app


SWITCH_INTERVAL_S = 0.001


def run_server(engine: EngineClient, host: str, port: int, api_key: str | list[str] | None, served_model_name: str | None,
               prewarm: bool, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, allowed_hosts: Sequence[str] = (),
               cors_origins: Sequence[str] = ()) -> None:
    """Prewarm (so the first request pays no warm-up and /health means ready), then serve until
    stopped (server/lifecycle.py: connection timeouts, a bounded shutdown). Raises
    EngineUnavailableError when the engine died, so the command exits with an error."""
    # The engine's worker and the event loop share the GIL; a 1 ms switch interval (Python's default
    # is 5 ms) lets the loop answer, stream and accept between the worker's steps
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if prewarm:
        log.startup_phase("prewarm", engine.prewarm())
    app = create_app(engine, served_model_name, api_key, max_request_bytes, bind_host=host,
                     allowed_hosts=allowed_hosts, cors_origins=cors_origins, owns_engine=True)
    if prewarm:
        log.startup_phase("a first request's template and tokenizer",
                          warm_up_preparation(engine, app.state.verispec.prompt_budget))
    cache = engine.describe().cache
    if cache is not None:
        log.info("KV cache: %s", cache)
    log.info("serving %s at http://%s:%d/v1", served_model_name or engine.model_name, host, port)
    # the whole start, from the `verispec serve` command to answering (the phases logged above add up to it)
    log.info("start-up: ready in %.1fs since the process started", log.process_age_s())
    server = uvicorn.Server(uvicorn_config(app, host, port))
    watch = EngineWatch(engine, stop=lambda: setattr(server, "should_exit", True)).start()
    try:
        server.run()
    finally:
        watch.close()
        engine.close()  # also on a start-up failure, before the app's shutdown could
    if watch.reason is not None:
        raise EngineUnavailableError(f"{watch.reason}; the server stopped")
