"""The request fields tools / tool_choice / parallel_tool_calls / response_format -> a ToolPlan: what the
chat template renders, how the output is parsed, and the grammar (if any) the output must follow.

Every malformed value is a 400 naming the field (OpenAI's shapes: tools[i].function.name, ...).
tool_choice "required" or a named function constrains the output to a call in the model's own
syntax whose arguments follow the tool's parameter schema; response_format json_object / json_schema
constrains it to JSON. The two constraints together are refused: one output cannot be both.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from verispec.grammar.spec import GrammarSpec, json_object_grammar, json_schema_grammar, lark_grammar, lark_literal
from verispec.server.errors import invalid_request
from verispec.server.tools.parsers import ToolFormat
from verispec.server.tools.select import tool_format, tools_preamble

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's function-name rule (plus '.')
TOOL_CHOICES = ("none", "auto", "required")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


@dataclass
class ToolPlan:
    functions: list[dict]  # the tools' function objects (name, description, parameters)
    fmt: ToolFormat | None = None  # parse the output for calls in this syntax (None: tool_choice "none")
    grammar: GrammarSpec | None = None
    preamble: str | None = None  # system text describing the tools, for a template that does not render them
    render: bool = True  # the tools reach the prompt (not with tool_choice "none")

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template's `tools` gets (OpenAI's tool objects, as transformers expects)."""
        if not self.render or self.preamble:
            return None
        return [{"type": "function", "function": f} for f in self.functions]


def check_tools(tools) -> list[dict]:
    """tools -> their function objects; raises a 400 naming the first bad field."""
    if not isinstance(tools, list):
        raise invalid_request(f"'tools' must be a list of tool objects, got {type(tools).__name__}", param="tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid_request(f"'{where}' must be an object with \"type\": \"function\" (the only tool type "
                                  "served)", param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid_request(f"'{where}.function' must be an object with a name", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise invalid_request(f"'{where}.function.name' must be 1 to 64 letters, digits, '_', '-' or '.', got "
                                  f"{name!r}", param=f"{where}.function.name")
        if name in names:
            raise invalid_request(f"'{where}.function.name': the tool name {name!r} is given twice",
                                  param=f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise invalid_request(f"'{where}.function.parameters' must be a JSON schema of type \"object\"",
                                  param=f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise invalid_request(f"'{where}.function.description' must be a string",
                                  param=f"{where}.function.description")
        functions.append({k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None})
    return functions


def _forced_functions(tool_choice, functions: list[dict]) -> list[dict] | None:
    """The functions a call is forced among (None: no call forced); raises on a bad tool_choice."""
    if tool_choice is None or tool_choice == "auto" or tool_choice == "none":
        return None
    if tool_choice == "required":
        return functions
    if isinstance(tool_choice, str):
        raise invalid_request(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}, got " + repr(tool_choice),
                              param="tool_choice")
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise invalid_request("'tool_choice' as an object must be {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", param="tool_choice")
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise invalid_request(f"'tool_choice' names the function {name!r}, which is not among the tools "
                              f"({', '.join(f['name'] for f in functions)})", param="tool_choice")
    return chosen


def plan_tools(tools, tool_choice, parallel_tool_calls: bool | None, template: str | None,
               marker, check=None) -> ToolPlan | None:
    """`marker(text)` writes a call marker as Lark (a special token where it is one); `check(spec)`
    raises a 400 on a grammar the grammar library does not support."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise invalid_request("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    functions = check_tools(tools)
    forced = _forced_functions(tool_choice, functions)
    if tool_choice == "none":  # the model is not shown the tools, so it cannot call one
        return ToolPlan(functions, render=False)
    fmt, renders = tool_format(template)
    plan = ToolPlan(functions, fmt, preamble=None if renders else tools_preamble(tools))
    if forced is not None:
        for i, fn in enumerate(functions):  # each schema the grammar embeds must be one llguidance takes
            if fn in forced and fn.get("parameters") is not None and check is not None:
                check(json_schema_grammar(fn["parameters"], param=f"tools[{i}].function.parameters"))
        # a named function is one call, as OpenAI answers it; "required" may make several
        parallel = parallel_tool_calls is not False and tool_choice == "required"
        plan.grammar = lark_grammar(fmt.grammar(forced, parallel, marker), f"{fmt.name} tool call", "tools")
    return plan


def plan_response_format(response_format) -> GrammarSpec | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise invalid_request(f"'response_format.type' must be one of {', '.join(RESPONSE_FORMATS)}, got "
                              f"{kind!r}", param="response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise invalid_request("'response_format.json_schema.schema' must be a JSON schema object",
                              param="response_format.json_schema.schema")
    return json_schema_grammar(schema, param="response_format.json_schema.schema")


def special_token_marker(tokenizer):
    """Lark for a marker: `<[id]>` where the marker is one special token (e.g. Mistral's [TOOL_CALLS],
    which no text spells), a string literal otherwise."""
    special = set(tokenizer.hf.all_special_ids) | {
        i for i, t in getattr(tokenizer.hf, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}

    def marker(text: str) -> str:
        ids = tokenizer.encode(text)
        return f"<[{ids[0]}]>" if len(ids) == 1 and ids[0] in special else lark_literal(text)

    return marker


def template_messages(messages: list[dict], plan: ToolPlan | None) -> list[dict]:
    """Assistant tool_calls carry arguments as JSON text (OpenAI); templates index them as objects.
    A template that does not render tools gets them in a system message."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m = dict(m, tool_calls=[_call_for_template(c) for c in calls])
        out.append(m)
    if plan is not None and plan.preamble:
        if out and out[0].get("role") == "system":
            out[0] = dict(out[0], content=f"{out[0].get('content') or ''}\n\n{plan.preamble}")
        else:
            out.insert(0, {"role": "system", "content": plan.preamble})
    return out


def _call_for_template(call):
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            return call
        return dict(call, function=dict(fn, arguments=args))
    return call
