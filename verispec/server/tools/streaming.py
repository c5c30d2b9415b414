"""Tool calls in a stream, as OpenAI streams them: content deltas until a call region opens, then
each call once it is complete: one delta with its index, id, type and name (arguments ""), then one
with its arguments. Text that may still become a call marker, and whitespace that may turn out to
separate content from a call, is held back until later text decides.

Every step re-parses the text seen so far with the non-streaming parser and sends what is new, so
the content and calls a stream assembles to are the non-streamed parse of the same text.
"""
from __future__ import annotations

from verispec.server.tools.calls import ToolCall
from verispec.server.tools.parsers import ToolFormat, assemble


class ToolStreamParser:
    def __init__(self, fmt: ToolFormat, tools: list[dict]):
        self.fmt, self.tools = fmt, tools
        self.text = ""
        self.region: int | None = None  # where the first call region starts, once seen
        self.content_sent = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """-> (content delta, tool_call deltas)."""
        self.text += text
        if self.region is None:
            start, hold = self.fmt.region_start(self.text)
            self.region = start
            if start is None and not final:
                return self._content(self.text[:hold].rstrip()), []
        if final:
            pieces = self.fmt.pieces(self.text, self.tools)
        else:
            upto = self.region + self.fmt.complete_upto(self.text[self.region:])
            pieces = self.fmt.pieces(self.text[:upto], self.tools)
            if isinstance(pieces[-1], str):
                pieces = pieces[:-1]  # text after the last finished call may still grow (or hold a call)
            if not any(isinstance(p, ToolCall) for p in pieces):
                return self._content(self.text[:self.region].rstrip()), []
        reply = assemble(pieces)
        deltas = []
        for call in reply.calls[self.num_calls:]:
            deltas += [{"index": self.num_calls, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}},
                       {"index": self.num_calls, "function": {"arguments": call.arguments}}]
            self.num_calls += 1
        return self._content(reply.content), deltas

    def _content(self, content: str) -> str:
        """The part of `content` (all content so far) not sent yet."""
        if not content.startswith(self.content_sent):  # cannot happen with prefix-stable parsers
            return ""
        delta = content[len(self.content_sent):]
        self.content_sent = content
        return delta
