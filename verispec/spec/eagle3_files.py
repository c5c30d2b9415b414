"""Where an EAGLE3 drafter directory keeps its config: checked with the flags, before anything
loads, by code that must not import the models (engine/options.py)."""
from __future__ import annotations

from pathlib import Path

from verispec.errors import VerispecError


def eagle3_config_path(drafter_dir: str | Path) -> Path:
    """The drafter directory's config.json; a one-line error where there is none (checked before
    the target loads, and again when the drafter does)."""
    where = Path(drafter_dir).expanduser()
    if not (where / "config.json").is_file():
        raise VerispecError(f"--eagle3 {where}: no config.json there (expected a speculators EAGLE3 directory)")
    return where / "config.json"
