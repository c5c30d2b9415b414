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
        out = _empty()
        for e in entries:
            self.offset = self._add(out, e.token_id, e.logprob, self._top(e), self.offset)
        return out

    def format_prompt(self, prompt_ids: list[int], entries: list[TokenLogprob]) -> dict:
        """An echoed prompt's tokens: the first has nothing before it to be scored from (null logprob
        and alternatives, as OpenAI and vLLM return it); entries score the rest. Offsets count from
        the start of the text; the generated tokens' keep theirs (from the echoed text's end)."""
        out, offset = _empty(), 0
        offset = self._add(out, prompt_ids[0], None, None, offset)
        for e in entries:
            offset = self._add(out, e.token_id, e.logprob, self._top(e), offset)
        return out

    def _top(self, e: TokenLogprob) -> dict[str, float]:
        return {self.tokenizer.token_text(tid): lp for tid, lp in e.top}

    def _add(self, out: dict, token_id: int, logprob: float | None, top: dict | None, offset: int) -> int:
        text = self.tokenizer.token_text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        return offset + len(text)


def joined(first: dict, second: dict | None) -> dict:
    """Two legacy logprobs objects, one after the other (an echoed prompt's, then the completion's)."""
    return first if second is None else {key: first[key] + second[key] for key in first}


def _empty() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
