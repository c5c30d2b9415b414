"""A prompt that cannot fit the context is refused before it is tokenized in full.

Two gates, both before the exact tokenization:
- characters: a token stands for at most as many characters as the longest vocabulary entry (times
  a slack where the tokenizer normalizes text first), so a longer text cannot fit, whatever it is;
- counting: a text past one slice is tokenized in bounded slices (cut before whitespace) and the
  walk stops as soon as the count passes the context. Refusing a 7.6 MB prompt then costs about what
  tokenizing the longest prompt that fits costs, not a full tokenization (5.7 M tokens, 11 s).
A prompt that passes is tokenized whole (slices need not tokenize as the whole text does), so one
longer than a slice is tokenized about twice: tens of milliseconds per 40 K tokens.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from verispec.server.errors import invalid_request

# A normalizer can fold several characters into one (NFC composes "e" + U+0301 into "é"), so a
# token may stand for more characters than its own text has; this margin covers that.
NORMALIZATION_SLACK = 4
# Slices hold about as many characters as the context holds tokens, within these bounds: small
# enough that the walk stops soon after the context is passed, large enough to cost few calls.
SLICE_CHARS_RANGE = (1024, 16384)
CUT_SEARCH_CHARS = 256  # how far back from a slice's end a whitespace is looked for to cut before
# Tokenizing two slices can give a few more tokens than tokenizing the text they were cut from (a
# word or a run split in two): each cut is allowed this many before a prompt is called too long.
TOKENS_PER_CUT_SLACK = 16

Encode = Callable[[str], Sequence[int]]


@dataclass(frozen=True)
class PromptBudget:
    max_tokens: int  # the context length
    max_chars: int  # no text longer than this fits, whatever it tokenizes to

    @classmethod
    def for_tokenizer(cls, tokenizer, max_model_len: int) -> "PromptBudget":
        return cls(max_model_len, max_prompt_chars(tokenizer, max_model_len))

    @property
    def slice_chars(self) -> int:
        low, high = SLICE_CHARS_RANGE
        return max(low, min(high, self.max_tokens))

    def check(self, text: str, encode: Encode, param: str) -> None:
        """400 (context_length_exceeded) when `text` cannot fit the context, found by its length or
        by counting its tokens slice by slice; the exact count is checked after full tokenization."""
        if len(text) > self.max_chars:
            raise invalid_request(
                f"the prompt has {len(text)} characters, more than any prompt that fits this model's context "
                f"length of {self.max_tokens} tokens can have ({self.max_chars})", param=param,
                code="context_length_exceeded")
        counted = self.count_past_limit(text, encode)
        if counted is not None:
            raise invalid_request(
                f"the prompt is longer than this model's context length of {self.max_tokens} tokens (counting "
                f"stopped at {counted} tokens)", param=param, code="context_length_exceeded")

    def count_past_limit(self, text: str, encode: Encode, slice_chars: int | None = None) -> int | None:
        """The token count at which `text` was shown to need more than max_tokens, or None when it may
        fit. Each `encode` call gets at most `slice_chars` (default: self.slice_chars) characters."""
        size = slice_chars or self.slice_chars
        if len(text) <= size:
            return None  # one slice: the exact tokenization costs no more than counting would
        counted, num_cuts, start = 0, 0, 0
        while start < len(text):
            end = _cut(text, start, size)
            counted += len(encode(text[start:end]))
            if counted - num_cuts * TOKENS_PER_CUT_SLACK > self.max_tokens:
                return counted
            start, num_cuts = end, num_cuts + 1
        return None


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The context times the most characters one token can stand for: the longest vocabulary entry
    (byte-level entries are one character per byte, so at least its characters), times
    NORMALIZATION_SLACK when the tokenizer normalizes text before splitting it."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:  # a tokenizer that cannot list its vocabulary (bench stubs): no early refusal
        return sys.maxsize
    longest_token = max((len(piece) for piece in hf.get_vocab()), default=1)
    backend = getattr(hf, "backend_tokenizer", None)
    normalizes = backend is None or backend.normalizer is not None
    return max_model_len * max(longest_token, 1) * (NORMALIZATION_SLACK if normalizes else 1)


def _cut(text: str, start: int, size: int) -> int:
    """Where the slice from `start` ends: just before the last whitespace near `start + size` (where
    pre-tokenizers split anyway), else at `start + size`."""
    end = start + size
    if end >= len(text):
        return len(text)
    low = max(start + 1, end - CUT_SEARCH_CHARS)
    space = max(text.rfind(" ", low, end), text.rfind("\n", low, end))
    return space if space > start else end
