"""Engine TokenLogprobs -> the two OpenAI logprobs formats (chat and legacy completions)."""
from __future__ import annotations

from verispec.engine.types import TokenLogprob
from verispec.loading.tokenizer import Tokenizer


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`."""

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": tokenizer.token_bytes(token_id)}

    return {"content": [{**entry(e.token_id, e.logprob),
                         "top_logprobs": [entry(tid, lp) for tid, lp in e.top]} for e in entries]}


class CompletionLogprobs:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; offsets run on across chunks."""

    def __init__(self, tokenizer: Tokenizer, start_offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = start_offset  # where the next token's text starts (after an echoed prompt)

    def format(self, entries: list[TokenLogprob]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.tokenizer.token_text(e.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({self.tokenizer.token_text(tid): lp for tid, lp in e.top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
