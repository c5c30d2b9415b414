"""What the GPU identity tests share: the replay proposer (tests/doubles.py) and where two outputs part."""
from __future__ import annotations

from tests.doubles import KeyedReplay  # noqa: F401 - the GPU tests' replay proposer
from tests.exact_checks import first_divergence  # noqa: F401 - where two outputs part
