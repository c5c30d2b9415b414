"""The FastAPI app around one engine, and `run_server` for the CLI."""
from __future__ import annotations

import sys
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from verispec import log
from verispec.engine.client import EngineClient
from verispec.errors import EngineUnavailableError
from verispec.server.auth import ApiKeyMiddleware
from verispec.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from verispec.server.bridge import EngineBridge
from verispec.server.chat_page import build_page_router
from verispec.server.engine_stats import EngineStatsReader
from verispec.server.errors import install_error_handlers
from verispec.server.input_checks import max_prompt_chars
from verispec.server.lifecycle import EngineWatch, close_engine, uvicorn_config
from verispec.server.metrics import MetricsMiddleware
from verispec.server.openapi import install_openapi
from verispec.server.routes import build_router
from verispec.server.schema import request_field_names
from verispec.server.state import ServerState


def create_app(engine: EngineClient, served_model_name: str | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, merge_chunks: bool = True,
               owns_engine: bool = False) -> FastAPI:
    """An OpenAI-compatible app serving `engine` as model `served_model_name` (default: engine.model_name).
    merge_chunks=False streams every engine chunk as its own delta even when they pile up (tests
    whose engine double scripts the chunk boundaries). owns_engine: the app's shutdown closes the
    engine (`verispec serve`: uvicorn re-raises SIGTERM after its shutdown, so code after it never runs)."""
    state = ServerState(engine, served_model_name or engine.model_name, EngineBridge(engine, merge_chunks),
                        max_prompt_chars(engine.tokenizer, engine.max_model_len), EngineStatsReader(engine))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.bridge.shutdown()
        state.engine_stats.shutdown()
        if owns_engine:
            await close_engine(engine)

    # strict_content_type=False: a JSON body without a Content-Type header (curl -d) is still JSON.
    app = FastAPI(title="verispec", lifespan=lifespan, strict_content_type=False)
    app.state.verispec = state
    install_error_handlers(app, request_field_names())
    app.include_router(build_router(state))
    app.include_router(build_page_router(state))
    install_openapi(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:  # outside the body limit: a client without the key is refused before any reading
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)  # outermost: counts 401s too
    return app


SWITCH_INTERVAL_S = 0.001


def run_server(engine: EngineClient, host: str, port: int, api_key: str | None, served_model_name: str | None,
               prewarm: bool, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    """Prewarm (so the first request pays no warm-up and /health means ready), then serve until
    stopped (server/lifecycle.py: connection timeouts, a bounded shutdown). Raises
    EngineUnavailableError when the engine died, so the command exits with an error."""
    # The engine's worker and the event loop share the GIL; a 1 ms switch interval (Python's default
    # is 5 ms) lets the loop answer, stream and accept between the worker's steps
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if prewarm:
        seconds = engine.prewarm()
        log.info("prewarm took %.2fs", seconds)
    app = create_app(engine, served_model_name, api_key, max_request_bytes, owns_engine=True)
    cache = engine.describe().cache
    if cache is not None:
        log.info("KV cache: %s", cache)
    log.info("serving %s at http://%s:%d/v1", served_model_name or engine.model_name, host, port)
    server = uvicorn.Server(uvicorn_config(app, host, port))
    watch = EngineWatch(engine, stop=lambda: setattr(server, "should_exit", True)).start()
    try:
        server.run()
    finally:
        watch.close()
        engine.close()  # also on a start-up failure, before the app's shutdown could
    if watch.reason is not None:
        raise EngineUnavailableError(f"{watch.reason}; the server stopped")
