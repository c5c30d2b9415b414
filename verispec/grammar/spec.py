"""What a request constrains its output to, as an llguidance grammar: checked, never compiled here.

A `GrammarSpec` is built at the edge (server or Python API) from a JSON schema, "any JSON object" or
a Lark grammar (tool calls wrap JSON in a model family's call syntax). The engine compiles one matcher
per sequence from it (constraint.py). Unsupported schema features are a 400 naming the feature.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from verispec.errors import InvalidRequestError
from verispec.grammar.satisfiable import unsatisfiable_ref

# json.dumps' default layout (", " and ": "), no other whitespace: what models saw most in training,
# and bounded (a flexible-whitespace grammar lets a weak model emit blank lines until max_tokens).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class GrammarSpec:
    """An llguidance grammar (its JSON form) and a short description for logs and errors."""

    grammar: str
    description: str
    param: str = "response_format"  # the request field an error in this grammar names


def json_schema_grammar(schema: dict, param: str = "response_format") -> GrammarSpec:
    import llguidance

    if not isinstance(schema, dict):
        raise InvalidRequestError(f"'{param}': a JSON schema must be an object, got {type(schema).__name__}",
                                  param=param)
    endless = unsatisfiable_ref(schema)
    if endless is not None:
        raise InvalidRequestError(
            f"'{param}': no finite JSON value satisfies this schema: '{endless}' requires itself without end "
            "(a required property, or an array of minItems >= 1, that refers back to it); make the "
            "recursion optional", param=param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
    except ValueError as exc:
        raise InvalidRequestError(f"'{param}': the JSON schema is not valid: {exc}", param=param) from exc
    return GrammarSpec(grammar, "json_schema", param)


def json_object_grammar(param: str = "response_format") -> GrammarSpec:
    spec = json_schema_grammar(ANY_JSON_OBJECT, param)
    return GrammarSpec(spec.grammar, "json_object", param)


def lark_grammar(lark: str, description: str, param: str) -> GrammarSpec:
    import llguidance

    return GrammarSpec(llguidance.LLMatcher.grammar_from_lark(lark), description, param)


def lark_json(schema: dict) -> str:
    """A Lark rule body matching JSON valid under `schema`, in the layout above."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT}, separators=(",", ":"))


def lark_literal(text: str) -> str:
    """A Lark string literal for `text` (JSON escaping is Lark's)."""
    return json.dumps(text)
