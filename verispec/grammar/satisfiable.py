"""Whether a JSON schema admits any finite JSON value, for schemas whose `$ref`s recurse.

llguidance compiles `{"properties": {"next": {"$ref": "#"}}, "required": ["next"]}` without
complaint, but every value must then nest without end: the constrained output stops after `{"` and
reports `finish_reason: "stop"`. Such a schema is refused up front instead.

It is the productive-symbol computation of a context-free grammar: a schema is satisfiable when one
of its alternatives is, and an alternative needs every required property (and the first
`minItems` items) satisfiable; a `$ref` is as satisfiable as its target, found by iterating from
"none is" until nothing changes. Only what can be decided for sure is refused: a keyword or
reference this does not model counts as satisfiable, and llguidance judges the rest.
"""
from __future__ import annotations

from typing import Any

PRIMITIVE_TYPES = frozenset({"string", "number", "integer", "boolean", "null"})


def unsatisfiable_ref(schema: Any) -> str | None:
    """The first `$ref` reached from the root whose schema no finite value satisfies, when that makes
    the whole schema unsatisfiable ("#" for the root itself); None when a value exists (or it cannot tell)."""
    solver = _Solver(schema)
    try:
        solver.solve()
        solver.first_failing = None  # recorded again, now under the final values
        if solver.satisfiable(schema):
            return None
    except RecursionError:  # a schema nested deeper than Python recurses: llguidance judges it
        return None
    return solver.first_failing or "#"


class _Solver:
    def __init__(self, root: Any):
        self.root = root
        self.known: dict[str, bool] = {}  # local $ref -> satisfiable, under the current assumptions
        self.first_failing: str | None = None

    def solve(self) -> None:
        """Kleene iteration: every reference starts unsatisfiable and turns satisfiable once its schema
        is under the others' current values; monotone, so it ends within one pass per reference."""
        self.satisfiable(self.root)  # discovers the references reachable from the root
        while True:
            before = (len(self.known), sum(self.known.values()))
            for ref in list(self.known):
                if not self.known[ref] and self.satisfiable(self._resolve(ref)):
                    self.known[ref] = True
            if (len(self.known), sum(self.known.values())) == before:  # a new reference may have appeared
                return

    def satisfiable(self, node: Any) -> bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True  # not a schema: not ours to judge
        if "const" in node or "enum" in node:
            return bool(node.get("enum", [None]))
        ref = node.get("$ref")
        if isinstance(ref, str) and not self._ref_satisfiable(ref):
            return False
        all_of = node.get("allOf")
        if isinstance(all_of, list) and not all(self.satisfiable(s) for s in all_of):
            return False
        for key in ("anyOf", "oneOf"):
            options = node.get(key)
            if isinstance(options, list) and options and not any(self.satisfiable(s) for s in options):
                return False
        types = node.get("type")
        if types is None:
            return True  # untyped: a primitive value satisfies object and array keywords
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list):
            return True
        return any(self._type_satisfiable(t, node) for t in types)

    def _type_satisfiable(self, name: Any, node: dict) -> bool:
        if name == "object":
            properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            required = node.get("required") if isinstance(node.get("required"), list) else []
            return all(self.satisfiable(properties[key]) for key in required
                       if isinstance(key, str) and key in properties)
        if name == "array":
            min_items = node.get("minItems", 0)
            if not isinstance(min_items, int) or min_items <= 0:
                return True
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            if not all(self.satisfiable(s) for s in prefix[:min_items]):
                return False
            return min_items <= len(prefix) or self.satisfiable(node.get("items", True))
        return True  # primitives (and names this does not know: llguidance's to judge)

    def _ref_satisfiable(self, ref: str) -> bool:
        if not ref.startswith("#") or self._resolve(ref) is None:
            return True  # remote or unresolvable: llguidance reports those itself
        if ref not in self.known:
            self.known[ref] = False
            if self.satisfiable(self._resolve(ref)):
                self.known[ref] = True
        if not self.known[ref] and self.first_failing is None:
            self.first_failing = ref
        return self.known[ref]

    def _resolve(self, ref: str) -> Any:
        """A local JSON pointer ("#", "#/$defs/node") -> its schema, or None."""
        node = self.root
        pointer = ref[1:]
        if not pointer:
            return node
        if not pointer.startswith("/"):
            return None  # an anchor name: not modelled
        for part in pointer[1:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node
