"""A byte vocabulary the size of a real model's, for measuring grammar masks on random-weight shapes.

`--shape` targets have no tokenizer, but a grammar's mask cost depends on the vocabulary (every
token's bytes are walked against the grammar), so `bench --json-schema` gives the shape a stand-in:
the 256 single bytes, then the most frequent 2- to 12-byte substrings of Python's standard library
source, cut where GPT-2's pre-tokenizer cuts (so like BPE merges they never span a word and the
punctuation after it), then two-word pieces until the shape's vocabulary size is reached. Greedy
longest-match encoding; decoding joins the tokens' bytes.
"""
from __future__ import annotations

import collections
import functools
import inspect
import re

from verispec.bench.build import StubTokenizer

MAX_TOKEN_BYTES = 12


def corpus_text(max_chars: int = 400_000) -> str:
    """Deterministic text: Python standard library source (the same on every machine)."""
    import argparse, collections, json, textwrap, string, functools  # noqa: E401

    parts = []
    for mod in (argparse, collections, json, textwrap, string, functools):
        try:
            parts.append(inspect.getsource(mod))
        except (OSError, TypeError):
            continue
    return "\n".join(parts)[:max_chars]


# GPT-2's pre-tokenizer split (letters, digits, punctuation runs, whitespace, each with one leading
# space): byte-level BPE merges never cross these boundaries, so neither do these tokens
_PRETOKEN = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""")


@functools.lru_cache(maxsize=4)
def _tokens(vocab_size: int) -> tuple[bytes, ...]:
    text = corpus_text(1_500_000)
    counts: collections.Counter[bytes] = collections.Counter()
    for piece in _PRETOKEN.findall(text):
        data = piece.encode("utf-8")
        for n in range(2, min(len(data), MAX_TOKEN_BYTES) + 1):
            counts.update(data[i:i + n] for i in range(len(data) - n + 1))
    tokens = [bytes([b]) for b in range(256)]
    tokens += [t for t, _ in counts.most_common(max(vocab_size - 257, 0))]
    n = len(tokens)
    # the corpus has fewer distinct pieces than a large vocabulary: the rest are two-word pieces
    words = [t for t, _ in counts.most_common() if t[:1] == b" " and t[1:].isalpha()][:2000]
    pairs = (a + b for a in words for b in words if len(a + b) <= 2 * MAX_TOKEN_BYTES)
    seen = set(tokens)
    for pair in pairs:
        if len(tokens) >= vocab_size - 1:
            break
        if pair not in seen:
            tokens.append(pair)
            seen.add(pair)
    return tuple(tokens[:vocab_size - 1]) + (b"",)  # the last id: EOS, no bytes


class ByteVocabularyTokenizer(StubTokenizer):
    """StubTokenizer plus real token bytes: the last id is the EOS."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.tokens = _tokens(vocab_size)
        self.eos_token_ids = [vocab_size - 1]
        self._ids = {t: i for i, t in enumerate(self.tokens)}

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.tokens[token_id]) if token_id < len(self.tokens) else []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        data, out, i = text.encode("utf-8"), [], 0
        while i < len(data):
            for n in range(min(2 * MAX_TOKEN_BYTES, len(data) - i), 0, -1):
                token = self._ids.get(data[i:i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.tokens[i] for i in ids if i < len(self.tokens) - 1).decode("utf-8", "replace")
