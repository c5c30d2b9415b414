"""A sequence's output inside a batch == its output alone, token for token (float64, CPU).

The batch mixes what a server sees at once: prompts of different lengths (several prefill
chunks, and prompt chunks scheduled beside running decodes), greedy and seeded sampling
requests, penalties, a stop string that ends one early, a short max_tokens, and one request
cancelled mid-way. Every architecture family runs with each of its proposers: none (plain),
always-right and always-wrong replays, and its real drafter (EAGLE3, the MTP head, the Gemma 4
assistant), so speculation inside the batch is exercised with every acceptance pattern.
"""
from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
import torch

from tests.doubles import KeyedReplay
from tools.tiny import (build_tiny_gemma4, build_tiny_gemma4_assistant, build_tiny_qwen3_5, random_mtp_head,
                                write_mtp_sidecar, write_random_eagle3)
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.engine.types import FinishReason
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3
from verispec.spec.gemma4_assistant import AssistantProposer, load_assistant
from verispec.spec.mtp import MtpProposer, load_mtp_head
from verispec.spec.proposer import Proposer

SHAPE = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
TEXTS = [
    "def fibonacci(n):",
    "import collections\n\nclass Counter(dict):\n    def __init__(self, iterable=None, /, **kwds):\n        super().__init__()",
    "x",
    "for i in range(10):\n    print(i)",
    "class A:\n    pass\n\n\nclass B(A):\n    def f(self, x, y, z):\n        return x * y + z\n",
]
NEW = 24


def requests(prompts: list[list[int]]) -> list[SamplingParams]:
    """Mixed per-request parameters, one per prompt."""
    return [
        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=NEW, temperature=0.9, top_k=20, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                       presence_penalty=0.2),
        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2),
    ][:len(prompts)]


def run_alone(engine: Engine, prompts, params) -> list:
    return [engine.generate_all(ids, p) for ids, p in zip(prompts, params)]


def run_together(engine: Engine, prompts, params, cancel_prompt: list[int]) -> tuple[list, list]:
    """All requests submitted at once, plus one more that is cancelled after its first chunk."""
    results: list[list] = [[] for _ in prompts]
    done = threading.Semaphore(0)
    cancelled: list = []
    cancel = threading.Event()

    def sink_for(i):
        def sink(item):
            results[i].append(item)
            if isinstance(item, BaseException) or item.finish_reason is not None:
                done.release()
        return sink

    def cancel_sink(item):
        cancelled.append(item)
        cancel.set()  # stop it at its next step
        if isinstance(item, BaseException) or item.finish_reason is not None:
            done.release()

    engine.submit(cancel_prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), cancel_sink, cancel)
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.submit(ids, p, sink_for(i))
    for _ in range(len(prompts) + 1):
        assert done.acquire(timeout=120)
    return results, cancelled


def check_identical(engine: Engine, prompts: list[list[int]], label: str) -> None:
    params = requests(prompts)
    alone = run_alone(engine, prompts, params)
    together, cancelled = run_together(engine, prompts, params, prompts[0] + prompts[2])
    for i, (a, chunks) in enumerate(zip(alone, together)):
        assert not any(isinstance(c, BaseException) for c in chunks), f"{label} request {i}: {chunks[-1]!r}"
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == a.token_ids, f"{label}: request {i} differs inside the batch"
        assert chunks[-1].finish_reason == a.finish_reason
        if params[i].logprobs:
            got = [lp.logprob for c in chunks for lp in c.logprobs]
            assert got == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-9)
    assert cancelled[-1].finish_reason is FinishReason.CANCELLED
    assert len([t for c in cancelled for t in c.token_ids]) < 200
    assert alone[2].finish_reason is FinishReason.LENGTH and len(alone[2].token_ids) == 5
    assert engine.blocks.num_used == 0, f"{label}: blocks leaked"
    assert engine.load_stats()["running"] == 0


def proposers(engine: Engine, prompts: list[list[int]]) -> dict[str, Proposer]:
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    continuations = {tuple(ids): engine.generate_all(ids, greedy).token_ids for ids in prompts}
    v = engine.model.vocab_size
    return {"right": KeyedReplay(continuations, v), "wrong": KeyedReplay(continuations, v, wrong_at=lambda i: True)}


def spec(engine: Engine, proposer: Proposer, k: int) -> Engine:
    # k drafts at every batch size: a sampling request draws its random numbers per draft, so its
    # tokens (not its distribution) depend on how many drafts each round had
    config = replace(engine.config, draft_schedule=f"1:{k}")
    return Engine(engine.model, engine.tokenizer, config, engine.model_dir, proposer=proposer, num_drafts=k)


def prompts_for(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dense_families(tiny_models, family, tmp_path):
    d = tiny_models.get(f"batch-{family}", family, **SHAPE)
    engine = load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8, max_num_batched_tokens=24)
    prompts = prompts_for(engine)
    check_identical(engine, prompts, f"{family} plain")
    for name, proposer in proposers(engine, prompts).items():
        check_identical(spec(engine, proposer, 3), prompts, f"{family} {name}")
    drafter = write_random_eagle3(tmp_path / "eagle3", json.loads((d / "config.json").read_text()), seed=3)
    eagle = Eagle3Proposer(load_eagle3(drafter, engine.model), engine.model.vocab_size)
    check_identical(spec(engine, eagle, 2), prompts, f"{family} eagle3")


def test_qwen3_5_hybrid_with_mtp(tmp_path, tokenizer_dir):
    d = tmp_path / "qwen3_5"
    build_tiny_qwen3_5(d, seed=31, tokenizer_dir=tokenizer_dir)
    write_mtp_sidecar(d / "mtp.safetensors", random_mtp_head(json.loads((d / "config.json").read_text()), seed=4))
    engine = load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8, max_num_batched_tokens=24)
    prompts = prompts_for(engine)
    check_identical(engine, prompts, "qwen3_5 plain")
    for name, proposer in proposers(engine, prompts).items():
        check_identical(spec(engine, proposer, 3), prompts, f"qwen3_5 {name}")
    mtp = MtpProposer(load_mtp_head(d, engine.model), num_real_tokens=engine.num_real_tokens)
    check_identical(spec(engine, mtp, 2), prompts, "qwen3_5 mtp")


def test_gemma4_with_assistant(tmp_path, tokenizer_dir):
    build_tiny_gemma4(tmp_path / "target", seed=41, tokenizer_dir=tokenizer_dir)
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    build_tiny_gemma4_assistant(tmp_path / "assistant", config, seed=42)
    engine = load_engine(str(tmp_path / "target"), dtype="float64", device="cpu", prefill_step_size=8,
                         max_num_batched_tokens=24)
    prompts = prompts_for(engine)
    check_identical(engine, prompts, "gemma4 plain")
    for name, proposer in proposers(engine, prompts).items():
        check_identical(spec(engine, proposer, 2), prompts, f"gemma4 {name}")
    assistant = AssistantProposer(load_assistant(tmp_path / "assistant", engine.model), engine.model,
                                  engine.num_real_tokens)
    check_identical(spec(engine, assistant, 2), prompts, "gemma4 assistant")


def test_preemption_under_a_tiny_kv_budget_loses_nothing(tiny_models):
    """Room for ~2.5 sequences: the scheduler must preempt and recompute, and every output still
    equals the one produced alone with plenty of room."""
    d = tiny_models.get("batch-qwen3", "qwen3", **SHAPE)
    roomy = load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8)
    prompts = prompts_for(roomy)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 4 + \
             [SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)]
    alone = run_alone(roomy, prompts, params)
    per_token = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * 16 * 8  # K+V, float64, head dim 16
    tight = load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8, block_size=4,
                        kv_cache_gb=(4 * 44 + 4) * per_token / 2**30, max_model_len=120)
    assert tight.blocks.num_usable <= 44
    together = tight.generate_batch(prompts, params)
    assert [r.token_ids for r in together] == [a.token_ids for a in alone]
    assert tight.scheduler.num_preemptions > 0
    assert tight.blocks.num_used == 0


def test_cancel_returns_blocks(tiny_models):
    d = tiny_models.get("batch-qwen3", "qwen3", **SHAPE)
    engine = load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8)
    ids = prompts_for(engine)[1]
    cancel = threading.Event()
    seen_blocks = []
    finished = threading.Event()

    def sink(chunk):
        seen_blocks.append(engine.blocks.num_used)
        if len(seen_blocks) == 3:
            cancel.set()
        if chunk.finish_reason is not None:
            finished.set()

    engine.submit(ids, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True), sink, cancel)
    assert finished.wait(60)
    assert max(seen_blocks) >= engine.blocks.blocks_for(len(ids))  # it held blocks while running
    assert engine.blocks.num_used == 0  # and gave every one back


def test_generate_batch_python_api(tiny_models):
    from verispec import LLM

    d = tiny_models.get("batch-qwen3", "qwen3", **SHAPE)
    llm = LLM(str(d), dtype="float64", device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    many = llm.generate(TEXTS[:3], params)
    assert [r.token_ids for r in many] == [llm.generate(t, params).token_ids for t in TEXTS[:3]]
