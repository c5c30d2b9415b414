"""Schemas whose `$ref` recursion has no way out are found; every schema with a finite value passes."""
from __future__ import annotations

import jsonschema
import pytest

from verispec.grammar.satisfiable import unsatisfiable_ref

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}
ENDLESS = [
    ({"$ref": "#"}, "#"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#"),
    ({"$defs": {"n": NODE}, "$ref": "#/$defs/n"}, "#/$defs/n"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#"),
    ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
      "$ref": "#/$defs/a"}, "#/$defs/a"),
]
FINITE = [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, {}),
    ({"type": "array", "items": {"$ref": "#"}}, []),
    ({"$defs": {"t": {"type": "object", "required": ["kids"], "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"}, {"kids": []}),
    ({"$defs": {"e": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"$ref": "#/$defs/e"}},
                                                    "required": ["x"]}]}}, "$ref": "#/$defs/e"}, None),
    # the way out is found only after the reference that uses it
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}, {"type": "string"}]},
                "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
      "$ref": "#/$defs/b"}, {"a": "x"}),
    ({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}, {"name": "x"}),
]


@pytest.mark.parametrize("schema, ref", ENDLESS)
def test_endless_recursion_is_found(schema, ref):
    assert unsatisfiable_ref(schema) == ref


@pytest.mark.parametrize("schema, instance", FINITE)
def test_schemas_with_a_finite_value_pass(schema, instance):
    jsonschema.validate(instance, schema)  # the oracle: a finite value exists
    assert unsatisfiable_ref(schema) is None


def test_deep_schema_is_left_to_llguidance():
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    assert unsatisfiable_ref(deep) is None
