"""`--api-key`: the OpenAI routes (/v1/*) need `Authorization: Bearer KEY`; /health and /metrics stay open.

A middleware rather than a route dependency, so the key is checked before the body is parsed
(a client without the key learns nothing from validation errors).
"""
from __future__ import annotations

import secrets

from verispec.server.errors import APIError

PROTECTED_PREFIX = "/v1"


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _is_protected(scope["path"]) and not self._authorized(scope):
            error = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return secrets.compare_digest(given, self._expected)


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
