"""Tensor parallelism on two GPUs (NCCL): the verify passes captured as CUDA graphs, collectives
included, give the eager passes' output token for token (Qwen3, bf16, greedy, a mixed batch with
prefix-cache hits; the graphs' small all-reduces over NVLink, the eager ones' through NCCL), plain
and with suffix drafting; the Qwen3.5 hybrid split (eager) gives the same output either way; a
killed worker fails the open request instead of hanging a graph replay.
"""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from tests.engine.test_tensor_parallel import kill_a_worker_while_decoding, prompts
from tools.tiny import build_tiny_model, build_tiny_qwen3_5
from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

ENGINE = dict(device="cuda", dtype="bfloat16", kv_cache_gb=0.25, max_num_seqs=8, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("gpu-tp")
    build_tiny_model(root / "qwen3", "qwen3", seed=41, tokenizer_dir=tokenizer_dir, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, hidden_size=128, intermediate_size=256)
    build_tiny_qwen3_5(root / "qwen3_5", seed=42, tokenizer_dir=tokenizer_dir)
    return {"qwen3": root / "qwen3", "qwen3_5": root / "qwen3_5"}


def generate(engine) -> list[list[int]]:
    vocab = engine.model.vocab_size
    first, second = prompts(vocab)
    repeating = [first[0][:12] * 4]  # suffix drafting finds its continuation
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = engine.generate_batch(first + repeating, greedy)
    out += engine.generate_batch(second, greedy)
    return [r.token_ids for r in out]


@pytest.mark.parametrize("suffix", [False, True], ids=["plain", "suffix"])
def test_graphed_passes_give_the_eager_passes_output(model_dirs, suffix, monkeypatch):
    """Eager passes with every all-reduce through NCCL; graphed ones with the small all-reduces
    over NVLink (kernels/p2p_all_reduce.py): over two ranks each sum is one addition, so alike."""
    outputs = {}
    for graphs in (False, True):
        monkeypatch.setenv("VERISPEC_P2P_ALL_REDUCE", "1" if graphs else "0")
        engine = load_engine(str(model_dirs["qwen3"]), cuda_graphs=graphs, suffix=suffix, **ENGINE)
        try:
            engine.prewarm()
            assert (engine.runner.graphs is not None) == graphs
            outputs[graphs] = generate(engine)
            assert engine.prefix_cache_stats()["hits"] >= 1
        finally:
            engine.close()
    assert outputs[True] == outputs[False]


def test_a_split_hybrid_runs_eagerly_and_its_all_reduces_agree(model_dirs, monkeypatch):
    outputs = {}
    for p2p in ("0", "1"):
        monkeypatch.setenv("VERISPEC_P2P_ALL_REDUCE", p2p)
        engine = load_engine(str(model_dirs["qwen3_5"]), **ENGINE)
        try:
            engine.prewarm()
            assert engine.runner.graphs is None
            outputs[p2p] = generate(engine)
        finally:
            engine.close()
    assert outputs["1"] == outputs["0"]


def _kill_a_worker_in_a_graphed_step(model_dir: str, results) -> None:
    """In a process of its own: after the kill, a kernel on this GPU may spin forever on the dead
    rank's signal (docs/multi-gpu.md), so nothing else may run on this process's GPU afterwards."""
    engine = load_engine(model_dir, **ENGINE)
    engine.prewarm()
    graphed = engine.runner.graphs is not None
    item = kill_a_worker_while_decoding(engine, 1000)
    began = time.monotonic()
    engine.close()
    results.put(dict(graphed=graphed, failed=isinstance(item, BaseException), message=str(item),
                     close_s=time.monotonic() - began))
    os._exit(0)  # no CUDA teardown: it would wait on that kernel


def test_a_killed_worker_fails_a_graphed_request(model_dirs):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_kill_a_worker_in_a_graphed_step, args=(str(model_dirs["qwen3"]), results))
    child.start()
    try:
        outcome = results.get(timeout=240)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert outcome["graphed"] and outcome["failed"] and "rank 1" in outcome["message"], outcome
    assert outcome["close_s"] < 30  # the abort is waited on for 5 s at most
