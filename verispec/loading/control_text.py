"""Client text in a chat prompt stays text: a control token's spelling inside a message or a tool
(e.g. "<|im_start|>" in user content) is tokenized as ordinary characters, never as the control
token, so a client cannot forge a system turn. The template's own control tokens stay special.

How: before the template renders, each control-token spelling in the client's strings is replaced
by a sentinel the client cannot predict (private-use characters around a random nonce). The
rendered text is split at the sentinels; the template's pieces are tokenized as usual and each
sentinel's original spelling with special tokens disabled. Requests without such text pay one
regex search per string.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

SENTINEL_OPEN, SENTINEL_CLOSE = "\ue000", "\ue001"  # private use: no template writes these


def control_spellings(hf_tokenizer) -> list[str]:
    """The texts that the tokenizer turns into special (control) tokens, longest first."""
    decoder = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
    spellings = {token.content for token in decoder.values() if getattr(token, "special", False) and token.content}
    return sorted(spellings, key=len, reverse=True)


def control_pattern(hf_tokenizer) -> re.Pattern | None:
    """One pattern matching any control spelling (longest first), compiled once per tokenizer: a
    request's compile cost more than its search. None: the tokenizer has none."""
    spellings = control_spellings(hf_tokenizer)
    return re.compile("|".join(map(re.escape, spellings))) if spellings else None


class ControlTextMask:
    """One prompt's client strings with every control-token spelling swapped for a sentinel."""

    def __init__(self, pattern: re.Pattern | None):
        self._pattern = pattern  # control_pattern's
        # sentinel i is OPEN nonce ":" i CLOSE; found with str.split, not a regex compiled per nonce
        self._opening = f"{SENTINEL_OPEN}{secrets.token_hex(8)}:"
        self.originals: list[str] = []  # the spelling behind sentinel i

    @property
    def found(self) -> bool:
        return bool(self.originals)

    def mask(self, value: Any) -> Any:
        """`value` (strings inside dicts and lists, as messages and tools are) with sentinels in place of
        control spellings; values without any are returned as they are."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self._pattern.sub(self._swap, value) if self._pattern.search(value) else value
        if isinstance(value, dict):
            return {key: self.mask(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mask(item) for item in value]
        return value

    def _swap(self, match: re.Match) -> str:
        self.originals.append(match.group(0))
        return f"{self._opening}{len(self.originals) - 1}{SENTINEL_CLOSE}"

    def _pieces(self, rendered: str) -> list:
        """The rendered text split at the sentinels: text, index, text, index, ..., text."""
        first, *rest = rendered.split(self._opening)
        pieces: list = [first]
        for part in rest:
            index, _, text = part.partition(SENTINEL_CLOSE)
            pieces += [int(index), text]
        return pieces

    def unmask(self, rendered: str) -> str:
        """The rendered prompt as the client's text reads (sentinels back to their spellings)."""
        return "".join(piece if i % 2 == 0 else self.originals[piece]
                       for i, piece in enumerate(self._pieces(rendered)))

    def encode(self, rendered: str, hf_tokenizer) -> list[int]:
        """Token ids of the rendered prompt: template pieces with special tokens on, the client's control
        spellings with them off (as plain characters)."""
        ids: list[int] = []
        for i, piece in enumerate(self._pieces(rendered)):
            if i % 2 == 0:
                if piece:
                    ids += hf_tokenizer.encode(piece, add_special_tokens=False)
            else:
                ids += hf_tokenizer.encode(self.originals[piece], add_special_tokens=False,
                                           split_special_tokens=True)
        return ids


@dataclass
class MaskedPrompt:
    """A chat prompt rendered from masked client strings."""

    rendered: str  # as the template wrote it, sentinels included
    mask: ControlTextMask

    @property
    def text(self) -> str:
        """The prompt as the client's text reads."""
        return self.mask.unmask(self.rendered) if self.mask.found else self.rendered
