"""Speculative greedy == plain greedy on CUDA for the Qwen3.5 hybrid (its MTP head) and Gemma 4
(EAGLE3, the assistant drafter), with CUDA graphs, in float32 and bfloat16; and the graphed plain
decode == the eager one.

The drafters are built by `Engine.load` as `--mtp` / `--eagle3` build them; random drafters are
rarely accepted (rejections), so a replay of the plain output wrong at every third slot adds partial
acceptance: recurrent-state selection and sliding-window KV rollback at each depth. In bfloat16 this
holds because the default numerics are exact: a verify pass's rows (M = k+1) are the bits of the
decode steps (M = 1) they stand for, so even the near-ties of these random models resolve alike.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.replay import KeyedReplay, first_divergence
from tools.tiny import (build_tiny_gemma4, build_tiny_gemma4_assistant, build_tiny_qwen3_5, corpus_text,
                        random_mtp_head, write_mtp_sidecar, write_random_eagle3)
from verispec.config import EngineConfig
from verispec.engine.engine import Engine
from verispec.sampling.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
NEW_TOKENS = 128
# family -> (case, EngineConfig fields), the proposer as `verispec serve` builds it; "replay" and
# "eager" are the test's own
CASES = {
    "qwen3_5": [("mtp-1", lambda root: dict(mtp=True, num_draft_tokens=1)),
                ("mtp-3", lambda root: dict(mtp=True, num_draft_tokens=3))],
    "gemma4": [("eagle3", lambda root: dict(eagle3=str(root / "gemma4-eagle3"), num_draft_tokens=3)),
               ("assistant", lambda root: dict(mtp=True, mtp_model=str(root / "gemma4-assistant"), num_draft_tokens=2))],
}
PARAMS = [pytest.param(family, dtype, case, id=f"{family}-{dtype}-{case}") for family, cases in CASES.items()
          for dtype in ("float32", "bfloat16") for case in ["eager", *(name for name, _ in cases), "replay"]]


@pytest.fixture(scope="module")
def root(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("gpu-families")
    qwen = build_tiny_qwen3_5(root / "qwen3_5", tokenizer_dir=tokenizer_dir)
    write_mtp_sidecar(root / "qwen3_5" / "mtp.safetensors", random_mtp_head(qwen.config.to_dict()))
    build_tiny_gemma4(root / "gemma4", tokenizer_dir=tokenizer_dir)
    gemma_config = json.loads((root / "gemma4" / "config.json").read_text())
    write_random_eagle3(root / "gemma4-eagle3", gemma_config, aux_layer_ids=[1, 2, 3])
    build_tiny_gemma4_assistant(root / "gemma4-assistant", gemma_config)
    return root


def config(root, family: str, dtype: str, **fields) -> EngineConfig:
    return EngineConfig(model=str(root / family), dtype=dtype, device=DEVICE, max_model_len=2048, max_num_seqs=4,
                        kv_cache_gb=0.5, **fields)


@pytest.fixture(scope="module")
def plain_outputs(root):
    """{(family, dtype): (prompts, the graphed plain engine's greedy outputs)}, computed once."""
    cache = {}

    def get(family: str, dtype: str):
        if (family, dtype) not in cache:
            engine = Engine.load(config(root, family, dtype))
            engine.capture_graphs()
            text = corpus_text()
            prompts = [engine.tokenizer.encode(text[i * 1500: i * 1500 + 300]) for i in range(3)]
            cache[(family, dtype)] = prompts, [engine.generate_all(p, greedy()).token_ids for p in prompts]
        return cache[(family, dtype)]
    return get


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family,dtype,case", PARAMS)
def test_speculative_and_eager_decoding_give_the_graphed_plain_output(root, plain_outputs, family, dtype, case):
    prompts, expected = plain_outputs(family, dtype)
    if case == "eager":  # recurrent state handling under graph replay must not change a token
        engine = Engine.load(config(root, family, dtype, cuda_graphs=False))
    elif case == "replay":
        base = Engine.load(config(root, family, dtype))
        continuations = {tuple(p): e for p, e in zip(prompts, expected)}
        engine = Engine(base.model, base.tokenizer, base.config, base.model_dir,
                        proposer=KeyedReplay(continuations, base.model.vocab_size, wrong_at=lambda i: i % 3 == 0),
                        num_drafts=4)
    else:
        fields = dict(CASES[family])[case](root)
        # a fixed schedule: the draft gate would rightly shut a random drafter off after a request or two
        engine = Engine.load(config(root, family, dtype, draft_schedule=f"1:{fields['num_draft_tokens']}", **fields))
        assert engine.proposer is not None
    engine.capture_graphs()
    chains = []  # a chained drafter's greedy rounds of 2+ drafts replay one graph for all its passes
    graphs = getattr(engine.proposer, "_graphs", None)
    if graphs is not None and hasattr(graphs, "chains"):
        whole_chain = graphs.chain
        graphs.chain = lambda batch, k: chains.append(k) or whole_chain(batch, k)
    divergences = []
    for ids, want in zip(prompts, expected):
        result = engine.generate_all(ids, greedy())
        divergences.append(first_divergence(want, result.token_ids))
        if case != "eager":
            assert result.stats.drafted > 0, "nothing was drafted"
    assert divergences == [None] * len(prompts), f"first divergences: {divergences}"
    if case in ("mtp-3", "eagle3"):
        assert chains, "no round replayed its chained drafts as one graph"
