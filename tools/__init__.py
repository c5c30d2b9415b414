"""Development tools beside the runtime, importable from tests and scripts, not shipped in the wheel
(pyproject packages verispec* only)."""
