"""verispec's subpackages import one way: no cycle between them, and the named layers point down
(server -> engine -> spec -> models -> kernels). Quantization sits beside them: `loading` calls
`quant` at load, which swaps quantized layers into a model (so quant imports models); models never
import quant, and kernels import neither. Every import counts, those inside functions too: a
deferred import is still a dependency."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import verispec

PACKAGE = Path(verispec.__file__).parent
# each layer may import only the ones after it (and anything that is not a layer)
LAYERS = ["server", "engine", "spec", "models", "kernels"]
# packages that must not import these
NOT_ABOVE = {"quant": {"server", "engine", "spec", "loading"}, "models": {"quant", "loading"},
             "kernels": {"quant", "models", "cache", "loading"}, "cache": {"server", "engine", "spec", "models"},
             "sampling": {"server", "engine", "spec", "models"}}


def unit_of(module: str) -> str:
    """verispec.x.y -> x (a subpackage or a top-level module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "verispec"


def import_graph() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the files that import it."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        source = unit_of(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "verispec":
                    names = [f"verispec.{alias.name}" for alias in node.names]
                elif node.module.startswith("verispec."):
                    names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if alias.name.startswith("verispec.")]
            for name in names:
                target = unit_of(name)
                if target != source:
                    graph[source][target].add(str(rel))
    return graph


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph, units: list[str]) -> str:
    return "; ".join(f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})"
                     for a in units for b in units if b in graph.get(a, {}))


def test_no_import_cycle_between_subpackages():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(describe(graph, c) for c in found)


def test_layers_import_downwards_only():
    graph = import_graph()
    upward = []
    for i, layer in enumerate(LAYERS):
        for above in LAYERS[:i]:
            if above in graph.get(layer, {}):
                upward.append(describe(graph, [layer, above]))
    for unit, forbidden in NOT_ABOVE.items():
        for above in forbidden:
            if above in graph.get(unit, {}):
                upward.append(describe(graph, [unit, above]))
    assert not upward, "imports against the layering: " + " | ".join(upward)


def test_the_checker_sees_a_cycle():
    """The test above can fail: a two-unit cycle and a deferred import are both found."""
    graph = {"a": {"b": {"a.py"}}, "b": {"a": {"b.py"}}, "c": {"a": {"c.py"}}}
    assert cycles(graph) == [["a", "b"]]
    tree = ast.parse("def f():\n    from verispec.engine import engine\n")
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imports and unit_of(imports[0].module) == "engine"
