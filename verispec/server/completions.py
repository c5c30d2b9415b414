"""POST /v1/completions: a raw prompt (text or token ids), no template, no reasoning split."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from verispec.engine.types import FinishReason, GenerationChunk
from verispec.server.errors import client_gone
from verispec.server.generation import collect, first_chunk, observed_generation
from verispec.server.logprobs import CompletionLogprobs
from verispec.server.prepare import check_model, prepare_completion
from verispec.server.schema import CompletionRequest
from verispec.server.state import ServerState, usage
from verispec.server.streaming import event_stream, sse_response


async def completion(state: ServerState, request: Request, body: CompletionRequest) -> Response:
    check_model(body.model, state.served_model_name)
    tokenizer = state.engine.tokenizer
    prepared = prepare_completion(body, state.engine)
    echo_text = prepared.prompt_text if body.echo else ""
    chunks = observed_generation(state, request, prepared)

    if body.stream:
        first = await first_chunk(chunks)
        logprobs = CompletionLogprobs(tokenizer, len(echo_text)) if prepared.params.logprobs else None
        renderer = CompletionChoiceRenderer(echo_text, logprobs)
        header = state.response_header("cmpl", "text_completion")
        return sse_response(event_stream(header, first, chunks, renderer, len(prepared.prompt_ids),
                                         body.include_usage))

    result = await collect(chunks)
    if result.finish_reason in (None, FinishReason.CANCELLED):
        raise client_gone()
    logprobs = (CompletionLogprobs(tokenizer, len(echo_text)).format(result.logprobs)
                if prepared.params.logprobs else None)
    choice = _choice(echo_text + result.text, logprobs, result.finish_reason.value)
    return JSONResponse({**state.response_header("cmpl", "text_completion"), "choices": [choice],
                         "usage": usage(len(prepared.prompt_ids), result.num_tokens)})


class CompletionChoiceRenderer:
    """Engine chunks -> streamed `text_completion` choices."""

    def __init__(self, echo_text: str, logprobs: CompletionLogprobs | None):
        self.echo_text = echo_text
        self.logprobs = logprobs

    def opening(self) -> list[dict]:
        return [_choice(self.echo_text)] if self.echo_text else []

    def chunk(self, chunk: GenerationChunk) -> list[dict]:
        choices = []
        logprobs = self.logprobs.format(chunk.logprobs) if self.logprobs and chunk.logprobs else None
        if chunk.text or logprobs:
            choices.append(_choice(chunk.text, logprobs))
        if chunk.finish_reason is not None:
            choices.append(_choice("", finish_reason=chunk.finish_reason.value))
        return choices


def _choice(text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
