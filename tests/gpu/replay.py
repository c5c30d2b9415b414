"""What the GPU identity tests share: the replay proposer (tests/doubles.py) and where two outputs part."""
from __future__ import annotations

from tests.doubles import KeyedReplay  # noqa: F401 - the GPU tests' replay proposer


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
