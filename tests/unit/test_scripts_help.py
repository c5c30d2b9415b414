"""Every tool in scripts/ answers --help: exits 0 and prints its usage, without doing its work.
Parametrized over the directory, so a new script is covered by being added."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh"))


def test_scripts_are_only_python_and_shell():
    others = [p.name for p in (ROOT / "scripts").iterdir() if p.suffix not in (".py", ".sh") and p.name != "__pycache__"]
    assert not others, others


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_answers_help(script: Path):
    command = [sys.executable, str(script)] if script.suffix == ".py" else ["bash", str(script)]
    # this checkout's verispec and tools first (the venv may hold an installed copy of another)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower(), done.stdout[-2000:]
