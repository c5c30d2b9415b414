"""Tiny Qwen3.5 checkpoints with MTP heads for the MTP tests (test_mtp_head.py, test_mtp_identity.py,
test_mtp_cli.py): the same random head inside the model's safetensors (as the original Qwen
releases ship them), as a Hugging Face-convention sidecar and as an MLX-convention sidecar (norms
stored as 1 + w, metadata format=mlx), and the helpers those tests share. Test modules import the
fixtures `mtp_dirs` and `plain` from here."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.spec.conftest import greedy
from tools.tiny import build_tiny_qwen3_5, random_mtp_head, write_mtp_sidecar
from verispec.cache.kv import KVCache
from verispec.engine.engine import Engine, load_engine
from verispec.spec.mtp import load_mtp_head

NEW_TOKENS = 48
PREFILL_STEP = 16  # the longer prompts span several chunks: the head's cache fills chunk by chunk
PROMPTS = [
    "def fibonacci(n):",
    "import collections\n\nclass Counter(dict):\n    def __init__(self, iterable=None, /, **kwds):",
    "x",
]
SOURCES = ("shards", "hf-sidecar", "mlx-sidecar")


def add_to_shard(model_dir: Path, extra: dict) -> None:
    """Rewrite model.safetensors with `extra` tensors added (as a checkpoint that ships the head)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update(extra)
    save_file(tensors, str(path), metadata={"format": "pt"})


def strip_head(tensors: dict) -> dict:
    return {k[len("mtp."):]: v for k, v in tensors.items()}


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """The same target and the same head in each place a head can be, the target without a head
    ("none"), and a multimodal-layout target with its own head ("wrapper")."""
    root = tmp_path_factory.mktemp("mtp")
    base = root / "none"
    build_tiny_qwen3_5(base, seed=21, tokenizer_dir=tokenizer_dir)
    text_config = json.loads((base / "config.json").read_text())
    head = random_mtp_head(text_config, seed=5)
    dirs = {"none": base}
    for name in SOURCES + ("declared-mlx",):
        dirs[name] = root / name
        shutil.copytree(base, dirs[name])
    add_to_shard(dirs["shards"], head)
    write_mtp_sidecar(dirs["hf-sidecar"] / "mtp.safetensors", head)
    write_mtp_sidecar(dirs["mlx-sidecar"] / "mtp.safetensors", head, mlx=True)
    # an MTPLX-style checkpoint: the config declares the sidecar (which a torch tool saved: no MLX metadata)
    declared = dirs["declared-mlx"]
    sidecar = write_mtp_sidecar(declared / "extra" / "head.safetensors", head, mlx=True)
    save_file(load_file(str(sidecar)), str(sidecar), metadata={"format": "pt"})
    config = dict(text_config, mlx_lm_extra_tensors={"mtp_file": "extra/head.safetensors", "mtp_tensor_count": 15})
    (declared / "config.json").write_text(json.dumps(config))
    # the multimodal layout of the real releases: text under model.language_model.*, head at top-level mtp.*
    wrapper = root / "wrapper"
    build_tiny_qwen3_5(wrapper, wrapper=True, seed=22, tokenizer_dir=tokenizer_dir, tie_word_embeddings=True)
    add_to_shard(wrapper, random_mtp_head(json.loads((wrapper / "config.json").read_text())["text_config"], seed=6))
    dirs["wrapper"] = wrapper
    return dirs


@pytest.fixture(scope="module")
def plain(mtp_dirs):
    """The target in float64 (no argmax near-ties), its prompts and plain greedy outputs."""
    engine = load_engine(str(mtp_dirs["none"]), dtype="float64", device="cpu", prefill_step_size=PREFILL_STEP)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outputs = [engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompts]
    return engine, prompts, outputs


def head_for(engine: Engine, model_dir: Path):
    head = load_mtp_head(model_dir, engine.model)
    assert head is not None
    return head


def sequence_logits(head, engine: Engine, ids: list[int]) -> torch.Tensor:
    """The head's logits [n-1, V] over a whole sequence from scratch: row i pairs h_i with ids[i+1]."""
    with torch.no_grad():
        h = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None], engine.model.make_cache(len(ids))).hidden
        cache = KVCache(head.cache_specs(), len(ids), h.dtype, h.device)
        rows = head(torch.tensor([ids[1:]]), h[:, :-1], torch.arange(len(ids) - 1)[None], cache)
        return head.logits(rows)[0]


def run_cli(*commands: list[str]) -> list[tuple[int, str, str]]:
    """Run `verispec ARGS` commands side by side (each is mostly interpreter start-up);
    returns (exit status, stdout, stderr) for each."""
    procs = [subprocess.Popen([sys.executable, "-m", "verispec", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
             for args in commands]
    outputs = [p.communicate() for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs)]

