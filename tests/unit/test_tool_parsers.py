"""Each tool-call parser on hand-written model outputs of its format: one call, two calls, text
around calls (stays content), malformed calls (stay content, as written); and streaming: any split
of the text into pieces assembles to exactly the non-streamed parse."""
from __future__ import annotations

import json
import random

import pytest

from verispec.server.tools.parsers import FORMATS, MistralFormat
from verispec.server.tools.select import tool_format
from verispec.server.tools.streaming import ToolStreamParser

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}
TOOLS = [WEATHER, {"name": "noop", "parameters": {"type": "object", "properties": {}}}]
TWO = [("get_weather", {"city": "Paris, FR", "days": 3}), ("noop", {})]

# (format, output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, FR", "days": 3}}\n</tool_call>',
     "", TWO[:1]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, FR", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>', "Let me check.", TWO),
    ("hermes", 'A <tool_call>{"name": "noop", "arguments": {</tool_call> B', 'A <tool_call>{"name": "noop", '
               '"arguments": {</tool_call> B', []),
    ("hermes", 'x <tool_call>\n{"name": "noop", "arguments": {}}', 'x <tool_call>\n{"name": "noop", "arguments": {}}', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("qwen3_xml", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, FR\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=noop>\n"
                  "</function>\n</tool_call>", "Sure.", TWO),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\n3\n</parameter>\n<parameter=metric>\n"
                  "true\n</parameter>\n</function>\n</tool_call>", "",
     [("get_weather", {"city": "3", "metric": True})]),  # typed by the schema: a string stays a string
    ("qwen3_xml", "<tool_call>\n<function=noop>\nstray text\n</function>\n</tool_call>",
     "<tool_call>\n<function=noop>\nstray text\n</function>\n</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris, FR", "days": 3}}', "", TWO[:1]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris, FR", "days": 3}}; '
                    '{"name": "noop", "parameters": {}}', "", TWO),
    ("llama3_json", 'The answer is {"name": "noop", "parameters": {}}', 'The answer is {"name": "noop", '
                    '"parameters": {}}', []),
    ("llama3_json", '{"name": "noop", "parameters": {}} and more', '{"name": "noop", "parameters": {}} and more', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris, FR", "days": 3}}, '
                '{"name": "noop", "arguments": {}}]', "", TWO),
    ("mistral", 'On it. [TOOL_CALLS][{"name": "noop", "arguments": {}}]', "On it.", [("noop", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "noop", "arguments": {}', '[TOOL_CALLS][{"name": "noop", "arguments": {}', []),
    ("mistral_v11", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris, FR", "days": 3}[TOOL_CALLS]noop[ARGS]{}', "", TWO),
    ("mistral_v11", '[TOOL_CALLS]noop[ARGS]{"x": ', '[TOOL_CALLS]noop[ARGS]{"x": ', []),
    ("gemma4", 'Checking.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3}<tool_call|>'
               '<|tool_call>call:noop{}<tool_call|>', "Checking.", TWO),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>a<|"|>,tags:[true,1.5,"x"],o:{k:null}}<tool_call|>', "",
     [("get_weather", {"city": "a", "tags": [True, 1.5, "x"], "o": {"k": None}})]),
    ("gemma4", '<|tool_call>call:noop{city:<|"|>unclosed}<tool_call|> tail',
     '<|tool_call>call:noop{city:<|"|>unclosed}<tool_call|> tail', []),
]


def fmt_of(name: str):
    return MistralFormat("[ARGS]") if name == "mistral_v11" else FORMATS[name]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse(name, text, content, calls):
    reply = fmt_of(name).parse(text, TOOLS)
    assert reply.content == content
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == calls
    assert len({c.id for c in reply.calls}) == len(calls)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_stream_assembles_to_the_parse(name, text, content, calls):
    fmt = fmt_of(name)
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 16))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream = ToolStreamParser(fmt, TOOLS)
        got_content, deltas = "", []
        for i, piece in enumerate(pieces):
            c, d = stream.feed(piece, final=i == len(pieces) - 1)
            got_content += c
            deltas += d
        assert got_content == content, pieces
        # OpenAI's order: a call's first delta has id, type and name (arguments ""), then arguments
        assembled: dict[int, dict] = {}
        for d in deltas:
            entry = assembled.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert entry["name"] is None and d["type"] == "function" and d["function"]["arguments"] == ""
                entry["name"] = d["function"]["name"]
            else:
                assert entry["name"] is not None
                entry["arguments"] += d["function"]["arguments"]
        assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(assembled.items())] == calls


def test_calls_stream_before_the_reply_ends():
    """A finished block is sent at once, not at the end of the generation."""
    stream = ToolStreamParser(FORMATS["hermes"], TOOLS)
    assert stream.feed("Hi ") == ("Hi", [])
    content, deltas = stream.feed('<tool_call>{"name": "noop", "arguments": {}}</tool_call>')
    assert content == "" and [d["function"].get("name") for d in deltas] == ["noop", None]


@pytest.mark.parametrize("template,expected", [
    ("{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>\n{{ tc.name }}</tool_call>", "hermes"),
    ("{{ tools }}<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>\n", "qwen3_xml"),
    ("{{ tools }}<|python_tag|>{{ '{\"name\": ' }}", "llama3_json"),
    ("{{ tools }}[TOOL_CALLS]{{ calls | tojson }}", "mistral"),
    ("{{ tools }}<|tool_call>call:{{ name }}{<tool_call|>", "gemma4"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # no tool syntax: the Hermes default
])
def test_template_picks_the_parser(template, expected):
    fmt, renders = tool_format(template)
    assert fmt.name == expected
    assert renders == ("tools" in template)
    assert isinstance(tool_format("{{ tools }}[TOOL_CALLS]f[ARGS]{}")[0], MistralFormat)
    assert tool_format("{{ tools }}[TOOL_CALLS]f[ARGS]{}")[0].args_marker == "[ARGS]"
