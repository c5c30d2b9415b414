"""One parser per tool-call syntax: model output text -> content and tool calls, and the grammar
that forces a call in that syntax (tool_choice "required" or a named function).

Each parser splits the text into pieces, in order: strings (content) and ToolCalls. A call that does
not parse (bad JSON, no name, an unclosed block) stays in the content as written. Grammars are Lark
for llguidance; `lit` writes a marker as the special token it is in this vocabulary, or as text.
Formats (the chat template decides which one a model uses, select.py):
  hermes      <tool_call>{"name": ..., "arguments": {...}}</tool_call>           (Hermes, Qwen2.5/3)
  qwen3_xml   <tool_call><function=f><parameter=x>v</parameter></function></tool_call>  (Qwen3-Coder, 3.5)
  llama3_json {"name": ..., "parameters": {...}}, optionally after <|python_tag|>, "; "-separated
  mistral     [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  or  [TOOL_CALLS]f[ARGS]{...}
  gemma4      <|tool_call>call:f{key:<|"|>text<|"|>,n:3}<tool_call|>
"""
from __future__ import annotations

import json
import re
from typing import Callable, Union

from verispec.grammar.spec import lark_json, lark_literal
from verispec.server.tools.calls import ParsedReply, ToolCall
from verispec.server.tools.gemma_notation import gemma_value_rules, parse_gemma_object

Piece = Union[str, ToolCall]
Literal = Callable[[str], str]  # marker text -> a Lark expression matching it


def assemble(pieces: list[Piece]) -> ParsedReply:
    """Content is the text between calls, without the whitespace that separates it from a call."""
    content, calls = [], []
    for i, piece in enumerate(pieces):
        if isinstance(piece, ToolCall):
            calls.append(piece)
            continue
        if i > 0 and isinstance(pieces[i - 1], ToolCall):
            piece = piece.lstrip()
        if i + 1 < len(pieces) and isinstance(pieces[i + 1], ToolCall):
            piece = piece.rstrip()
        content.append(piece)
    return ParsedReply("".join(content), calls)


def _arguments(value) -> dict | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def _json_call(obj, args_keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": str, <args key>: object} -> a call (None when it is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in args_keys:
        if key in obj:
            args = _arguments(obj[key])
            return ToolCall.of(obj["name"], args) if args is not None else None
    return ToolCall.of(obj["name"], {})


def _call_schema(tool: dict, args_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                             args_key: tool.get("parameters") or {"type": "object"}},
            "required": ["name", args_key], "additionalProperties": False}


def _one_of_calls(tools: list[dict], args_key: str) -> dict:
    schemas = [_call_schema(t, args_key) for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


class ToolFormat:
    name = ""
    markers: tuple[str, ...] = ()  # text that opens a call; streaming holds text back from here

    def pieces(self, text: str, tools: list[dict]) -> list[Piece]:
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        return assemble(self.pieces(text, tools or []))

    def region_start(self, text: str) -> tuple[int | None, int]:
        """(where a call region starts or None, from where text must be held back as a possible start)."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if found:
            return min(found), min(found)
        hold = len(text)
        for marker in self.markers:
            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:k]):
                    hold = min(hold, len(text) - k)
                    break
        return None, hold

    def complete_upto(self, region: str) -> int:
        """Streaming: the length of the region's prefix whose calls are all finished (0: wait for the end)."""
        return 0

    def grammar(self, tools: list[dict], parallel: bool, lit: Literal) -> str:
        raise NotImplementedError


class _BlockFormat(ToolFormat):
    """Calls in open/close blocks; text between blocks is content."""

    block: re.Pattern

    def pieces(self, text: str, tools: list[dict]) -> list[Piece]:
        out: list[Piece] = []
        pos = 0
        for m in self.block.finditer(text):
            call = self.call(m, tools)
            if call is None:
                continue  # stays content
            out += [text[pos:m.start()], call]
            pos = m.end()
        out.append(text[pos:])
        return out

    def complete_upto(self, region: str) -> int:
        ends = [m.end() for m in self.block.finditer(region)]
        return ends[-1] if ends else 0

    def call(self, match: re.Match, tools: list[dict]) -> ToolCall | None:
        raise NotImplementedError


class HermesFormat(_BlockFormat):
    name = "hermes"
    markers = ("<tool_call>",)
    block = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def call(self, match, tools):
        try:
            return _json_call(json.loads(match.group(1)), ("arguments", "parameters"))
        except json.JSONDecodeError:
            return None

    def grammar(self, tools, parallel, lit):
        call = f'{lit("<tool_call>")} "\\n" {lark_json(_one_of_calls(tools, "arguments"))} "\\n" {lit("</tool_call>")}'
        return _repeated(call, '"\\n"', parallel, may_end_with_separator=True)


class Qwen3XmlFormat(_BlockFormat):
    name = "qwen3_xml"
    markers = ("<tool_call>",)
    block = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
    parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def call(self, match, tools):
        name = match.group(1).strip()
        schemas = next((t.get("parameters") or {} for t in tools if t.get("name") == name), {})
        props = schemas.get("properties") or {}
        args = {}
        body = match.group(2)
        if self.parameter.sub("", body).strip():
            return None  # text outside <parameter> blocks: not this format
        for p in self.parameter.finditer(body):
            key, raw = p.group(1).strip(), _strip_one_newline(p.group(2))
            args[key] = _typed_value(raw, props.get(key) or {})
        return ToolCall.of(name, args)

    def grammar(self, tools, parallel, lit):
        rules = []
        alternatives = []
        for i, tool in enumerate(tools):
            schema = tool.get("parameters") or {}
            props = schema.get("properties") or {}
            required = set(schema.get("required") or [])
            params = []
            for j, (key, sub) in enumerate(props.items()):
                value = _xml_text(sub) if (sub or {}).get("type") == "string" else f'{lark_json(sub or {})} "\\n"'
                rules.append(f'p{i}_{j}: {lark_literal(f"<parameter={key}>" + chr(10))} {value} "</parameter>\\n"')
                params.append(f"p{i}_{j}" + ("" if key in required else "?"))
            head = lark_literal(f"\n<function={tool['name']}>\n")
            alternatives.append(f'{lit("<tool_call>")} {head} {" ".join(params)} "</function>\\n" {lit("</tool_call>")}')
        rules.append("call: " + " | ".join(alternatives))
        return _repeated("call", '"\\n"', parallel, may_end_with_separator=True) + "\n" + "\n".join(rules)


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    markers = ("<|python_tag|>",)

    def region_start(self, text):
        stripped = text.lstrip()
        start = len(text) - len(stripped)
        if stripped.startswith("{") or stripped.startswith(self.markers[0]):
            return start, start
        if not stripped or self.markers[0].startswith(stripped):
            return None, start  # could still become a call
        return None, len(text)

    def pieces(self, text, tools):
        body = text.strip()
        if body.startswith(self.markers[0]):
            body = body[len(self.markers[0]):].lstrip()
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return [text]
            call = _json_call(obj, ("parameters", "arguments"))
            if call is None:
                return [text]
            calls.append(call)
            pos = end
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                pos = len(body) - len(rest) + 1
                while pos < len(body) and body[pos].isspace():
                    pos += 1
            elif rest:
                return [text]
        return calls if calls else [text]

    def grammar(self, tools, parallel, lit):
        return _repeated(lark_json(_one_of_calls(tools, "parameters")), '"; "', parallel)


class MistralFormat(ToolFormat):
    """`args_marker` set: the v11+ syntax ([TOOL_CALLS]name[ARGS]{...}, repeated); else a JSON list."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def __init__(self, args_marker: str | None = None):
        self.args_marker = args_marker

    def pieces(self, text, tools):
        start = text.find(self.markers[0])
        if start < 0:
            return [text]
        calls = self._calls(text[start:])
        return [text[:start], *calls] if calls else [text]

    def _calls(self, region: str) -> list[ToolCall] | None:
        decoder, calls = json.JSONDecoder(), []
        for part in region.split(self.markers[0])[1:]:
            part = part.strip()
            try:
                if self.args_marker and self.args_marker in part:
                    name, _, args = part.partition(self.args_marker)
                    obj, end = decoder.raw_decode(args.strip())
                    call = _json_call({"name": name.strip(), "arguments": obj}, ("arguments",))
                    found = [call] if call else None
                    rest = args.strip()[end:]
                else:
                    obj, end = decoder.raw_decode(part)
                    items = obj if isinstance(obj, list) else [obj]
                    found = [_json_call(o, ("arguments", "parameters")) for o in items]
                    rest = part[end:]
            except json.JSONDecodeError:
                return None
            if not found or any(c is None for c in found) or rest.strip():
                return None
            calls += found
        return calls

    def grammar(self, tools, parallel, lit):
        if self.args_marker:
            alternatives = " | ".join(f'{lark_literal(t["name"])} {lit(self.args_marker)} '
                                      f'{lark_json(t.get("parameters") or {"type": "object"})}' for t in tools)
            return _repeated(f'{lit(self.markers[0])} ({alternatives})', None, parallel)
        items = {"type": "array", "items": _one_of_calls(tools, "arguments"), "minItems": 1}
        if not parallel:
            items["maxItems"] = 1
        return f"start: {lit(self.markers[0])} {lark_json(items)}"


class Gemma4Format(_BlockFormat):
    name = "gemma4"
    markers = ("<|tool_call>",)
    block = re.compile(r"<\|tool_call>call:([A-Za-z0-9_.\-]+)(\{.*?\})<tool_call\|>", re.S)

    def call(self, match, tools):
        args = parse_gemma_object(match.group(2))
        return ToolCall.of(match.group(1), args) if args is not None else None

    def grammar(self, tools, parallel, lit):
        rules, alternatives = [], []
        for i, tool in enumerate(tools):
            body = gemma_value_rules(tool.get("parameters") or {"type": "object"}, f"t{i}", rules, lit)
            alternatives.append(f'{lit("<|tool_call>")} {lark_literal("call:" + tool["name"])} {body} '
                                f'{lit("<tool_call|>")}')
        rules.append("call: " + " | ".join(alternatives))
        return _repeated("call", None, parallel) + "\n" + "\n".join(rules)


def _repeated(call: str, separator: str | None, parallel: bool, may_end_with_separator: bool = False) -> str:
    """One call, or calls joined by `separator`. may_end_with_separator: the separator (a newline)
    may also close the output, since a model ends its line after a call as often as it starts
    another: without it, that newline would force a further call."""
    if not parallel:
        return f"start: {call}"
    sep = f"{separator} " if separator else ""
    end = f" {separator}?" if separator and may_end_with_separator else ""
    return f"start: {call} ({sep}{call})*{end}"


def _xml_text(schema: dict) -> str:
    """A string parameter's text and its closing newline (no '<': it would start </parameter>),
    as long as the schema allows."""
    low, high = int(schema.get("minLength") or 0), schema.get("maxLength")
    return f"/[^<]{{{low},{int(high)}}}\\n/" if high is not None else f"/[^<]{{{low},}}\\n/"


def _strip_one_newline(text: str) -> str:
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _typed_value(raw: str, schema: dict):
    """An XML parameter's text -> its value: strings as written, anything else read as JSON if it is."""
    if schema.get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


FORMATS = {f.name: f for f in (HermesFormat(), Qwen3XmlFormat(), Llama3JsonFormat(), MistralFormat(), Gemma4Format())}
