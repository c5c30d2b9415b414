"""POST /v1/chat/completions: messages through the chat template, reasoning split from content."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from verispec.engine.types import GenerationChunk
from verispec.server.errors import client_gone
from verispec.server.generation import CollectedGeneration, all_finished, collect, first_chunk, observed_generation
from verispec.server.input_checks import reject_unpaired_surrogates_in
from verispec.server.logprobs import chat_logprobs
from verispec.server.prepare import PreparedRequest, check_model, prepare_chat
from verispec.server.reasoning import ReasoningParser, split_reasoning
from verispec.server.schema import ChatCompletionRequest
from verispec.server.speculation import SpeculationTally
from verispec.server.state import ServerState, usage
from verispec.server.streaming import event_stream, sse_response


async def chat_completion(state: ServerState, request: Request, body: ChatCompletionRequest) -> Response:
    # A walk over every string of the body: long for a multi-megabyte prompt, so off the event loop.
    await state.bridge.run_blocking(reject_unpaired_surrogates_in, body)
    check_model(body.model, state.served_model_name)
    tokenizer = state.engine.tokenizer
    prepared = await state.bridge.run_blocking(prepare_chat, body, state.engine, state.max_prompt_chars)
    # Only thinking models get their output split; for others "<think>" is just text.
    parses_reasoning = tokenizer.supports_thinking
    chunks = observed_generation(state, request, prepared)

    if body.stream:
        first = await first_chunk(chunks)
        renderers = [ChatChoiceRenderer(index, tokenizer,
                                        ReasoningParser(prepared.opens_thinking) if parses_reasoning else None,
                                        prepared.params.logprobs)
                     for index in range(prepared.num_choices)]
        header = state.response_header("chatcmpl", "chat.completion.chunk")
        return sse_response(event_stream(header, first, chunks, renderers, len(prepared.prompt_ids),
                                         body.include_usage))

    results = await collect(chunks, prepared.num_choices)
    if not all_finished(results):
        raise client_gone()
    choices = [_message_choice(index, result, prepared, tokenizer, parses_reasoning)
               for index, result in enumerate(results)]
    return JSONResponse({**state.response_header("chatcmpl", "chat.completion"), "choices": choices,
                         "usage": usage(len(prepared.prompt_ids), sum(r.num_tokens for r in results),
                                        max(r.cached_tokens for r in results))})


def _message_choice(index: int, result: CollectedGeneration, prepared: PreparedRequest, tokenizer,
                    parses_reasoning: bool) -> dict:
    message: dict = {"role": "assistant", "content": result.text}
    if parses_reasoning:
        split = split_reasoning(result.text, prepared.opens_thinking)
        message["content"] = split.content
        message["reasoning_content"] = split.reasoning or None
    return {"index": index, "message": message,
            "logprobs": chat_logprobs(tokenizer, result.logprobs) if prepared.params.logprobs else None,
            "finish_reason": result.finish_reason.value}


class ChatChoiceRenderer:
    """One choice's engine chunks -> `chat.completion.chunk` choices with content / reasoning_content deltas."""

    def __init__(self, index: int, tokenizer, reasoning: ReasoningParser | None, with_logprobs: bool):
        self.index = index
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.with_logprobs = with_logprobs
        self.speculation = SpeculationTally()

    def opening(self) -> list[dict]:
        return [self._choice({"role": "assistant", "content": ""})]

    def chunk(self, chunk: GenerationChunk) -> list[dict]:
        choices = []
        is_last = chunk.finish_reason is not None
        delta = self._delta(chunk.text, is_last)
        logprobs = chat_logprobs(self.tokenizer, chunk.logprobs) if self.with_logprobs and chunk.logprobs else None
        if delta or logprobs:
            choices.append(self._choice(delta, logprobs))
        if is_last:
            choices.append(self._choice({}, finish_reason=chunk.finish_reason.value))
        self.speculation.add(chunk)
        if choices and (field := self.speculation.take()) is not None:
            choices[0]["verispec"] = field  # see speculation.py: OpenAI clients ignore it
        return choices

    def _delta(self, text: str, is_last: bool) -> dict:
        if self.reasoning is None:
            return {"content": text} if text else {}
        parsed = self.reasoning.feed(text)
        if is_last:
            rest = self.reasoning.flush()
            parsed.reasoning += rest.reasoning
            parsed.content += rest.content
        delta = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        return delta

    def _choice(self, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
