"""A parsed tool call and a parsed reply, as the OpenAI API returns them."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @classmethod
    def of(cls, name: str, arguments: dict) -> "ToolCall":
        return cls(name, json.dumps(arguments, ensure_ascii=False))

    def message_field(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    content: str
    calls: list[ToolCall] = field(default_factory=list)
