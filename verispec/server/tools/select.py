"""Which tool-call syntax a model uses, read from its chat template (the template writes the calls of
earlier turns in the syntax the model was trained to produce).

A template with no tool syntax at all gets Hermes-style calls (the most widely trained format): the
tools are described to the model in a system message (tools_preamble), and a debug line says so.
"""
from __future__ import annotations

import json

from verispec import log
from verispec.server.tools.parsers import FORMATS, MistralFormat, ToolFormat


def tool_format(template: str | None) -> tuple[ToolFormat, bool]:
    """(the format, whether the template renders tools itself)."""
    template = template or ""
    renders_tools = "tools" in template
    if "<function=" in template and "<parameter=" in template:
        return FORMATS["qwen3_xml"], renders_tools
    if "<|tool_call>" in template:
        return FORMATS["gemma4"], renders_tools
    if "[TOOL_CALLS]" in template:
        return (MistralFormat("[ARGS]") if "[ARGS]" in template else FORMATS["mistral"]), renders_tools
    if "<tool_call>" in template:
        return FORMATS["hermes"], renders_tools
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return FORMATS["llama3_json"], renders_tools
    log.debug("the chat template has no tool-call syntax%s: using Hermes-style <tool_call> calls",
              "" if renders_tools else " and does not render tools; they are described in a system message")
    return FORMATS["hermes"], False


def tools_preamble(tools: list[dict]) -> str:
    """The Hermes / Qwen system text that tells a model its tools and the call syntax."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
