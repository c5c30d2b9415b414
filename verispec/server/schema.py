"""Request bodies of the OpenAI endpoints, as pydantic models.

Only the shape and types are checked here; value ranges are checked once, by SamplingParams,
so the server and the Python API reject the same things with the same messages. Unknown
fields are ignored (clients send many we do not use), except where `extra="allow"` keeps them
for the chat template (tool calls, names).

Scalars are strict, as OpenAI's API is: `"stream": "yes"` or `"max_tokens": "5"` is a 400, not
silently read as true / 5, and a boolean is never a token id (`"prompt": [[false]]`).
Emptiness the server refuses (no messages, an empty prompt) is in the schema as a minimum length,
so the OpenAPI document says what is accepted.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, WithJsonSchema

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
# NaN and Infinity are not JSON, but Python's parser reads them; no sampling parameter means anything there.
FiniteFloat = Annotated[StrictFloat, Field(allow_inf_nan=False)]
# logit_bias: a JSON object's keys are strings, so token ids come as decimal text (OpenAI's shape)
TOKEN_ID_TEXT = r"^[0-9]{1,10}$"
LOGIT_BIAS_DOCUMENT = {"type": "object", "propertyNames": {"pattern": TOKEN_ID_TEXT},
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}
LogitBias = Annotated[dict[Annotated[StrictStr, Field(pattern=TOKEN_ID_TEXT)],
                           Annotated[StrictFloat, Field(allow_inf_nan=False, ge=-100, le=100)]],
                      WithJsonSchema(LOGIT_BIAS_DOCUMENT)]


# response_format is checked field by field in server/tools/request.py (errors name e.g.
# response_format.json_schema.schema); the document states the same shapes, so it allows no body
# the server answers with a 400 (`{}` has no type).
RESPONSE_FORMAT_DOCUMENT = {"oneOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}},
]}
ResponseFormat = Annotated[dict[str, Any], WithJsonSchema(RESPONSE_FORMAT_DOCUMENT)]


class ContentPart(BaseModel):
    """One element of a list-valued message content; only type "text" is served."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... reach the template as sent
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None


class GenerationRequest(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: StrictInt | None = None
    min_p: FiniteFloat | None = None
    repetition_penalty: FiniteFloat | None = None
    presence_penalty: FiniteFloat | None = None
    frequency_penalty: FiniteFloat | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    logit_bias: LogitBias | None = Field(
        default=None, description="token id -> a bias from -100 to 100 added to its logit (with speculation too)")
    # Optional flags accept null: many clients send every field, unset ones as null.
    ignore_eos: StrictBool | None = None
    n: StrictInt | None = Field(default=None, description="choices to generate, 1 to 16; with a seed, "
                                "choice i samples with seed + i")
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    cache_salt: Annotated[StrictStr, Field(min_length=1)] | None = Field(
        default=None, description="prefix-cache blocks are shared only with requests of the same API key "
        "that send the same salt (as vLLM's cache_salt)")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None  # OpenAI's newer name for max_tokens; wins if both
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, description="needs logprobs: true")
    chat_template_kwargs: dict[str, Any] | None = None
    # Checked field by field in server/tools/request.py, so errors name e.g. tools[0].function.name.
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = Field(default=None, description="none, auto, required, "
                                                           "or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = Field(default=None, description="{\"type\": \"text\" | "
                                                   "\"json_object\" | \"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}")


class CompletionRequest(GenerationRequest):
    # A string, token ids, or a one-element list of either (batches of prompts are refused).
    prompt: (Annotated[StrictStr, Field(min_length=1)] | TokenIds
             | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])
    logprobs: StrictInt | None = None  # legacy API: the number of top alternatives per token
    echo: StrictBool | None = Field(default=None, description="the prompt leads `text`; with `logprobs`, "
                                    "its tokens lead the logprobs (the first one's logprob is null)")
    best_of: StrictInt | None = Field(default=None, description="only equal to `n`: choosing the best of "
                                      "more completions than are returned is not supported")
    suffix: StrictStr | None = None


def request_field_names() -> set[str]:
    """Every field name of the request models (to tell field names from union tags in errors)."""
    names: set[str] = set()
    for model in (ChatCompletionRequest, CompletionRequest, ChatMessage, ContentPart, StreamOptions):
        names.update(model.model_fields)
    return names
