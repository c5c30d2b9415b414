"""Splits a thinking model's output into reasoning (inside <think>...</think>) and content.

Text arrives in arbitrary pieces, so a tag can be cut anywhere ("<th" + "ink>"); a piece's
tail that could still become the awaited tag is held back until the next piece decides it.
"""
from __future__ import annotations

from dataclasses import dataclass

from verispec.loading.tokenizer import THINK_CLOSE, THINK_OPEN


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningParser:
    def __init__(self, starts_in_reasoning: bool = False):
        # Eager think: the prompt already opened <think>, so output is reasoning from the first token.
        self.in_reasoning = starts_in_reasoning
        self._pending = ""  # a tail that may be the start of the tag we are waiting for

    def feed(self, text: str) -> ReasoningDelta:
        delta = ReasoningDelta()
        buffer = self._pending + text
        while True:
            tag = THINK_CLOSE if self.in_reasoning else THINK_OPEN
            idx = buffer.find(tag)
            if idx == -1:
                break
            self._emit(delta, buffer[:idx])
            self.in_reasoning = not self.in_reasoning
            buffer = buffer[idx + len(tag):]
        keep = _partial_tag_len(buffer, tag)
        self._emit(delta, buffer[:len(buffer) - keep])
        self._pending = buffer[len(buffer) - keep:]
        return delta

    def flush(self) -> ReasoningDelta:
        """At the end of generation: a held-back partial tag was just text after all."""
        delta = ReasoningDelta()
        self._emit(delta, self._pending)
        self._pending = ""
        return delta

    def _emit(self, delta: ReasoningDelta, text: str) -> None:
        if self.in_reasoning:
            delta.reasoning += text
        else:
            delta.content += text


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> ReasoningDelta:
    """The whole output at once (non-streaming responses)."""
    parser = ReasoningParser(starts_in_reasoning)
    delta = parser.feed(text)
    rest = parser.flush()
    return ReasoningDelta(delta.reasoning + rest.reasoning, delta.content + rest.content)


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
