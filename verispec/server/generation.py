"""One request's generation as the endpoints see it: the chunks of its `n` choices, metrics, and
stopping when the client leaves."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from verispec import log
from verispec.engine.types import FinishReason, GenerationChunk, TokenLogprob
from verispec.server.bridge import cancel_on_disconnect
from verispec.server.metrics import ARRIVED_AT, PARSED_AT
from verispec.server.prepare import PreparedRequest
from verispec.server.state import ServerState

ChoiceChunk = tuple[int, GenerationChunk]  # (choice index, one engine chunk of that choice)


async def observed_generation(state: ServerState, request: Request,
                              prepared: PreparedRequest) -> AsyncIterator[ChoiceChunk]:
    """Every choice's chunks as they come, recording TTFT and token counts in the metrics."""
    start = time.perf_counter()
    cancel = threading.Event()
    num_generated = 0
    state.metrics.in_flight.inc()
    try:
        async with cancel_on_disconnect(request, cancel), contextlib.aclosing(
                state.bridge.generate_choices(prepared.prompt_ids, prepared.choice_params(), cancel)) as chunks:
            async for index, chunk in chunks:
                if num_generated == 0 and chunk.token_ids:
                    state.metrics.ttft.observe(time.perf_counter() - start)  # queueing included
                    if log.debug_enabled():
                        _log_first_token(request, start)
                num_generated += len(chunk.token_ids)
                if chunk.stats is not None:
                    state.metrics.observe_stats(chunk.stats)
                yield index, chunk
    finally:
        state.metrics.in_flight.dec()
        if num_generated:  # a refused request processed no prompt; the n choices share one prompt
            state.metrics.observe_generation(len(prepared.prompt_ids), num_generated)


def _log_first_token(request: Request, submitted: float) -> None:
    """Where a request's time to first token went on this side of the engine: reading and parsing
    its body (MetricsMiddleware notes its arrival), the checks, template and tokenizer (from its
    endpoint's start), and from handing it to the engine to its first token here (the engine logs
    its own share when the request ends)."""
    state = request.scope.get("state", {})
    now = time.perf_counter()
    arrived, parsed = state.get(ARRIVED_AT, submitted), state.get(PARSED_AT, submitted)
    log.debug("first token %.1f ms after the request arrived: %.1f ms reading it, %.1f ms preparing it, %.1f ms "
              "from the engine's queue to here", (now - arrived) * 1000, (parsed - arrived) * 1000,
              (submitted - parsed) * 1000, (now - submitted) * 1000)


@dataclass
class CollectedGeneration:
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # GenerationChunk's (asked for: on the first chunk)
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0  # prompt tokens from the prefix cache (GenerationStats.cached_tokens)


async def collect(chunks: AsyncIterator[ChoiceChunk], num_choices: int) -> list[CollectedGeneration]:
    """Run every choice to its end (non-streaming responses); results in choice order."""
    outs = [CollectedGeneration() for _ in range(num_choices)]
    parts: list[list[str]] = [[] for _ in range(num_choices)]
    async with contextlib.aclosing(chunks):
        async for index, chunk in chunks:
            out = outs[index]
            parts[index].append(chunk.text)
            out.num_tokens += len(chunk.token_ids)
            out.logprobs.extend(chunk.logprobs or [])
            if chunk.prompt_logprobs is not None:
                out.prompt_logprobs = chunk.prompt_logprobs
            if chunk.finish_reason is not None:
                out.finish_reason = chunk.finish_reason
                out.cached_tokens = chunk.stats.cached_tokens if chunk.stats is not None else 0
    for out, texts in zip(outs, parts):
        out.text = "".join(texts)
    return outs


def all_finished(results: list[CollectedGeneration]) -> bool:
    """False when any choice was cancelled or cut off (the client left): there is no answer to send."""
    return all(r.finish_reason not in (None, FinishReason.CANCELLED) for r in results)


async def first_chunk(chunks: AsyncIterator[ChoiceChunk]) -> ChoiceChunk | None:
    """Wait for the first chunk before a stream's headers go out, so that a request the engine
    refuses (or a crash in prefill) still gets a real HTTP error status."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None
    except BaseException:
        await chunks.aclose()
        raise
