"""Request bodies of the OpenAI endpoints, as pydantic models.

Only the shape and types are checked here; value ranges are checked once, by SamplingParams,
so the server and the Python API reject the same things with the same messages. Unknown
fields are ignored (clients send many we do not use), except where `extra="allow"` keeps them
for the chat template (tool calls, names).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ContentPart(BaseModel):
    """One element of a list-valued message content; only type "text" is served."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... reach the template as sent
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = None


class GenerationRequest(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Optional flags accept null: many clients send every field, unset ones as null.
    ignore_eos: bool | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins if both
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(GenerationRequest):
    # A string, token ids, or a one-element list of either (batches of prompts are refused).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # legacy API: the number of top alternatives per token
    echo: bool | None = None
    suffix: str | None = None


def request_field_names() -> set[str]:
    """Every field name of the request models (to tell field names from union tags in errors)."""
    names: set[str] = set()
    for model in (ChatCompletionRequest, CompletionRequest, ChatMessage, ContentPart, StreamOptions):
        names.update(model.model_fields)
    return names
