"""The OpenAPI document, made to agree with what the server answers (schemathesis checks it):
every error status a route can give is listed with the error body's shape, 200s list both JSON
and server-sent events where a route streams, and FastAPI's default 422 is gone (this server
answers validation errors with 400, as OpenAI does)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionResponse(BaseModel):
    """A chat.completion or text_completion object (choices' fields differ by endpoint)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


def _errors(*statuses: int) -> dict:
    reasons = {400: "invalid request (a bad field, named in `param`)",
               401: "missing or wrong API key (with --api-key)",
               404: "unknown model", 413: "request body over --max-request-bytes",
               415: "a body sent without 'Content-Type: application/json'",
               499: "the client closed the connection (never read)",
               500: "internal error"}
    return {status: {"model": ErrorResponse, "description": reasons[status]} for status in statuses}


# One server-sent event, as a client (and schemathesis) parses it: `data` is a JSON chunk, the last
# event's data is `[DONE]`; `event` is the default "message"
SSE_CONTENT = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "description": "`data: {chunk}` events, then `data: [DONE]`",
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] last"},
                   "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}}}
GENERATION_RESPONSES: dict = {
    200: {"model": CompletionResponse, "content": SSE_CONTENT,
          "description": "the completion, or with stream: true its chunks as server-sent events"},
    **_errors(400, 401, 404, 413, 415, 500),
}
MODEL_RESPONSES: dict = _errors(401, 404)


def install_openapi(app: FastAPI) -> None:
    """Replace app.openapi with one that drops FastAPI's 422 and its validation-error schemas."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
