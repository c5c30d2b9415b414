"""Fixtures for speculative-decoding tests: tiny targets, EAGLE3 drafters, proposer doubles."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.doubles import KeyedReplay
from tools.tiny import write_random_eagle3
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3
from verispec.cache.kv import KVCache
from verispec.spec.proposer import Proposer

TARGET_SHAPE = dict(num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2)


class ReplayProposer(KeyedReplay):
    """Proposes a known continuation: the target's own greedy output (always right), or that
    output with every token changed (always wrong), or right only where `right_at(i)` says."""

    def __init__(self, continuation: list[int], vocab_size: int, right_at=lambda i: True):
        super().__init__(continuation, vocab_size, wrong_at=lambda i: not right_at(i))


def spec_engine(base: Engine, proposer: Proposer, num_drafts: int, adaptive: bool = False) -> Engine:
    """A second engine over the same loaded target, speculating with `proposer`: num_drafts drafts
    every round (what verification is tested with), or adaptive: up to num_drafts, chosen per
    sequence per round by cost and acceptance (the engine's default)."""
    config = base.config if adaptive else replace(base.config, draft_schedule=f"1:{num_drafts}")
    return Engine(base.model, base.tokenizer, config, base.model_dir, proposer=proposer, num_drafts=num_drafts)


def greedy(max_tokens: int = 64, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def assert_greedy_identity(engines, cases, new_tokens: int, method: str | None = None) -> tuple[int, int]:
    """Each (label, speculative engine) of `engines` gives every (prompt ids, plain greedy tokens)
    case its plain tokens (and reports `method`, when given). Returns (accepted, drafted) drafts
    over them all, for the caller to check that verification took both branches."""
    accepted = drafted = 0
    for label, spec in engines:
        for i, (ids, expected) in enumerate(cases):
            result = spec.generate_all(ids, greedy(new_tokens))
            assert result.token_ids == expected, f"{label} case {i}"
            assert method is None or result.stats.method == method
            accepted += result.stats.accepted
            drafted += result.stats.drafted
    return accepted, drafted


@pytest.fixture(scope="session")
def targets(tiny_models) -> dict[str, Engine]:
    dirs = {
        "llama": tiny_models.get("spec-llama", "llama", **TARGET_SHAPE),
        "qwen2": tiny_models.get("spec-qwen2", "qwen2", tie_word_embeddings=True, **TARGET_SHAPE),
        "qwen3": tiny_models.get("spec-qwen3", "qwen3", head_dim=16, **TARGET_SHAPE),
    }
    return {name: load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=16)
            for name, d in dirs.items()}


@pytest.fixture(scope="session")
def eagle3_dirs(tmp_path_factory, targets) -> dict[tuple[str, str], Path]:
    """Random drafters per target: 'full' (own embedding, full draft vocab, llama layer) and
    'offset' (shared embedding, every 3rd id so d2t offsets are non-trivial, qwen3 layer)."""
    root = tmp_path_factory.mktemp("eagle3")
    out = {}
    for name, engine in targets.items():
        cfg = json.loads((engine.model_dir / "config.json").read_text())
        out[(name, "full")] = write_random_eagle3(root / f"{name}-full", cfg, seed=1)
        out[(name, "offset")] = write_random_eagle3(root / f"{name}-offset", cfg, seed=2, d2t_offset_stride=3,
                                                    with_embedding=False, layer_type="qwen3",
                                                    aux_layer_ids=[1, 3, 4], norm_before_residual=False)
    return out


def eagle3_proposer(engine: Engine, drafter_dir: Path) -> Eagle3Proposer:
    return Eagle3Proposer(load_eagle3(drafter_dir, engine.model), engine.model.vocab_size)


PROMPTS = [
    "def fibonacci(n):",
    "import collections\n\nclass Counter(dict):\n    def __init__(self, iterable=None, /, **kwds):\n        super().__init__()",
    "x",
]


@pytest.fixture(scope="session")
def prompt_ids(targets) -> list[list[int]]:
    tok = next(iter(targets.values())).tokenizer
    return [tok.encode(p) for p in PROMPTS]


def train_drafter(engine: Engine, proposer: Eagle3Proposer, prompts: list[list[int]], steps: int = 150,
                  new_tokens: int = 48, seed: int = 0) -> None:
    """Fit an EAGLE3 drafter to its target's greedy continuations (first-draft loss only), so tests
    have a real drafter that is accepted part of the time, not a random one that never is."""
    drafter = proposer.drafter
    sequences = []
    for ids in prompts:
        cont = engine.generate_all(ids, greedy(new_tokens)).token_ids
        sequences.append(ids + cont)
    torch.manual_seed(seed)
    trainable = [p for n, p in drafter.named_parameters() if n != "d2t"]
    for p in trainable:
        p.requires_grad_(True)
    opt = torch.optim.Adam(trainable, lr=3e-3)
    target_to_draft = {int(t): d for d, t in enumerate(proposer.draft_to_target.tolist())}
    batches = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            cache = engine.model.make_cache(len(seq))
            out = engine.model(ids, torch.arange(len(seq))[None], cache, proposer.capture_layers)
            aux = [a[:, :-2] for a in out.aux]  # each [1, n-2, H]
            # row p pairs token p+1 with the feature at p and predicts token p+2
            labels = [target_to_draft.get(t, -100) for t in seq[2:]]
            batches.append((ids[:, 1:-1], aux, torch.tensor(labels)))
    for step in range(steps):
        tokens, aux, labels = batches[step % len(batches)]
        cache = KVCache(drafter.cache_specs(), tokens.shape[1] + 1, aux[0].dtype, aux[0].device)
        positions = torch.arange(tokens.shape[1])[None]
        _, logits = drafter(tokens, drafter.project(aux), positions, cache)
        loss = torch.nn.functional.cross_entropy(logits[0].float(), labels, ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in trainable:
        p.requires_grad_(False)
