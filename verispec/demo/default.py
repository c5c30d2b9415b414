"""The embedded demo model: what `verispec serve` / `generate` run when no `-m` is given.

It lives in `verispec/demo/model` (shipped as package data), built by
`scripts/train_demo_model.py` (`make demo-model`). Its `demo.json` names the speculation it
runs with by default, chosen by measurement when it was built (see its README.md).
"""
from __future__ import annotations

import json
from pathlib import Path

from verispec.errors import VerispecError

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "model"
DEMO_MODEL_NAME = "verispec-demo"


def demo_model_dir() -> Path | None:
    return DEMO_MODEL_DIR if (DEMO_MODEL_DIR / "config.json").is_file() else None


def require_demo_model() -> Path:
    model_dir = demo_model_dir()
    if model_dir is None:
        raise VerispecError(f"no -m MODEL given and the embedded demo model is not built ({DEMO_MODEL_DIR} has no "
                            "config.json): build it with `make demo-model` (python scripts/train_demo_model.py, "
                            "about 10 minutes on a GPU), or pass -m with a model directory or hub id")
    return model_dir


def speculation_defaults(model_dir: Path, device_type: str | None = None) -> dict:
    """EngineConfig fields for the model's default speculation (from its demo.json), or {}.

    demo.json may name a default per device type (`speculation_by_device`: {"cuda": .., "cpu": ..}),
    since what pays differs: on a GPU a drafter step is a few captured kernels, on a CPU it costs
    compute in proportion to its size; `speculation` is the default for any other device."""
    path = Path(model_dir) / "demo.json"
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise VerispecError(f"{path} is not valid JSON: {exc}") from exc
    spec = (record.get("speculation_by_device") or {}).get(device_type) or record.get("speculation") or {}
    method = spec.get("method")
    if method == "mtp" and (Path(model_dir) / "mtp.safetensors").is_file():
        return {"mtp": True, "num_draft_tokens": int(spec.get("mtp_depth", 1))}
    if method == "eagle3" and (Path(model_dir) / spec.get("eagle3", "eagle3") / "config.json").is_file():
        return {"eagle3": str(Path(model_dir) / spec.get("eagle3", "eagle3")),
                "num_draft_tokens": int(spec.get("draft_block", 2))}
    return {}


def default_device_type(device: str | None) -> str:
    """The device type an engine given `device` (None: automatic) runs on."""
    if device:
        return device.split(":")[0]
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_config(model_dir: Path, **overrides):
    """The EngineConfig `verispec serve` uses for the demo model (its default speculation on)."""
    from verispec.config import EngineConfig

    fields = dict(speculation_defaults(model_dir, default_device_type(overrides.get("device"))))
    fields.update(overrides)
    return EngineConfig(model=str(model_dir), **fields)
