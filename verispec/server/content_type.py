"""Bodies of the JSON routes must say `Content-Type: application/json` (or `...+json`), else 415.

A page on any site may POST to this server without a CORS preflight only with a "simple" content
type (text/plain, forms) or none at all; refusing those before the body is read stops such blind
cross-site requests from starting generations.
"""
from __future__ import annotations

from verispec.server.errors import APIError

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json(content_type: bytes | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(b";", 1)[0].strip().lower()
    kind, _, subtype = media.partition(b"/")
    return kind == b"application" and (subtype == b"json" or subtype.endswith(b"+json"))


class JsonContentTypeMiddleware:
    def __init__(self, app, json_paths: frozenset[str]):
        self.app = app
        self.json_paths = json_paths  # routes whose body is JSON (other paths answer 404 / 405 as they are)

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope["method"] in BODY_METHODS and scope["path"] in self.json_paths
                and not is_json(dict(scope["headers"]).get(b"content-type"))):
            error = APIError(415, "the request body must be JSON sent with 'Content-Type: application/json'",
                             code="unsupported_media_type")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
