"""Checks on hostile or malformed input that the request models cannot express: text that is not
valid Unicode, seeds torch cannot take, token ids outside the vocabulary, template arguments that
would change the renderer (prompts too long for the context: token_budget.py)."""
from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel

from verispec.server.errors import invalid_request

# torch.Generator.manual_seed takes exactly this range (anything else is an OverflowError).
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


def reject_unpaired_surrogates_in(body: BaseModel) -> None:
    """Every string of a request body, its unknown (passed-through) fields included."""
    reject_unpaired_surrogates(body.model_dump())


def reject_unpaired_surrogates(value: Any, path: str = "") -> None:
    """A JSON string may hold an escaped lone UTF-16 surrogate ("\\ud800"), which is not Unicode:
    no tokenizer can encode it and no response could echo it. 400 naming the first field holding one."""
    if isinstance(value, str):
        if not _is_encodable(value):
            raise invalid_request(f"'{path}' holds an unpaired UTF-16 surrogate (e.g. \\ud800), which is not "
                                  "valid Unicode text", param=path or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _is_encodable(key):
                raise invalid_request(f"a key inside '{path}' holds an unpaired UTF-16 surrogate, which is not "
                                      "valid Unicode text", param=path or None)
            reject_unpaired_surrogates(item, child)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list, tuple)):  # token ids (millions of ints) need no call
                reject_unpaired_surrogates(item, f"{path}[{i}]")


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")  # C speed even for a multi-megabyte prompt
    except UnicodeEncodeError:
        return False
    return True


def check_seed(seed: int | None, num_choices: int) -> None:
    """Choice i samples with seed + i, so every one of those must be a seed torch accepts."""
    if seed is None:
        return
    top = MAX_SEED - (num_choices - 1)
    if not MIN_SEED <= seed <= top:
        within = f"between {MIN_SEED} and {top}" + (f" (choice i uses seed + i, n={num_choices})"
                                                    if num_choices > 1 else "")
        raise invalid_request(f"'seed' must be an integer {within}, got {seed}", param="seed")


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid_request(f"'{param}' must hold token ids in [0, {vocab_size}); got {bad[:5]}", param=param)


def check_chat_template_kwargs(kwargs: dict | None, tokenizer) -> None:
    """`chat_template_kwargs` are variables for the model's template. A key naming one of
    apply_chat_template's own parameters would change how it runs: `chat_template` would swap in
    the client's own template (whose loops could spin a preparation thread for hours), `tokenize`
    or `add_generation_prompt` would break the prompt. Those keys are refused."""
    if not kwargs:
        return
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return
    parameters = inspect.signature(hf.apply_chat_template).parameters.values()
    reserved = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    refused = sorted(reserved & set(kwargs))
    if refused:
        raise invalid_request(f"'chat_template_kwargs' may not set {', '.join(refused)}: they are the template "
                              "renderer's own parameters, not template variables", param="chat_template_kwargs")
