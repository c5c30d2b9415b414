"""A validated request body -> what the engine takes: prompt token ids and SamplingParams."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Callable

from verispec import log
from verispec.engine.client import EngineClient
from verispec.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from verispec.errors import InvalidRequestError
from verispec.grammar.spec import GrammarSpec
from verispec.server.errors import APIError, invalid_request, model_not_found
from verispec.server.input_checks import (check_chat_template_kwargs, check_seed, check_token_ids,
                                          reject_unpaired_surrogates_in)
from verispec.server.schema import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationRequest
from verispec.server.token_budget import PromptBudget
from verispec.server.tools.request import (ToolPlan, plan_response_format, plan_tools, special_token_marker,
                                           template_messages)

# Request fields that map one-to-one onto SamplingParams (None means "the engine's default").
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed")
MAX_CHOICES = 16  # `n`: each choice is its own sequence in the batch, so n multiplies the work
# Every stop string is searched for after every token, on the engine thread that serves the whole
# batch: 100k of them cost 90 ms per token (measured), for every client. OpenAI takes 4.
MAX_STOP_STRINGS = 32
# repetition_penalty divides (or multiplies) logits: far from 1 it overflows float32 to inf (1e-300
# did, failing the engine step of every sequence in the batch). Useful values are about 1 to 2.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass
class PreparedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""  # the rendered chat prompt or the completion prompt (for echo)
    opens_thinking: bool = False  # the chat template ended the prompt inside <think>
    num_choices: int = 1  # `n`

    default_seed: int | None = None  # the server's --seed, used when the request has none
    tool_plan: ToolPlan | None = None  # tools were given: how the output is parsed for calls

    def choice_params(self) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i samples with seed + i (so the
        choices differ, and each is reproducible on its own). The server's default seed counts
        too: n choices from one seed would otherwise be n copies."""
        seed = self.params.seed if self.params.seed is not None else self.default_seed
        if seed is None or self.num_choices == 1:
            return [self.params] * self.num_choices
        return [replace(self.params, seed=seed + i) for i in range(self.num_choices)]


def warm_up_preparation(engine: EngineClient, budget: PromptBudget) -> float:
    """One chat request prepared and thrown away before serving, so that the chat template's compile
    and the tokenizer's first calls (about 0.1 s on the H200's host) are not the first client's.
    Returns the seconds it took; a model whose template cannot render it is logged and skipped."""
    t0 = time.perf_counter()
    request = ChatCompletionRequest(messages=[ChatMessage(role="user", content="Hello")], max_tokens=1)
    try:
        prepare_chat(request, engine, budget)
    except (APIError, InvalidRequestError) as exc:
        log.debug("request preparation not warmed up: %s", exc)
    return time.perf_counter() - t0


def prepare_checked(prepare: Callable, req: GenerationRequest, engine: EngineClient, served_name: str,
                    budget: PromptBudget) -> PreparedRequest:
    """`prepare` (prepare_chat or prepare_completion) after the body's checks: every string of it
    Unicode (a walk that is long for a multi-megabyte prompt) and the model its name. Blocking, one
    call off the event loop for all of it: each hop to a thread and back cost a request about as
    much as its template and tokenizer, and eight clients' requests queue behind each other's."""
    reject_unpaired_surrogates_in(req)
    check_model(req.model, served_name)
    return prepare(req, engine, budget)


def check_model(requested: str | None, served_name: str) -> None:
    """Accept the served name, its last path component ("org/name" -> "name"), or no model."""
    if not requested:
        return
    short = served_name.rstrip("/").rsplit("/", 1)[-1]
    if requested not in (served_name, short):
        raise model_not_found(requested, served_name)


def prepare_chat(req: ChatCompletionRequest, engine: EngineClient, budget: PromptBudget) -> PreparedRequest:
    """Blocking (renders the template and tokenizes): the server runs it off the event loop."""
    tokenizer = engine.tokenizer
    num_choices = _check_common(req, engine)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if not req.messages:
        raise invalid_request("'messages' must be a non-empty list of {role, content} objects",
                              param="messages")
    check_chat_template_kwargs(req.chat_template_kwargs, tokenizer)
    template = getattr(tokenizer.hf, "chat_template", None)
    check = engine.grammars.check
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, template, special_token_marker(tokenizer),
                      check)
    grammar = _output_grammar(req, plan, check)
    template_kwargs = req.chat_template_kwargs
    if grammar is not None and tokenizer.supports_thinking and "enable_thinking" not in (template_kwargs or {}):
        # the grammar starts at the first output token: a thinking model answers at once
        template_kwargs = {**(template_kwargs or {}), "enable_thinking": False}
    messages = template_messages([_template_message(i, m) for i, m in enumerate(req.messages)], plan)
    prompt = tokenizer.render_chat_prompt(messages, template_kwargs, tools=plan.template_tools if plan else None)
    prompt_text = prompt.text
    budget.check(prompt_text, tokenizer.encode, "messages")
    prompt_ids = tokenizer.encode_chat(prompt)
    # The engine says "max_tokens" and "prompt"; errors name the fields this client actually sent.
    sent = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
            "prompt": "messages"}
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    with _renamed_params(sent):
        params = _sampling_params(req, max_tokens, logprobs=bool(req.logprobs),
                                  top_logprobs=req.top_logprobs or 0)
        _check_fits(engine, prompt_ids, params)
    params.grammar = grammar
    return PreparedRequest(prompt_ids, params, prompt_text, tokenizer.prompt_opens_thinking(prompt_text),
                           num_choices, _default_seed(engine, num_choices), tool_plan=plan)


def _output_grammar(req: ChatCompletionRequest, plan: ToolPlan | None, check: Callable[[GrammarSpec], None]):
    """The grammar the output must follow (response_format, or a forced tool call), checked by the
    engine's grammar library so an unsupported schema feature is a 400 before anything runs."""
    grammar = plan_response_format(req.response_format)
    if grammar is not None and plan is not None and plan.grammar is not None:
        raise invalid_request("'response_format' cannot be combined with a forced tool call (tool_choice "
                              "\"required\" or a named function): one output cannot follow both",
                              param="response_format")
    grammar = grammar or (plan.grammar if plan is not None else None)
    if grammar is not None:
        check(grammar)
    return grammar


def prepare_completion(req: CompletionRequest, engine: EngineClient, budget: PromptBudget) -> PreparedRequest:
    """Blocking (tokenizes): the server runs it off the event loop."""
    tokenizer = engine.tokenizer
    num_choices = _check_common(req, engine)
    if req.suffix:
        raise invalid_request("'suffix' (fill-in-the-middle) is not supported", param="suffix")
    # Checked here, not by SamplingParams: the legacy API calls its top-logprobs count `logprobs`.
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise invalid_request(f"'logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}, "
                              f"got {req.logprobs}", param="logprobs")
    if req.best_of is not None and req.best_of != num_choices:
        raise invalid_request(f"'best_of' must equal 'n' ({num_choices}), got {req.best_of}: choosing the best "
                              "of more completions than are returned is not supported", param="best_of")
    # echo with logprobs scores the prompt too (its tokens lead the logprobs), as OpenAI's legacy API does
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    if req.max_tokens == 0 and prompt_logprobs is None:
        raise invalid_request("'max_tokens' may be 0 only with 'echo': true and 'logprobs' (scoring the "
                              "prompt); otherwise it must be an integer >= 1", param="max_tokens")
    prompt = _single_prompt(req.prompt)
    if isinstance(prompt, str):
        budget.check(prompt, tokenizer.encode, "prompt")
        # A raw prompt gets the tokenizer's own BOS, as Hugging Face and vLLM do.
        prompt_ids, prompt_text = tokenizer.encode(prompt, add_special_tokens=True), prompt
    else:
        prompt_ids, prompt_text = prompt, ""
    with _renamed_params({"messages": "prompt"}):  # the engine names a too-long prompt "messages"
        params = _sampling_params(req, req.max_tokens, logprobs=req.logprobs is not None,
                                  top_logprobs=req.logprobs or 0, prompt_logprobs=prompt_logprobs)
        _check_fits(engine, prompt_ids, params)
    if req.echo and not prompt_text:
        prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return PreparedRequest(prompt_ids, params, prompt_text, num_choices=num_choices,
                           default_seed=_default_seed(engine, num_choices))


def _check_fits(engine: EngineClient, prompt_ids: list[int], params: SamplingParams) -> None:
    """The engine's own checks, run before any response starts (a stream cannot change its status)."""
    engine.check_prompt_ids(prompt_ids)
    engine.resolve_max_tokens(len(prompt_ids), params)


@contextlib.contextmanager
def _renamed_params(names: dict[str, str]):
    """Rename the `param` of an InvalidRequestError raised inside (engine name -> request field)."""
    try:
        yield
    except InvalidRequestError as exc:
        exc.param = names.get(exc.param, exc.param)
        raise


def _check_common(req: GenerationRequest, engine: EngineClient) -> int:
    """Checks both endpoints share; returns the number of choices."""
    num_choices = 1 if req.n is None else req.n
    if not 1 <= num_choices <= MAX_CHOICES:
        raise invalid_request(f"'n' must be an integer between 1 and {MAX_CHOICES}, got {req.n}", param="n")
    check_seed(req.seed, num_choices)
    low, high = REPETITION_PENALTY_RANGE
    if req.repetition_penalty is not None and not low <= req.repetition_penalty <= high:
        raise invalid_request(f"'repetition_penalty' must be between {low} and {high}, got {req.repetition_penalty}",
                              param="repetition_penalty")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_STRINGS:
        raise invalid_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(req.stop)}",
                              param="stop")
    if req.stop_token_ids:
        check_token_ids(req.stop_token_ids, engine.vocab_size, "stop_token_ids")
    if req.logit_bias:
        check_token_ids([int(t) for t in req.logit_bias], engine.vocab_size, "logit_bias")
    return num_choices


def _default_seed(engine: EngineClient, num_choices: int) -> int | None:
    """The server's --seed (None without one), checked like a request's: choice i uses it + i."""
    seed = engine.default_seed
    check_seed(seed, num_choices)
    return seed


def _template_message(index: int, message: ChatMessage) -> dict:
    """A request message -> the dict the chat template reads, with list content joined to text."""
    out = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        unsupported = [f"content[{j}] has type '{part.type}'"
                       for j, part in enumerate(content) if part.type != "text"]
        if unsupported:
            raise invalid_request(
                f"messages[{index}]: {', '.join(unsupported)}; this server accepts only 'text' "
                "content parts", param=f"messages[{index}].content")
        content = "".join(part.text or "" for part in content)
    out["content"] = content or ""
    return out


def _single_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise invalid_request("'prompt' is empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if len(prompt) != 1:
        raise invalid_request(f"'prompt' holds {len(prompt)} prompts; this server takes one per request",
                              param="prompt")
    return prompt[0]


def _sampling_params(req: GenerationRequest, max_tokens: int | None, logprobs: bool,
                     top_logprobs: int, prompt_logprobs: int | None = None) -> SamplingParams:
    kwargs = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
    return SamplingParams(max_tokens=max_tokens, stop=_stop_list(req.stop),
                          stop_token_ids=list(req.stop_token_ids or []), ignore_eos=bool(req.ignore_eos),
                          logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                          logit_bias={int(t): bias for t, bias in (req.logit_bias or {}).items()}, **kwargs)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
