"""The HTTP routes. Handlers close over the app's ServerState: there is no module-level state."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from verispec.server.chat import chat_completion
from verispec.server.completions import completion
from verispec.server.errors import as_api_error, engine_unavailable
from verispec.server.input_checks import reject_unpaired_surrogates
from verispec.server.openapi import GENERATION_RESPONSES, MODEL_RESPONSES, ModelCard, ModelList
from verispec.server.prepare import check_model
from verispec.server.schema import ChatCompletionRequest, CompletionRequest
from verispec.server.state import ServerState


CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
JSON_BODY_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH})  # the routes that read a JSON body


def build_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post(CHAT_PATH, responses=GENERATION_RESPONSES)
    async def create_chat_completion(request: Request, body: ChatCompletionRequest) -> Response:
        try:
            _check_engine_alive(state)  # before any tokenizing: a dead engine answers at once
            return await chat_completion(state, request, body)
        except Exception as exc:  # answered here so a crash is a 500 JSON, not a re-raised traceback
            return as_api_error(exc, " on /v1/chat/completions").response()

    @router.post(COMPLETIONS_PATH, responses=GENERATION_RESPONSES)
    async def create_completion(request: Request, body: CompletionRequest) -> Response:
        try:
            _check_engine_alive(state)
            return await completion(state, request, body)
        except Exception as exc:
            return as_api_error(exc, " on /v1/completions").response()

    @router.get("/v1/models", response_model=ModelList, responses=_only(MODEL_RESPONSES, 401))
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(state)]}

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=MODEL_RESPONSES)
    async def retrieve_model(model_id: str) -> Response:
        try:
            reject_unpaired_surrogates(model_id, "model")
            check_model(model_id, state.served_model_name)
        except Exception as exc:
            return as_api_error(exc).response()
        return JSONResponse(_model_card(state))

    @router.get("/health")
    async def health() -> Response:
        # The server only starts listening after prewarm, so answering at all means ready, unless
        # the engine has died since (its process killed): then 503, and the server is stopping.
        failure = state.engine.failure()
        if failure is not None:
            return engine_unavailable(failure).response()
        return JSONResponse({"status": "ok"})

    router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # what uptime monitors send

    @router.get("/metrics", response_class=PlainTextResponse,
                responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                 "description": "Prometheus text exposition format"}})
    async def metrics() -> Response:
        load = await state.engine_stats.read()
        if load is not None:
            state.metrics.observe_engine(load)
        description = state.engine.describe()
        state.metrics.numerics.labels(mode=description.numerics).set(1)
        state.metrics.kv_cache_dtype.labels(dtype=description.kv_cache_dtype).set(1)
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    return router


def _check_engine_alive(state: ServerState) -> None:
    failure = state.engine.failure()
    if failure is not None:
        raise engine_unavailable(failure)


def _only(responses: dict, *statuses: int) -> dict:
    return {status: responses[status] for status in statuses}


def _model_card(state: ServerState) -> dict:
    return {"id": state.served_model_name, "object": "model", "created": state.started_at,
            "owned_by": "verispec", "max_model_len": state.engine.max_model_len,
            "numerics": state.engine.describe().numerics}
