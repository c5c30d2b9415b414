"""Overlapped plain decoding (engine/overlap.py): steps queued ahead of the host's work give the
very output the one-step-at-a-time path gives, whatever ends a sequence mid-pipeline (max_tokens,
a stop string, eos, a cancel, a new request arriving, blocks running short), and nothing leaks.

On a CPU the steps run synchronously, but the pipeline's logic (positions ahead of the committed
length, the previous step's tokens fed as a tensor, rows in flight for a finished sequence
dropped) is the same code the GPU runs; the GPU adds only the asynchrony.
"""
from __future__ import annotations

import threading

import pytest

from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.engine.types import FinishReason
from verispec.grammar.spec import json_object_grammar

SHAPE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
TEXTS = ["def fibonacci(n):", "import collections\n\nclass Counter(dict):", "x", "for i in range(10):\n    print(i)",
         "class A:\n    pass\n", "while True:"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine_for(tiny_models, family: str, overlapped: bool, **kwargs) -> Engine:
    d = tiny_models.get(f"overlap-{family}", family, **SHAPE)
    return load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8, overlap_decode=overlapped, **kwargs)


def count_ahead(engine: Engine, monkeypatch) -> list[int]:
    """Records `ahead` of every verify pass (> 0: launched before the previous step was handled)."""
    seen: list[int] = []
    original = engine.runner.verify

    def verify(seqs, inputs, capture, ahead=0):
        seen.append(ahead)
        return original(seqs, inputs, capture, ahead=ahead)

    monkeypatch.setattr(engine.runner, "verify", verify)
    return seen


def run_together(engine: Engine, prompts, params, late: tuple[list[int], SamplingParams] | None = None,
                 cancel_after: int | None = None):
    """Every request at once; `late` is submitted from inside the engine's output of request 0
    (so it arrives while steps are in flight); request 1 is cancelled after `cancel_after` chunks."""
    n = len(prompts) + (late is not None)
    results: list[list] = [[] for _ in range(n)]
    done = threading.Semaphore(0)
    cancel = threading.Event()

    def sink_for(i):
        def sink(item):
            results[i].append(item)
            if i == 0 and late is not None and len(results[0]) == 6:
                engine.submit(late[0], late[1], sink_for(n - 1))
            if i == 1 and cancel_after is not None and len(results[1]) == cancel_after:
                cancel.set()
            if isinstance(item, BaseException) or item.finish_reason is not None:
                done.release()
        return sink

    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.submit(ids, p, sink_for(i), cancel if i == 1 else None)
    for _ in range(n):
        assert done.acquire(timeout=120)
    return results


def tokens_of(chunks) -> list[int]:
    assert not any(isinstance(c, BaseException) for c in chunks), chunks[-1]
    return [t for c in chunks for t in c.token_ids]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_overlapped_output_equals_step_by_step(tiny_models, family, monkeypatch):
    plain = engine_for(tiny_models, family, overlapped=False)
    prompts = [plain.tokenizer.encode(t) for t in TEXTS]
    first = plain.generate_all(prompts[3], SamplingParams(max_tokens=30, **GREEDY))
    stop = plain.tokenizer.decode(first.token_ids[9:11])  # a stop string met mid-generation
    params = [SamplingParams(max_tokens=30, **GREEDY), SamplingParams(max_tokens=200, **GREEDY),
              SamplingParams(max_tokens=3, **GREEDY), SamplingParams(max_tokens=30, stop=[stop], **GREEDY),
              SamplingParams(max_tokens=17, temperature=0.0), SamplingParams(max_tokens=2, **GREEDY)]
    late = (plain.tokenizer.encode("def late(arrival):"), SamplingParams(max_tokens=12, **GREEDY))
    alone = [plain.generate_all(ids, p) for ids, p in zip(prompts + [late[0]], params + [late[1]])]
    assert alone[3].finish_reason is FinishReason.STOP and len(alone[3].token_ids) < 30

    engine = engine_for(tiny_models, family, overlapped=True)
    ahead = count_ahead(engine, monkeypatch)
    got = run_together(engine, prompts, params, late=late, cancel_after=8)
    for i, (want, chunks) in enumerate(zip(alone, got)):
        if i == 1:  # cancelled: a prefix of its output, then CANCELLED
            tokens = tokens_of(chunks)
            assert chunks[-1].finish_reason is FinishReason.CANCELLED and 8 <= len(tokens) < 200
            assert tokens == want.token_ids[:len(tokens)]
            continue
        assert tokens_of(chunks) == want.token_ids, f"{family}: request {i} differs when overlapped"
        assert "".join(c.text for c in chunks) == want.text
        assert chunks[-1].finish_reason == want.finish_reason
    assert max(ahead) == 1 and ahead.count(1) > 10, "the pipeline never queued a step ahead"
    assert engine.blocks.num_used == 0 and engine.load_stats()["running"] == 0


def test_overlap_under_a_tiny_kv_budget(tiny_models, monkeypatch):
    """Blocks run short while steps are queued ahead: reserving fails, the pipeline drains, the
    scheduler preempts as it does without overlap, and every output still equals the roomy one."""
    roomy = engine_for(tiny_models, "qwen3", overlapped=False)
    prompts = [roomy.tokenizer.encode(t) for t in TEXTS[:4]]
    params = [SamplingParams(max_tokens=40, **GREEDY)] * 4
    alone = [roomy.generate_all(ids, p) for ids, p in zip(prompts, params)]
    per_token = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * 16 * 8  # K+V, float64, head dim 16
    tight = engine_for(tiny_models, "qwen3", overlapped=True, block_size=4, max_model_len=80,
                       kv_cache_gb=30 * 4 * per_token / 2**30)
    assert tight.blocks.num_usable <= 30
    ahead = count_ahead(tight, monkeypatch)
    got = run_together(tight, prompts, params)
    for want, chunks in zip(alone, got):
        assert tokens_of(chunks) == want.token_ids
    assert tight.scheduler.num_preemptions > 0 and ahead.count(1) > 0
    assert tight.blocks.num_used == 0


def unqueued(engine: Engine, ids: list[int], params: SamplingParams):
    """A submitted sequence as the step sees it (no worker runs it, no request waits behind it)."""
    seq = engine.submit(ids, params, lambda item: None)
    engine._inbox.get_nowait()
    return seq


def test_overlap_only_where_the_next_input_is_the_device_argmax(tiny_models, tmp_path, tokenizer_dir, monkeypatch):
    """Sampling, penalties, logprobs and grammars need the host between steps; recurrent layers
    keep host-ordered snapshots: those steps run one at a time."""
    from tools.tiny import build_tiny_qwen3_5

    monkeypatch.setattr(Engine, "_ensure_worker", lambda self: None)
    engine = engine_for(tiny_models, "qwen3", overlapped=True)
    ids = engine.tokenizer.encode("def f(x):")
    for params, expect in [(SamplingParams(max_tokens=8, **GREEDY), True),
                           (SamplingParams(max_tokens=8, temperature=0.7, seed=1), False),
                           (SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.2), False),
                           (SamplingParams(max_tokens=8, temperature=0.0, logprobs=True), False),
                           (SamplingParams(max_tokens=8, temperature=0.0, grammar=json_object_grammar()), False),
                           (SamplingParams(max_tokens=1, **GREEDY), False)]:
        seq = unqueued(engine, ids, params)
        monkeypatch.setattr(engine.scheduler, "running", [seq])
        assert engine.overlap.eligible([seq], [0]) is expect, params
        assert not engine.overlap.eligible([seq], [2])  # drafts: a verify round
    # a sequence still in its prompt (admitted, running, not decoding) gets a prefill chunk every step
    decoding, prefilling = (unqueued(engine, ids, SamplingParams(max_tokens=8, **GREEDY)) for _ in range(2))
    monkeypatch.setattr(engine.scheduler, "running", [decoding, prefilling])
    assert not engine.overlap.eligible([decoding], [0])
    monkeypatch.setattr(engine.scheduler, "running", [decoding])
    assert engine.overlap.eligible([decoding], [0])
    build_tiny_qwen3_5(tmp_path / "hybrid", seed=5, tokenizer_dir=tokenizer_dir)
    hybrid = load_engine(str(tmp_path / "hybrid"), dtype="float64", device="cpu", overlap_decode=True)
    seq = unqueued(hybrid, ids, SamplingParams(max_tokens=8, **GREEDY))
    monkeypatch.setattr(hybrid.scheduler, "running", [seq])
    assert hybrid.overlap.eligible([seq], [0]) is False
