"""Server-sent events as OpenAI streams them: `data: {json}` per chunk, then `data: [DONE]`.

The skeleton is shared by both endpoints; what goes into each chunk's choice is the
endpoint's ChoiceRenderer, one per choice (n > 1 interleaves choices, each chunk naming its index).
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Protocol

from fastapi.responses import StreamingResponse

from verispec.engine.types import FinishReason, GenerationChunk
from verispec.server.errors import as_api_error
from verispec.server.generation import ChoiceChunk
from verispec.server.state import usage

DONE_EVENT = "data: [DONE]\n\n"


class ChoiceRenderer(Protocol):
    def opening(self) -> list[dict]:
        """Choices sent before any generated text (the chat role, an echoed prompt)."""

    def chunk(self, chunk: GenerationChunk) -> list[dict]:
        """Choices for one engine chunk; the last chunk's list ends with the finish_reason choice."""


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def event_stream(header: dict, first: ChoiceChunk | None, chunks: AsyncIterator[ChoiceChunk],
                       renderers: list[ChoiceRenderer], num_prompt_tokens: int,
                       include_usage: bool) -> AsyncIterator[str]:
    # With include_usage every chunk says "usage": null and one extra chunk at the end has it.
    usage_field = {"usage": None} if include_usage else {}
    num_generated = 0  # over all choices: the prompt is counted once, completions summed
    num_cached = 0  # prompt tokens the prefix cache supplied (the most any choice got)
    try:
        for renderer in renderers:
            for choice in renderer.opening():
                yield sse({**header, "choices": [choice], **usage_field})
        item = first
        while item is not None:
            index, chunk = item
            if chunk.finish_reason is FinishReason.CANCELLED:
                return  # the client is gone: there is nobody to tell
            num_generated += len(chunk.token_ids)
            if chunk.stats is not None:
                num_cached = max(num_cached, chunk.stats.cached_tokens)
            for choice in renderers[index].chunk(chunk):
                yield sse({**header, "choices": [choice], **usage_field})
            item = await anext(chunks, None)
        if include_usage:
            yield sse({**header, "choices": [], "usage": usage(num_prompt_tokens, num_generated, num_cached)})
    except Exception as exc:  # headers are sent: the error can only travel as an event
        yield sse(as_api_error(exc, " mid-stream").body())
    finally:
        await chunks.aclose()
    yield DONE_EVENT


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    # no-cache / no buffering: proxies must pass each event on as it comes.
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
