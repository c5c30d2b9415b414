"""Tensor parallelism on the CPU (gloo, 2 processes): a model split over two ranks gives the output
it gives whole (greedy tokens and logprobs, float64), for llama and qwen3, in a mixed batch that
hits the prefix cache; a killed worker fails the open request with an error naming it and the
engine refuses new ones, never hanging; bad sizes are refused in one line before anything loads;
two "machines" on one host meet over loopback.
"""
from __future__ import annotations

import queue
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from verispec.config import EngineConfig
from verispec.engine import tp_peers
from verispec.engine.engine import load_engine
from verispec.engine.tp_group import check_tensor_parallel_options
from verispec.errors import VerispecError
from verispec.models.layers.parallel import Shard, ShardSpec, vocab_split
from verispec.models.shard_layers import kv_head_split
from verispec.models.sharding import check_shardable
from verispec.sampling.params import SamplingParams

ENGINE = dict(device="cpu", dtype="float64", kv_cache_gb=0.01, block_size=16)
WAIT_S = 120  # a hang fails the test instead of blocking the run


def prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """A first batch of mixed lengths, and a second whose prompts share 2 blocks with the first
    one's (prefix-cache hits) beside a fresh one."""
    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    base = ids(37)
    first = [base + ids(5), ids(9), ids(23)]
    second = [base[:32] + ids(6), ids(4), base + ids(11)]
    return first, second


def run(engine, vocab: int) -> list:
    first, second = prompts(vocab)
    greedy = SamplingParams(max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=3)
    results = engine.generate_batch(first, [greedy, sampled, greedy])
    results += engine.generate_batch(second, [greedy, greedy, sampled])
    return results


def assert_same(whole: list, split: list) -> None:
    for a, b in zip(whole, split):
        assert a.token_ids == b.token_ids
        if a.logprobs is not None:
            assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
            assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-9)


def assert_split_gives_whole(model_dir, check_split) -> dict:
    """The model whole and over two ranks give the same outputs (the split one with prefix-cache
    hits); `check_split(engine)` inspects the split model first. Returns its prefix-cache stats."""
    whole = load_engine(str(model_dir), **ENGINE)
    vocab = whole.model.vocab_size
    expected = run(whole, vocab)
    split = load_engine(str(model_dir), tensor_parallel_size=2, **ENGINE)
    try:
        check_split(split)
        got = run(split, vocab)
        stats = split.prefix_cache_stats()
        assert stats["hits"] >= 2
    finally:
        split.close()
    assert_same(expected, got)
    return stats


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_two_ranks_give_the_whole_models_output(tiny_models, family):
    if family == "llama":  # one KV head (replicated on both ranks), biases, a vocabulary split unevenly
        model_dir = tiny_models.get("tp-llama", "llama", extra_vocab=1, num_key_value_heads=1,
                                    attention_bias=True, mlp_bias=True)
    else:
        model_dir = tiny_models.get("qwen3", "qwen3")
    def rank0_holds_half_the_head(split):
        assert split.model.lm_head.weight.shape[0] == -(-split.model.vocab_size // 2)

    assert_split_gives_whole(model_dir, rank0_holds_half_the_head)


def kill_a_worker_while_decoding(engine, max_tokens: int) -> object:
    """Start a request, kill rank 1 once it decodes, return what ended the request (its last chunk
    or the error)."""
    chunks: queue.SimpleQueue = queue.SimpleQueue()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.submit([5, 6, 7, 8], params, chunks.put)
    assert not isinstance(chunks.get(timeout=WAIT_S), BaseException)  # decoding on both ranks
    engine.peers.group.workers[0].process.kill()
    while True:
        item = chunks.get(timeout=WAIT_S)
        if isinstance(item, BaseException) or item.finish_reason is not None:
            return item


def test_a_killed_worker_fails_the_open_request_and_later_ones(qwen3_dir):
    engine = load_engine(str(qwen3_dir), tensor_parallel_size=2, **ENGINE)
    try:
        item = kill_a_worker_while_decoding(engine, 400)
        assert isinstance(item, BaseException) and "rank 1" in str(item)
        assert "rank 1 exited" in engine.failure()
        with pytest.raises(VerispecError, match="rank 1 exited"):
            engine.submit([5, 6], SamplingParams(max_tokens=4), lambda item: None)
    finally:
        engine.close()


def test_a_killed_worker_fails_the_request_while_the_step_is_stuck(qwen3_dir):
    """On CUDA the engine's thread can block for good in a step waiting on the lost rank (a graph's
    all-reduce spinning on its signal): the thread that notices the loss fails the open request
    itself, and closing the engine does not wait for that step. Here a step is held inside its
    collective until both happened."""
    engine = load_engine(str(qwen3_dir), tensor_parallel_size=2, **ENGINE)
    held, release, holding = threading.Event(), threading.Event(), threading.Event()
    forward = engine.peers.forward

    def held_forward(*args, **kwargs):
        if holding.is_set():
            held.set()
            release.wait(WAIT_S)
        return forward(*args, **kwargs)

    engine.peers.forward = held_forward
    closed = False
    try:
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        engine.submit([5, 6, 7, 8], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), chunks.put)
        assert not isinstance(chunks.get(timeout=WAIT_S), BaseException)  # decoding on both ranks
        holding.set()
        assert held.wait(WAIT_S)
        engine.peers.group.workers[0].process.kill()
        item = chunks.get(timeout=WAIT_S)
        while not isinstance(item, BaseException):  # chunks of steps before the hold
            assert item.finish_reason is None
            item = chunks.get(timeout=WAIT_S)
        assert "rank 1 exited" in str(item) and not release.is_set()  # the step is still held
        began = time.monotonic()
        engine.close()
        closed = True
        assert time.monotonic() - began < tp_peers.ABORT_WAIT_S + 30 and not release.is_set()
        release.set()
        time.sleep(0.5)  # the held step ends (its collective fails): nothing more reaches the client
        assert chunks.empty()
    finally:
        release.set()
        if not closed:
            engine.close()


@pytest.mark.slow
def test_two_machines_over_loopback(qwen3_dir):
    """Node 1 is `verispec generate --node-rank 1` in a process of its own; node 0 the engine here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = dict(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port)
    other = subprocess.Popen([sys.executable, "-m", "verispec.cli", "generate", "-m", str(qwen3_dir), "--device", "cpu",
                              "--dtype", "float64", "--prompt", "unused", "-tp", "2", "--nnodes", "2", "--node-rank", "1",
                              "--master-addr", "127.0.0.1", "--master-port", str(port)])
    try:
        split = load_engine(str(qwen3_dir), **node, **ENGINE)
        assert not split.peers.group.workers  # its one rank a machine is this process
        got = run(split, split.model.vocab_size)
        split.close()
        assert other.wait(timeout=WAIT_S) == 0
    finally:
        if other.poll() is None:
            other.kill()
    whole = load_engine(str(qwen3_dir), **ENGINE)
    assert_same(run(whole, whole.model.vocab_size), got)


# ---- checks before anything loads -----------------------------------------------------------------
CONFIG = {"model_type": "qwen3", "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 96}


@pytest.mark.parametrize("change, size, message", [
    ({}, 3, "divide the model's 8 attention heads"),
    ({"num_key_value_heads": 3, "num_attention_heads": 12}, 2, "3 KV heads"),
    ({"intermediate_size": 97}, 2, "MLP width"),
    ({"model_type": "phi3"}, 2, "'phi3' is not split"),
    ({"model_type": "qwen3_5_text", "linear_num_key_heads": 3}, 2, "Gated DeltaNet key heads"),
    ({"model_type": "gemma4", "text_config": {**CONFIG, "enable_moe_block": True, "num_experts": 4,
                                              "top_k_experts": 2, "moe_intermediate_size": 7}}, 2, "expert MLP width"),
    ({"quantization_config": {"quant_method": "modelopt"}}, 2, "quantized checkpoints"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 36}, 8, "expert MLP width"),
    ({"model_type": "qwen3_5_moe_text", "moe_intermediate_size": 32, "shared_expert_intermediate_size": 50}, 4,
     "shared expert MLP width"),
])
def test_a_size_the_model_cannot_split_is_one_line(change, size, message):
    with pytest.raises(VerispecError, match=message) as err:
        check_shardable({**CONFIG, **change}, size)
    assert "\n" not in str(err.value)


def test_sizes_the_model_splits():
    for size in (1, 2, 4, 8):  # 8 ranks over 2 KV heads: each head on 4 ranks
        check_shardable(CONFIG, size)
    assert [kv_head_split(2, Shard(r, 8)) for r in range(8)] == [(0, 1)] * 4 + [(1, 1)] * 4
    assert [kv_head_split(4, Shard(r, 2)) for r in range(2)] == [(0, 2), (2, 2)]


@pytest.mark.parametrize("fields, message", [
    (dict(tensor_parallel_size=0), "must be >= 1"),
    (dict(tensor_parallel_size=4, nnodes=3), "--nnodes"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1234), "--node-rank"),
    (dict(tensor_parallel_size=2, nnodes=2), "--master-port"),
    (dict(tensor_parallel_size=2, device="mps"), "not mps"),
])
def test_bad_tensor_parallel_flags(fields, message):
    with pytest.raises(VerispecError, match=message):
        check_tensor_parallel_options(EngineConfig(model="m", **fields))


def test_vocabulary_split_pads_the_last_rank():
    parts = [vocab_split(11, Shard(r, 4)) for r in range(4)]
    assert [(p.start, p.stop, p.size) for p in parts] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 11, 3)]
    padded = parts[3].fit(torch.ones(2, 5))
    assert padded.shape == (3, 5) and padded[2].abs().sum() == 0
    spec = ShardSpec(1, 4, 8, 4)
    assert torch.arange(24.).view(2, 12)[spec.index(2)].shape == spec.local_shape((2, 12)) == (2, 4)
