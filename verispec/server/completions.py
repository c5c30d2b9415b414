"""POST /v1/completions: a raw prompt (text or token ids), no template, no reasoning split."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from verispec.engine.types import GenerationChunk
from verispec.server.cache_scope import cache_salt
from verispec.server.errors import client_gone
from verispec.server.metrics import note_parsed
from verispec.server.generation import all_finished, collect, first_chunk, observed_generation
from verispec.server.logprobs import CompletionLogprobs, joined
from verispec.server.prepare import prepare_checked, prepare_completion
from verispec.server.schema import CompletionRequest
from verispec.server.state import ServerState, usage
from verispec.server.streaming import event_stream, sse_response


async def completion(state: ServerState, request: Request, body: CompletionRequest) -> Response:
    note_parsed(request)
    body_bytes = len(await request.body())  # already read (and kept) to parse `body`
    tokenizer = state.engine.tokenizer
    prepared = await state.bridge.run_blocking(body_bytes, prepare_checked, prepare_completion, body, state.engine,
                                              state.served_model_name, state.prompt_budget)
    prepared.params.cache_salt = cache_salt(request.scope, body.cache_salt)
    echo_text = prepared.prompt_text if body.echo else ""
    # echo with logprobs: the prompt's tokens lead the logprobs (SamplingParams.prompt_logprobs)
    scored_prompt = prepared.prompt_ids if prepared.params.prompt_logprobs is not None else None
    chunks = observed_generation(state, request, prepared)

    def logprobs_formatter() -> CompletionLogprobs | None:
        return CompletionLogprobs(tokenizer, len(echo_text)) if prepared.params.logprobs else None

    if body.stream:
        first = await first_chunk(chunks)
        renderers = [CompletionChoiceRenderer(index, echo_text, logprobs_formatter(), scored_prompt)
                     for index in range(prepared.num_choices)]
        header = state.response_header("cmpl", "text_completion")
        return sse_response(event_stream(header, first, chunks, renderers, len(prepared.prompt_ids),
                                         body.include_usage))

    results = await collect(chunks, prepared.num_choices)
    if not all_finished(results):
        raise client_gone()
    choices = []
    for index, result in enumerate(results):
        formatter = logprobs_formatter()
        logprobs = formatter.format(result.logprobs) if formatter else None
        if formatter and scored_prompt is not None:
            logprobs = joined(formatter.format_prompt(scored_prompt, result.prompt_logprobs or []), logprobs)
        choices.append(_choice(index, echo_text + result.text, logprobs, result.finish_reason.value))
    return JSONResponse({**state.response_header("cmpl", "text_completion"), "choices": choices,
                         "usage": usage(len(prepared.prompt_ids), sum(r.num_tokens for r in results),
                                        max(r.cached_tokens for r in results))})


class CompletionChoiceRenderer:
    """One choice's engine chunks -> streamed `text_completion` choices."""

    def __init__(self, index: int, echo_text: str, logprobs: CompletionLogprobs | None,
                 scored_prompt: list[int] | None = None):
        self.index = index
        self.echo_text = echo_text
        self.logprobs = logprobs
        # the prompt's ids when its logprobs come (on the choice's first engine chunk): the echoed
        # text waits for them, so that one choice carries the prompt's text and logprobs together
        self.scored_prompt = scored_prompt

    def opening(self) -> list[dict]:
        return [_choice(self.index, self.echo_text)] if self.echo_text and self.scored_prompt is None else []

    def chunk(self, chunk: GenerationChunk) -> list[dict]:
        choices = []
        text = chunk.text
        logprobs = self.logprobs.format(chunk.logprobs) if self.logprobs and chunk.logprobs else None
        if self.scored_prompt is not None and self.logprobs is not None:
            text = self.echo_text + text
            logprobs = joined(self.logprobs.format_prompt(self.scored_prompt, chunk.prompt_logprobs or []), logprobs)
            self.scored_prompt = None
        if text or logprobs:
            choices.append(_choice(self.index, text, logprobs))
        if chunk.finish_reason is not None:
            choices.append(_choice(self.index, "", finish_reason=chunk.finish_reason.value))
        return choices


def _choice(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
