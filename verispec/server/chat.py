"""POST /v1/chat/completions: messages through the chat template, reasoning split from content."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from verispec.engine.types import FinishReason, GenerationChunk
from verispec.server.errors import client_gone
from verispec.server.generation import collect, first_chunk, observed_generation
from verispec.server.logprobs import chat_logprobs
from verispec.server.prepare import check_model, prepare_chat
from verispec.server.reasoning import ReasoningParser, split_reasoning
from verispec.server.schema import ChatCompletionRequest
from verispec.server.speculation import SpeculationTally
from verispec.server.state import ServerState, usage
from verispec.server.streaming import event_stream, sse_response


async def chat_completion(state: ServerState, request: Request, body: ChatCompletionRequest) -> Response:
    check_model(body.model, state.served_model_name)
    tokenizer = state.engine.tokenizer
    prepared = prepare_chat(body, state.engine)
    # Only thinking models get their output split; for others "<think>" is just text.
    parses_reasoning = tokenizer.supports_thinking
    chunks = observed_generation(state, request, prepared)

    if body.stream:
        first = await first_chunk(chunks)
        parser = ReasoningParser(prepared.opens_thinking) if parses_reasoning else None
        renderer = ChatChoiceRenderer(tokenizer, parser, prepared.params.logprobs)
        header = state.response_header("chatcmpl", "chat.completion.chunk")
        return sse_response(event_stream(header, first, chunks, renderer, len(prepared.prompt_ids),
                                         body.include_usage))

    result = await collect(chunks)
    if result.finish_reason in (None, FinishReason.CANCELLED):
        raise client_gone()
    message: dict = {"role": "assistant", "content": result.text}
    if parses_reasoning:
        split = split_reasoning(result.text, prepared.opens_thinking)
        message["content"] = split.content
        message["reasoning_content"] = split.reasoning or None
    choice = {"index": 0, "message": message,
              "logprobs": chat_logprobs(tokenizer, result.logprobs) if prepared.params.logprobs else None,
              "finish_reason": result.finish_reason.value}
    return JSONResponse({**state.response_header("chatcmpl", "chat.completion"), "choices": [choice],
                         "usage": usage(len(prepared.prompt_ids), result.num_tokens)})


class ChatChoiceRenderer:
    """Engine chunks -> `chat.completion.chunk` choices with content / reasoning_content deltas."""

    def __init__(self, tokenizer, reasoning: ReasoningParser | None, with_logprobs: bool):
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.with_logprobs = with_logprobs
        self.speculation = SpeculationTally()

    def opening(self) -> list[dict]:
        return [_choice({"role": "assistant", "content": ""})]

    def chunk(self, chunk: GenerationChunk) -> list[dict]:
        choices = []
        is_last = chunk.finish_reason is not None
        delta = self._delta(chunk.text, is_last)
        logprobs = chat_logprobs(self.tokenizer, chunk.logprobs) if self.with_logprobs and chunk.logprobs else None
        if delta or logprobs:
            choices.append(_choice(delta, logprobs))
        if is_last:
            choices.append(_choice({}, finish_reason=chunk.finish_reason.value))
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


def _choice(delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
