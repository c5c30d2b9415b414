"""`--api-key` (one or more): every route but the chat page, its static files and /health needs
`Authorization: Bearer KEY` (the scheme in any case, as RFC 9110 allows).

A middleware rather than a route dependency, so the key is checked before the body is parsed
(a client without the key learns nothing from validation errors). The key a request matched is
recorded in its ASGI scope as an opaque id: the prefix cache is shared only between requests of
one key (server/cache_scope.py).
"""
from __future__ import annotations

import hashlib
import secrets

from verispec.server.errors import APIError

# Open without a key: the page and its assets hold no data (the page asks for the key), and
# /health is what load balancers and the CLI's readiness check poll.
OPEN_PATHS = frozenset({"/", "/health"})
OPEN_PREFIXES = ("/static/",)
# Where ApiKeyMiddleware leaves the id of the key a request was authorized with.
KEY_ID_SCOPE = "verispec.api_key_id"


def key_id(api_key: str) -> str:
    """An id for a key that does not reveal it (it reaches the engine as part of a cache salt)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


def bearer_token(authorization: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header value (scheme case-insensitive)."""
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


class ApiKeyMiddleware:
    def __init__(self, app, api_keys: list[str]):
        self.app = app
        self._keys = [(key.encode(), key_id(key)) for key in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _is_open(scope["path"]) or scope["method"] == "OPTIONS":
            # OPTIONS: a browser's CORS preflight never carries credentials (the CORS layer answers it)
            await self.app(scope, receive, send)
            return
        matched = self._match(dict(scope["headers"]).get(b"authorization", b""))
        if matched is None:
            error = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        scope[KEY_ID_SCOPE] = matched
        await self.app(scope, receive, send)

    def _match(self, authorization: bytes) -> str | None:
        token = bearer_token(authorization)
        if token is None:
            return None
        # every key compared (constant time each), so the time taken does not say which one was near
        matches = [ident for key, ident in self._keys if secrets.compare_digest(token, key)]
        return matches[0] if matches else None


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
