"""One request's generation as the endpoints see it: chunks, metrics, and stopping when the client leaves."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from verispec.engine.types import FinishReason, GenerationChunk, TokenLogprob
from verispec.server.bridge import cancel_on_disconnect
from verispec.server.prepare import PreparedRequest
from verispec.server.state import ServerState


async def observed_generation(state: ServerState, request: Request,
                              prepared: PreparedRequest) -> AsyncIterator[GenerationChunk]:
    """The engine's chunks for this request, recording TTFT and token counts in the metrics."""
    start = time.perf_counter()
    cancel = threading.Event()
    num_generated = 0
    state.metrics.in_flight.inc()
    try:
        async with cancel_on_disconnect(request, cancel), contextlib.aclosing(
                state.bridge.generate(prepared.prompt_ids, prepared.params, cancel)) as chunks:
            async for chunk in chunks:
                if num_generated == 0 and chunk.token_ids:
                    state.metrics.ttft.observe(time.perf_counter() - start)  # queueing included
                num_generated += len(chunk.token_ids)
                if chunk.stats is not None:
                    state.metrics.observe_stats(chunk.stats)
                yield chunk
    finally:
        state.metrics.in_flight.dec()
        if num_generated:  # a refused request processed no prompt
            state.metrics.observe_generation(len(prepared.prompt_ids), num_generated)


@dataclass
class CollectedGeneration:
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None


async def collect(chunks: AsyncIterator[GenerationChunk]) -> CollectedGeneration:
    """Run a generation to its end (non-streaming responses)."""
    out = CollectedGeneration()
    parts = []
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            parts.append(chunk.text)
            out.num_tokens += len(chunk.token_ids)
            out.logprobs.extend(chunk.logprobs or [])
            if chunk.finish_reason is not None:
                out.finish_reason = chunk.finish_reason
    out.text = "".join(parts)
    return out


async def first_chunk(chunks: AsyncIterator[GenerationChunk]) -> GenerationChunk | None:
    """Wait for the first chunk before a stream's headers go out, so that a request the engine
    refuses (or a crash in prefill) still gets a real HTTP error status."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None
    except BaseException:
        await chunks.aclose()
        raise
