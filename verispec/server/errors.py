"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx.

Every failure a client can see goes through `APIError`, so the body shape is the same whether
the request was malformed JSON, a bad field, an unknown model or a crash inside the engine.
"""
from __future__ import annotations

import json
import traceback
from enum import Enum
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec import log
from verispec.errors import EngineUnavailableError, InvalidRequestError


class ErrorType(str, Enum):
    INVALID_REQUEST = "invalid_request_error"  # OpenAI uses this for 400, 401 and 404 alike
    INTERNAL = "internal_error"
    UNAVAILABLE = "service_unavailable_error"  # the engine died: the server is stopping


class APIError(Exception):
    def __init__(self, status_code: int, message: str, error_type: ErrorType = ErrorType.INVALID_REQUEST,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type.value,
                          "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return ErrorJSONResponse(self.body(), status_code=self.status_code, headers=headers)


class ErrorJSONResponse(JSONResponse):
    """ASCII-escaped JSON: an error message may quote client input that is not valid Unicode (a lone
    surrogate), which UTF-8 cannot encode; as a \\u escape it still makes a readable body."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


# Client text quoted in an error is cut to this: a 1 MB model name must not come back as a 1 MB 404.
MAX_QUOTED_CHARS = 100


def shorten(text: str | None, limit: int = MAX_QUOTED_CHARS) -> str | None:
    """Client text to quote in an error message, cut with a note of its full length."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine cannot run requests: {reason}; this server is stopping (restart it)",
                    ErrorType.UNAVAILABLE, code="engine_unavailable")


def model_not_found(requested: str, served: str) -> APIError:
    return APIError(404, f"the model '{shorten(requested)}' does not exist; this server serves '{served}'",
                    param="model", code="model_not_found")


def client_gone() -> APIError:
    # Nobody reads this: the client left and its generation was cancelled (499, as nginx logs it).
    return APIError(499, "the client closed the connection; the generation was cancelled")


def as_api_error(exc: BaseException, where: str = "") -> APIError:
    """Any exception from preparing or running a request -> the error the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineUnavailableError):
        return engine_unavailable(exc.message)
    if isinstance(exc, InvalidRequestError):
        log.debug("bad request%s: %s (param=%s)", where, exc.message, exc.param)
        return invalid_request(exc.message, param=exc.param, code=exc.code)
    # Anything else is our bug, not the client's: say so, and keep the traceback for the log.
    log.warning("internal error%s: %s", where, "".join(traceback.format_exception(exc)).rstrip())
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", ErrorType.INTERNAL)


# ---- pydantic validation errors -> one readable message ------------------------------------

def describe_validation_errors(errors: Iterable[dict[str, Any]], field_names: set[str]) -> APIError:
    """FastAPI's RequestValidationError list -> a 400 naming the first bad field.

    `field_names` are the request models' own field names: any other string in an error's
    location is a pydantic union-member tag (e.g. 'list[str]') and is left out of the path.
    """
    errors = list(errors)
    if not errors:
        return invalid_request("the request body is not valid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return invalid_request(f"the request body is not valid JSON: {reason} (at character {first['loc'][-1]})")
    path = _field_path(first["loc"], field_names)
    if not path:
        if isinstance(first.get("input"), bytes):  # FastAPI hands over raw bytes for non-JSON content types
            return invalid_request("the request body was not read as JSON: send it with "
                                   "'Content-Type: application/json'")
        return invalid_request("the request body must be a JSON object with the request's fields")
    if first.get("type") == "missing":
        return invalid_request(f"'{path}' is required", param=path)
    # A union reports one error per member type at the same path; list them all.
    reasons = []
    for err in errors:
        if _field_path(err["loc"], field_names) == path and err["msg"] not in reasons:
            reasons.append(err["msg"])
    got = repr(first.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return invalid_request(f"invalid '{path}': {'; or '.join(reasons)} (got {got})", param=path)


def _field_path(loc: Iterable[Any], field_names: set[str]) -> str:
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue  # FastAPI prefixes body fields with "body"
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in field_names:
            path += f".{part}" if path else part
    return path


# ---- handlers --------------------------------------------------------------------------------

def install_error_handlers(app: FastAPI, field_names: set[str]) -> None:
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = describe_validation_errors(exc.errors(), field_names)
        log.debug("bad request on %s: %s", request.url.path, error.message)
        return error.response()

    async def on_invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return as_api_error(exc, f" on {request.url.path}").response()

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods, in the same shape as every other error.
        # Keeps the exception's headers: a 405 says which methods the route takes (Allow).
        message = f"{exc.detail}: {shorten(request.method)} {shorten(request.url.path)}"
        return APIError(exc.status_code, message).response(headers=getattr(exc, "headers", None))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc, f" on {request.url.path}").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(InvalidRequestError, on_invalid_request)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
