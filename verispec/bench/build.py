"""What a benchmark runs on: random-weight targets and drafters built on the device, or a checkpoint.

Random weights are created directly on the device (meta -> to_empty -> normal_): an 8B model
never passes through host memory, and speed does not depend on the values.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.loading.random_weights import RandomWeights, init_random_, random_model
from verispec.models.base import CausalLM


@dataclass
class Target:
    model: CausalLM
    tokenizer: object  # verispec Tokenizer, or StubTokenizer for random shapes
    config: dict  # config.json fields
    name: str  # the shape name or the -m argument
    model_dir: Path | None = None  # a checkpoint's directory (None: random weights)
    peers: object = None  # tensor parallelism: the other ranks (engine/tp_peers.py); `model` is rank 0's share

    @property
    def random(self) -> bool:
        return self.model_dir is None


class StubTokenizer:
    """Random-weight shapes have no tokenizer: the engine only needs eos ids, a vocabulary size
    and a cheap decode (placeholder text; the real detokenization cost is not measured)."""

    eos_token_ids: list[int] = []
    has_chat_template = False

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]


def random_target(name: str, config: dict, device: torch.device, dtype: torch.dtype, seed: int = 0,
                  tensor_parallel_size: int = 1) -> Target:
    """A shape's random-weight model; over N ranks, each rank draws its own share's weights."""
    source = RandomWeights(name, dict(config), seed)
    if tensor_parallel_size == 1:
        return Target(random_model(source, device, dtype), StubTokenizer(int(config["vocab_size"])), dict(config), name)
    from verispec.config import EngineConfig
    from verispec.engine.loading import load_sharded

    engine_config = EngineConfig(model=name, device=device.type, tensor_parallel_size=tensor_parallel_size,
                                 dtype=str(dtype).removeprefix("torch."))
    model, peers = load_sharded(engine_config, source, dtype)
    return Target(model, StubTokenizer(model.vocab_size), dict(config), name, peers=peers)


def load_target(model: str, device: torch.device, dtype: torch.dtype, tensor_parallel_size: int = 1) -> Target:
    from verispec.loading.model_loader import load_model, read_config
    from verispec.loading.resolve import resolve_model
    from verispec.loading.tokenizer import Tokenizer

    model_dir = resolve_model(model)
    peers = None
    if tensor_parallel_size == 1:
        loaded = load_model(model_dir, dtype, device)
    else:
        from verispec.config import EngineConfig
        from verispec.engine.loading import load_sharded

        config = EngineConfig(model=model, device=device.type, tensor_parallel_size=tensor_parallel_size,
                              dtype=str(dtype).removeprefix("torch."))
        loaded, peers = load_sharded(config, model_dir, dtype)
    return Target(loaded, Tokenizer.from_dir(model_dir), read_config(model_dir), model, model_dir, peers)


def shared_tables(target: Target) -> CausalLM:
    """What a drafter reads the target's embedding and head from: the target, or, split over
    ranks, random whole tables on rank 0 (models/drafter_tables.py)."""
    if target.peers is None:
        return target.model
    from verispec.models.drafter_tables import WholeTables

    param = next(target.model.parameters())
    with torch.device("meta"):
        tables = WholeTables(target.model)
    tables.to(param.dtype)
    tables.to_empty(device=param.device)
    init_random_(tables)
    return tables.eval().requires_grad_(False)


def random_eagle3(target: Target, drafter_config: dict, with_embedding: bool, seed: int = 1):
    """A random EAGLE3 drafter of the given speculators config, built on the target's device."""
    from verispec.spec.eagle3 import Eagle3Config, Eagle3Drafter

    param = next(target.model.parameters())
    cfg = Eagle3Config(drafter_config, target.model, Path("<random EAGLE3 drafter>"))
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg, has_embedding=with_embedding, fc_bias=False)
    drafter.to(param.dtype)
    drafter.to_empty(device=param.device)
    init_random_(drafter, seed)
    drafter.d2t.zero_()  # draft id i is target id i
    if not with_embedding:
        drafter.__dict__["shared_embedding"] = shared_tables(target).input_embeddings()
    drafter.eval().requires_grad_(False)
    return drafter


def random_mtp_head(target: Target, seed: int = 1):
    """A random MTP head of the target's shape (Qwen3.5 / 3.6), built on the target's device."""
    from verispec.spec.mtp import MtpHead

    param = next(target.model.parameters())
    with torch.device("meta"):
        head = MtpHead(target.model.settings, shared_tables(target))
    head.to(param.dtype)
    head.to_empty(device=param.device)
    init_random_(head, seed)
    return head.eval().requires_grad_(False)
