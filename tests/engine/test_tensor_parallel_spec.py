"""Speculation under tensor parallelism (CPU, gloo, 2 processes): with each proposer, a model split
over two ranks gives the output the whole model gives with the same proposer (greedy tokens and
logprobs, seeded samples; float64), and its greedy tokens are the plain whole model's, in a mixed
batch that hits the prefix cache. Drafters run on rank 0 alone (engine/proposers.py).

One split engine is loaded per target (starting a worker costs seconds); the other proposers run
as engines over the same ranks, one at a time (each tells the workers its own cache pools).
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from tests.doubles import KeyedReplay
from tests.engine.test_tensor_parallel import ENGINE, assert_same, prompts, run
from tools.tiny import write_random_eagle3
from verispec.engine.engine import Engine, load_engine
from verispec.engine.proposers import build_proposer

# every round drafts (the adaptive default may draft nothing on a CPU)
SPEC = dict(draft_schedule="1:3", num_draft_tokens=3)


def over_same_ranks(loaded: Engine, proposer=None, **changes) -> Engine:
    """An engine over `loaded`'s model (and ranks) with another proposer: `proposer`, or the one
    the changed flags make load_engine build."""
    config = dataclasses.replace(loaded.config, **changes)
    num_drafts = SPEC["num_draft_tokens"]
    if proposer is None:
        proposer, num_drafts = build_proposer(config, loaded.model, loaded.model_dir, loaded.tokenizer)
    return Engine(loaded.model, loaded.tokenizer, config, loaded.model_dir, proposer=proposer, num_drafts=num_drafts,
                  peers=loaded.peers)


def replay(results: list, vocab: int) -> KeyedReplay:
    """Drafts each prompt's known output, every third draft wrong: rounds accept some and reject
    the rest (a recurrent layer's state is then committed mid-pass)."""
    first, second = prompts(vocab)
    known = {tuple(p): r.token_ids for p, r in zip(first + second, results)}
    return KeyedReplay(known, vocab, wrong_at=lambda i: i % 3 == 2)


def greedy_tokens(results: list) -> list:
    return [r.token_ids for r in results if r.logprobs is not None]  # run()'s greedy requests ask for logprobs


@pytest.fixture(scope="module")
def eagle3_dir(qwen3_dir, tmp_path_factory):
    """Shares the target's embedding (rank 0 then reads a whole copy of it), draft ids offset."""
    config = json.loads((qwen3_dir / "config.json").read_text())
    return write_random_eagle3(tmp_path_factory.mktemp("tp-eagle3") / "d", config, seed=2, with_embedding=False,
                               d2t_offset_stride=3, layer_type="qwen3", aux_layer_ids=[0, 1, 1])


def speculate_whole_and_split(model_dir, first: dict, others: dict) -> None:
    """Each proposer (`first`'s and `others`' flags, then a replay double) on the whole model and on
    two ranks: the same outputs, greedy ones the plain whole model's."""
    whole = load_engine(str(model_dir), **ENGINE)
    vocab = whole.model.vocab_size
    plain = run(whole, vocab)
    kinds = {**first, **others, "replay": {}}
    expected, got, drafted = {}, {}, {}
    for name, flags in kinds.items():
        engine = over_same_ranks(whole, replay(plain, vocab) if name == "replay" else None, **SPEC, **flags)
        expected[name] = run(engine, vocab)
        engine.shutdown()
        assert greedy_tokens(expected[name]) == greedy_tokens(plain), name
    [(first_name, first_flags)] = first.items()
    split = load_engine(str(model_dir), tensor_parallel_size=2, **ENGINE, **SPEC, **first_flags)
    try:
        for name, flags in kinds.items():
            off = {key: None for key in first_flags}  # the first proposer's flags, off for the others
            engine = split if name == first_name else over_same_ranks(
                split, replay(plain, vocab) if name == "replay" else None, **{**off, **flags})
            got[name] = run(engine, vocab)
            drafted[name] = sum(r.stats.drafted for r in got[name]), sum(r.stats.accepted for r in got[name])
            assert engine.prefix_cache_stats()["hits"] >= 2
            engine.shutdown()
    finally:
        split.close()
    for name in kinds:
        assert drafted[name][0] > 0, name  # the rounds verified drafts
        assert_same(expected[name], got[name])
    assert 0 < drafted["replay"][1] < drafted["replay"][0]  # some accepted, some not


def test_every_model_free_proposer_and_eagle3_split(qwen3_dir, eagle3_dir):
    speculate_whole_and_split(qwen3_dir, {"eagle3": dict(eagle3=str(eagle3_dir))},
                              {"suffix": dict(suffix=True), "ngram": dict(ngram=True, ngram_min=1)})
