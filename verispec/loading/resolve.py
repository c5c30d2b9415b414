"""Model id -> local directory.

Order: an existing local directory (with config.json, or holding one .gguf file: then the file's
path is returned), a .gguf file; a packaged model id (packaged.py: `smollm2`); then
VERISPEC_MODEL_CACHE (flat `org/name`, `models/org/name`, or hub-cache layout
`models--org--name/snapshots/*`); then the Hugging Face cache (HF_HUB_CACHE,
HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub); then a download with
huggingface_hub when the hub is reachable. Missing everywhere: one error naming every place.
"""
from __future__ import annotations

import re
from pathlib import Path

from verispec import log
from verispec.config import EnvSettings, env
from verispec.errors import ModelNotFoundError
from verispec.loading.gguf import find_gguf, is_gguf
from verispec.loading.packaged import packaged_model_path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def _is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _hub_cache_snapshot(root: Path, model_id: str) -> Path | None:
    repo = root / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text().strip()
        if _is_model_dir(pinned):
            return pinned
    candidates = sorted((p for p in snapshots.iterdir() if _is_model_dir(p)),
                        key=lambda p: p.stat().st_mtime, reverse=True)
    return candidates[0] if candidates else None


def hf_cache_roots(settings: EnvSettings) -> list[Path]:
    roots: list[Path] = []
    if settings.hf_hub_cache:
        roots.append(Path(settings.hf_hub_cache))
    if settings.hf_home:
        roots.append(Path(settings.hf_home) / "hub")
    if settings.xdg_cache_home:
        roots.append(Path(settings.xdg_cache_home) / "huggingface" / "hub")
    roots.append(Path.home() / ".cache" / "huggingface" / "hub")
    seen, unique = set(), []
    for r in roots:
        if r not in seen:
            seen.add(r)
            unique.append(r)
    return unique


def resolve_model(model_id: str, allow_download: bool = True) -> Path:
    settings = env()
    looked: list[str] = []
    local = Path(model_id).expanduser()
    if _is_model_dir(local):
        return local.resolve()
    if is_gguf(local):
        return local.resolve()
    looked.append(f"local path {local}")
    if local.exists() and local.is_dir():
        gguf_file = find_gguf(local)
        if gguf_file is not None:
            return gguf_file.resolve()
        raise ModelNotFoundError(f"{local} is a directory but has no config.json or .gguf file: not a model "
                                 "checkpoint", param="model")
    if local.suffix.lower() == ".gguf":
        raise ModelNotFoundError(f"GGUF file {local} does not exist", param="model")
    packaged = packaged_model_path(model_id)
    if packaged is not None:
        return packaged
    if not HUB_ID.match(model_id):
        raise ModelNotFoundError(
            f"model '{model_id}' not found: it is neither a local model directory nor a hub id "
            "of the form org/name", param="model")

    if settings.model_cache:
        root = Path(settings.model_cache)
        for candidate in (root / model_id, root / "models" / model_id):
            if _is_model_dir(candidate):
                return candidate
            looked.append(str(candidate))
        snap = _hub_cache_snapshot(root, model_id)
        if snap:
            return snap
        looked.append(f"{root} (hub-cache layout)")

    for root in hf_cache_roots(settings):
        snap = _hub_cache_snapshot(root, model_id)
        if snap:
            return snap
        looked.append(str(root))

    if allow_download and not settings.hf_offline:
        target_root = Path(settings.model_cache) if settings.model_cache else hf_cache_roots(settings)[0]
        try:
            return _download(model_id, target_root)
        except Exception as exc:  # network errors come in many types; report the cause in one line
            looked.append(f"download from the hub ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
    else:
        looked.append("download skipped (offline)")
    raise ModelNotFoundError(f"model '{model_id}' not found; looked in: " + "; ".join(looked), param="model")


def _download(model_id: str, cache_root: Path) -> Path:
    from huggingface_hub import snapshot_download

    log.info("downloading %s into %s", model_id, cache_root)
    path = snapshot_download(
        repo_id=model_id, cache_dir=str(cache_root),
        allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"],
    )
    return Path(path)
