"""What the README's install paths rely on: serving and testing share one transformers version
(make test must not change what `make serve` runs), and the commands the README check runs are
the README's own."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def pins(lines: list[str]) -> dict[str, str]:
    found = {}
    for line in lines:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)==([^;\s]+)", line.split("#")[0])
        if m:
            found[m.group(1).lower()] = m.group(2)
    return found


def test_serving_and_tests_pin_the_same_transformers():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    test_pins = pins(project["optional-dependencies"]["test"])
    constraints = pins((ROOT / "constraints.txt").read_text().splitlines())
    assert constraints["transformers"] == test_pins["transformers"]
    makefile = (ROOT / "Makefile").read_text()
    assert makefile.count("-c $(CONSTRAINTS)") == 2  # both installs, serving and testing


def test_readme_documents_the_cpu_only_install_and_the_venv():
    readme = (ROOT / "README.md").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme
    assert "source .venv/bin/activate" in readme
    assert "scripts/readme_check.sh" in (ROOT / ".ci" / "run").read_text()
