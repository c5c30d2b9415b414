"""Gemma 4's call arguments: `{key:<|"|>text<|"|>,n:3,flags:[true,false],inner:{a:1}}` — bare keys,
strings between `<|"|>` quote tokens, JSON numbers / booleans / null, nested lists and objects.

`parse_gemma_object` reads that notation into Python (None when it is not well formed);
`gemma_value_rules` writes Lark rules that produce it for a JSON schema (required properties in
their declared order; strings cannot contain '<' under the grammar; integer ranges of up to 256
values are exact, wider ones are at most 18 digits; number bounds are not enforced).
"""
from __future__ import annotations

import json
import re

from verispec.grammar.spec import lark_literal

QUOTE = '<|"|>'
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")


class _Reader:
    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def peek(self, s: str) -> bool:
        return self.text.startswith(s, self.pos)

    def expect(self, s: str) -> None:
        if not self.peek(s):
            raise ValueError(f"expected {s!r} at {self.pos}")
        self.pos += len(s)

    def value(self):
        if self.peek(QUOTE):
            end = self.text.find(QUOTE, self.pos + len(QUOTE))
            if end < 0:
                raise ValueError("unclosed string")
            out = self.text[self.pos + len(QUOTE):end]
            self.pos = end + len(QUOTE)
            return out
        if self.peek('"'):
            out, self.pos = json.JSONDecoder().raw_decode(self.text, self.pos)
            return out
        if self.peek("{"):
            return self.object()
        if self.peek("["):
            self.expect("[")
            items = []
            while not self.peek("]"):
                items.append(self.value())
                if not self.peek("]"):
                    self.expect(",")
            self.expect("]")
            return items
        for word, value in (("true", True), ("false", False), ("null", None)):
            if self.peek(word):
                self.pos += len(word)
                return value
        m = _NUMBER.match(self.text, self.pos)
        if not m:
            raise ValueError(f"no value at {self.pos}")
        self.pos = m.end()
        return json.loads(m.group(0))

    def object(self) -> dict:
        self.expect("{")
        out = {}
        while not self.peek("}"):
            if self.peek(QUOTE):
                key = self.value()
            else:
                m = _KEY.match(self.text, self.pos)
                if not m:
                    raise ValueError(f"no key at {self.pos}")
                key, self.pos = m.group(0), m.end()
            self.expect(":")
            out[key] = self.value()
            if not self.peek("}"):
                self.expect(",")
        self.expect("}")
        return out


def parse_gemma_object(text: str) -> dict | None:
    reader = _Reader(text.strip())
    try:
        out = reader.object()
    except (ValueError, json.JSONDecodeError):
        return None
    return out if reader.pos == len(reader.text) else None


def gemma_value_rules(schema: dict, name: str, rules: list[str], lit) -> str:
    """A Lark expression for a value of `schema` in Gemma's notation; helper rules go to `rules`."""
    quote = lit(QUOTE)
    if "enum" in schema:
        options = [f"{quote} {lark_literal(v)} {quote}" if isinstance(v, str) else lark_literal(json.dumps(v))
                   for v in schema["enum"]]
        return "(" + " | ".join(options) + ")"
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        required = [k for k in props if k in set(schema.get("required") or [])]
        parts = []
        for j, key in enumerate(required):
            value = gemma_value_rules(props[key] or {}, f"{name}_{j}", rules, lit)
            parts.append(("\",\" " if j else "") + f"{lark_literal(key + ':')} {value}")
        return '"{" ' + " ".join(parts) + ' "}"'
    if kind == "array":
        item = gemma_value_rules(schema.get("items") or {}, f"{name}_item", rules, lit)
        rules.append(f"{name}: {item}")
        return f'"[" ({name} ("," {name})*)? "]"'
    if kind == "integer":
        return _integer(schema)
    if kind == "number":
        return r"/-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?/"
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "null":
        return '"null"'
    low, high = int(schema.get("minLength") or 0), schema.get("maxLength")
    length = f"{{{low},{int(high)}}}" if high is not None else f"{{{low},}}"
    return f"{quote} /[^<]{length}/ {quote}"  # strings, and anything the schema leaves open


MAX_ENUMERATED_INTEGERS = 256


def _integer(schema: dict) -> str:
    """A small range is written out value by value (exact); a larger one is digits, bounded in length."""
    low, high = schema.get("minimum"), schema.get("maximum")
    if isinstance(low, int) and isinstance(high, int) and 0 <= high - low < MAX_ENUMERATED_INTEGERS:
        return "(" + " | ".join(lark_literal(str(v)) for v in range(low, high + 1)) + ")"
    sign = "" if isinstance(low, int) and low >= 0 else "-?"
    return f"/{sign}[0-9]{{1,18}}/"
