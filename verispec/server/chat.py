"""POST /v1/chat/completions: messages through the chat template, reasoning split from content,
tool calls parsed out of the content (server/tools/)."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from verispec.engine.types import GenerationChunk
from verispec.server.cache_scope import cache_salt
from verispec.server.errors import client_gone
from verispec.server.metrics import note_parsed
from verispec.server.generation import CollectedGeneration, all_finished, collect, first_chunk, observed_generation
from verispec.server.logprobs import chat_logprobs
from verispec.server.prepare import PreparedRequest, prepare_chat, prepare_checked
from verispec.server.reasoning import ReasoningParser, split_reasoning
from verispec.server.schema import ChatCompletionRequest
from verispec.server.speculation import SpeculationTally
from verispec.server.state import ServerState, usage
from verispec.server.streaming import event_stream, sse_response
from verispec.server.tools.request import ToolPlan
from verispec.server.tools.streaming import ToolStreamParser


async def chat_completion(state: ServerState, request: Request, body: ChatCompletionRequest) -> Response:
    note_parsed(request)
    body_bytes = len(await request.body())  # already read (and kept) to parse `body`
    tokenizer = state.engine.tokenizer
    prepared = await state.bridge.run_blocking(body_bytes, prepare_checked, prepare_chat, body, state.engine,
                                              state.served_model_name, state.prompt_budget)
    prepared.params.cache_salt = cache_salt(request.scope, body.cache_salt)
    # Only thinking models get their output split; for others "<think>" is just text.
    parses_reasoning = tokenizer.supports_thinking
    chunks = observed_generation(state, request, prepared)

    if body.stream:
        first = await first_chunk(chunks)
        renderers = [ChatChoiceRenderer(index, tokenizer,
                                        ReasoningParser(prepared.opens_thinking) if parses_reasoning else None,
                                        prepared.params.logprobs, prepared.tool_plan)
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
    finish_reason = result.finish_reason.value
    plan = prepared.tool_plan
    if plan is not None and plan.fmt is not None:
        reply = plan.fmt.parse(message["content"], plan.functions)
        if reply.calls:
            message["content"] = reply.content or None
            message["tool_calls"] = [call.message_field() for call in reply.calls]
            finish_reason = _finish_with_calls(finish_reason)
    return {"index": index, "message": message,
            "logprobs": chat_logprobs(tokenizer, result.logprobs) if prepared.params.logprobs else None,
            "finish_reason": finish_reason}


def _finish_with_calls(finish_reason: str) -> str:
    """A reply that ended by itself with calls in it ends for them (OpenAI's "tool_calls")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ChatChoiceRenderer:
    """One choice's engine chunks -> `chat.completion.chunk` choices with content / reasoning_content deltas."""

    def __init__(self, index: int, tokenizer, reasoning: ReasoningParser | None, with_logprobs: bool,
                 tool_plan: ToolPlan | None = None):
        self.index = index
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.with_logprobs = with_logprobs
        self.speculation = SpeculationTally()
        parses_calls = tool_plan is not None and tool_plan.fmt is not None
        self.tools = ToolStreamParser(tool_plan.fmt, tool_plan.functions) if parses_calls else None

    def opening(self) -> list[dict]:
        return [self._choice({"role": "assistant", "content": ""})]

    def chunk(self, chunk: GenerationChunk) -> list[dict]:
        choices = []
        is_last = chunk.finish_reason is not None
        delta = self._delta(chunk.text, is_last)
        call_deltas = []
        if self.tools is not None:
            content, call_deltas = self.tools.feed(delta.pop("content", ""), final=is_last)
            if content:
                delta["content"] = content
        logprobs = chat_logprobs(self.tokenizer, chunk.logprobs) if self.with_logprobs and chunk.logprobs else None
        if delta or logprobs:
            choices.append(self._choice(delta, logprobs))
        # one chunk per call delta: the call's name (arguments ""), then its arguments
        choices += [self._choice({"tool_calls": [call]}) for call in call_deltas]
        if is_last:
            finish_reason = chunk.finish_reason.value
            if self.tools is not None and self.tools.num_calls:
                finish_reason = _finish_with_calls(finish_reason)
            choices.append(self._choice({}, finish_reason=finish_reason))
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
