"""The package layers point one way: quant -> kernels, models -> kernels, loading -> quant -> models;
kernels import neither quant nor models, and models do not import quant (the loader swaps quantized
layers in). Imports are read with `ast`, function-level ones included, so a lazy import counts.

`python tests/unit/test_import_layers.py` prints every cycle between verispec's subpackages."""
from __future__ import annotations

import ast
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "verispec"
# build tools that compile quantized kernels offline, not imported by the package's own code
TOOLS = {"verispec/kernels/offline_sass.py"}


def subpackage(module: str) -> str:
    """verispec.quant.kernels.frag -> quant; verispec.cli -> cli."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The verispec modules a file imports anywhere in it (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "verispec" or name.startswith("verispec.")}


def sources() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if str(p.relative_to(ROOT.parent)) not in TOOLS]


def package_graph() -> dict[str, set[str]]:
    """Subpackage -> the subpackages it imports (itself left out)."""
    graph: dict[str, set[str]] = {}
    for path in sources():
        source = subpackage(module_name(path))
        targets = {subpackage(name) for name in imports_of(path) if name.count(".") >= 1}
        graph.setdefault(source, set()).update(targets - {source})
    return graph


def edges_from(graph: dict[str, set[str]], source: str) -> dict[str, list[str]]:
    """For each subpackage `source` imports, the files that do it (to name them in a failure)."""
    out: dict[str, list[str]] = {}
    for path in sources():
        if subpackage(module_name(path)) != source:
            continue
        for name in imports_of(path):
            target = subpackage(name)
            file = str(path.relative_to(ROOT.parent))
            if name.count(".") >= 1 and target != source and file not in out.get(target, []):
                out.setdefault(target, []).append(file)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle (as a list of subpackages, smallest name first), by brute force: a
    few dozen nodes."""
    found = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in graph.get(node, ()):
            if nxt == start:
                found.add(tuple(path))
            elif nxt not in path and nxt > start:
                walk(start, nxt, path + [nxt])

    for start in graph:
        walk(start, start, [start])
    return sorted(list(c) for c in found)


def test_kernels_import_neither_quant_nor_models():
    imported = edges_from(package_graph(), "kernels")
    assert not {k: v for k, v in imported.items() if k in ("quant", "models")}


def test_models_do_not_import_quant():
    assert "quant" not in edges_from(package_graph(), "models")


def test_no_cycle_through_quant_kernels_or_models():
    graph = package_graph()
    bad = [c for c in cycles(graph) if {"quant", "kernels", "models"} & set(c)]
    assert not bad, bad


def test_the_graph_sees_function_level_imports():
    # loading/model_loader.py imports quant inside functions only
    assert "quant" in edges_from(package_graph(), "loading")


if __name__ == "__main__":
    graph = package_graph()
    for source in sorted(graph):
        print(f"{source:10} -> {', '.join(sorted(graph[source])) or '-'}")
    found = cycles(graph)
    print(f"\n{len(found)} cycles between subpackages")
    for cycle in found:
        print("  " + " -> ".join(cycle + [cycle[0]]))
    for a, b in itertools.combinations(sorted(graph), 2):
        if b in graph[a] and a in graph[b]:
            print(f"  two-way: {a} <-> {b}: {edges_from(graph, a).get(b)} / {edges_from(graph, b).get(a)}")
    sys.exit(0)
