"""Safetensors checkpoints: single file or sharded with an index, plus sidecars."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from verispec.errors import VerispecError
from verispec.models.layers.parallel import ShardSpec


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise VerispecError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise VerispecError(f"checkpoint shards listed in {index} are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(model_dir.glob("model-*.safetensors"))
    if shards:
        return shards
    raise VerispecError(f"no safetensors weights in {model_dir} (expected model.safetensors or an index)")


def iter_tensors(files: list[Path], device: str | torch.device = "cpu",
                 part_of: Callable[[str], ShardSpec | None] | None = None,
                 only: Callable[[str], bool] | None = None, reopen: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint (those `only` accepts, when given); with `part_of` (a
    tensor-parallel rank's load), a tensor it names a part of is read as that part alone
    (safetensors reads only those bytes), padded to the rank's size. reopen: each tensor read from
    the file opened anew, so one tensor's pages of the mapped file are resident at a time, not the
    whole file's by the end (a CPU load's peak; for files of a few large tensors)."""
    if reopen and part_of is None:
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                names = [name for name in sf.keys() if only is None or only(name)]
            for name in names:
                with safe_open(str(f), framework="pt", device=str(device)) as sf:
                    yield name, sf.get_tensor(name)
        return
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as sf:
            for name in sf.keys():
                if only is not None and not only(name):
                    continue
                spec = part_of(name) if part_of is not None else None
                if spec is None:
                    yield name, sf.get_tensor(name)
                else:
                    piece = sf.get_slice(name)
                    yield name, spec.read(piece, len(piece.get_shape()))


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, read from the safetensors headers (no tensor data)."""
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes
