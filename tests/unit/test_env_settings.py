"""Switches read from the environment: defaults, and what turns them off or on."""
from __future__ import annotations

import pytest

from verispec.config import env


@pytest.mark.parametrize("name,field,default", [("VERISPEC_FLA", "use_fla", True),
                                                ("VERISPEC_DEBUG", "debug", False)])
def test_flags_default_and_toggle(monkeypatch, name, field, default):
    monkeypatch.delenv(name, raising=False)
    assert getattr(env(), field) is default
    monkeypatch.setenv(name, "0")
    assert getattr(env(), field) is False
    monkeypatch.setenv(name, "1")
    assert getattr(env(), field) is True
