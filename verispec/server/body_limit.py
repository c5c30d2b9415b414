"""`--max-request-bytes`: request bodies over the cap get a 413 before they are parsed.

A declared Content-Length over the cap is refused without reading a byte; a chunked body is
counted as it arrives and refused at the first byte past the cap, so a client cannot make the
server buffer (and then parse and tokenize) an arbitrarily large body. A body that stops arriving
is a 408 after BODY_READ_TIMEOUT_S, so a half-sent request does not hold its connection forever.
"""
from __future__ import annotations

import asyncio

from verispec.server.errors import APIError

BODY_READ_TIMEOUT_S = 30.0  # the longest wait for the next piece of a request body

# Room for a full long-context prompt as JSON (256K tokens of escaped non-ASCII text is ~3 MB)
# while a hostile 100 MB body is refused at once.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         "(verispec serve --max-request-bytes)", code="request_too_large")


def body_timed_out() -> APIError:
    return APIError(408, f"the request body stopped arriving: nothing came for {BODY_READ_TIMEOUT_S:.0f}s",
                    code="request_timeout")


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        # Read the body here (the app would buffer it whole anyway) so that the 413 can be a plain
        # response: an error raised inside the app's own body reading would become a generic 400.
        messages = []
        num_bytes = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), BODY_READ_TIMEOUT_S)
            except asyncio.TimeoutError:
                await body_timed_out().response()(scope, receive, send)
                return
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left; the app sees the disconnect
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                await too_large(self.max_bytes).response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        buffered = iter(messages)

        async def replay_then_receive():
            message = next(buffered, None)
            return message if message is not None else await receive()

        await self.app(scope, replay_then_receive, send)
