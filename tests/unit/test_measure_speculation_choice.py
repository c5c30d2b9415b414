"""scripts/measure_speculation.py's choice of a device's default: the fastest configuration whose
greedy output equals plain greedy's on every prompt, plain if none beats it."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from measure_speculation import choose_default  # noqa: E402


def row(config: str, tok_s: float, identical: str = "16/16") -> dict:
    return {"config": config, "decode_tok_per_s": tok_s, "identical_to_plain_greedy": identical,
            "device": "cpu (2 threads, float16)"}


def test_fastest_exact_configuration_wins():
    choice, why = choose_default([row("plain", 20), row("eagle3-2", 30), row("eagle3-3", 35, "15/16")], 16, 64)
    assert choice == {"method": "eagle3", "draft_block": 2}
    assert "eagle3-2 30" in why and "not chosen" not in why


def test_a_faster_inexact_configuration_is_never_chosen():
    choice, why = choose_default([row("plain", 20), row("eagle3-3", 28, "13/16")], 16, 64)
    assert choice == {"method": "none"}
    assert "not chosen" in why and "13/16" in why and "float16" in why


def test_plain_when_nothing_beats_it():
    choice, _ = choose_default([row("plain", 20), row("eagle3-1", 18)], 16, 64)
    assert choice == {"method": "none"}
