"""Prompt chunks of several sequences in one pass (engine/scheduler.py `prefill_groups`) give each sequence exactly
what it gets alone: float64 on the CPU, for llama (with EAGLE3), the Qwen3.5 hybrid (with its MTP
head: padded rows must neither decay nor write the recurrent state) and Gemma 4 (sliding windows,
shared-KV layers, with the assistant). The chunks are long enough for the masked attention call
and the chunked recurrence (over 16 tokens), and of different lengths, so rows are padded."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tools.tiny import (build_tiny_gemma4, build_tiny_gemma4_assistant, build_tiny_qwen3_5, random_mtp_head,
                                write_mtp_sidecar, write_random_eagle3)
from verispec.engine import scheduler as prefill
from verispec.engine.engine import Engine, load_engine
from verispec.engine.output import OutputBuilder
from verispec.sampling.params import SamplingParams
from verispec.sampling.sampler import TokenHistory
from verispec.engine.sequence import Sequence
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3
from verispec.spec.gemma4_assistant import AssistantProposer, load_assistant
from verispec.spec.mtp import MtpProposer, load_mtp_head

LENGTHS = (83, 61, 47, 29, 5)  # 40-token chunks: first chunks of 40, tails of 43 / 21 / 7 / 29 / 5 ...
NEW = 12


def prompts(engine: Engine) -> list[list[int]]:
    v = engine.num_real_tokens
    return [[(97 * i + 13 * j + 5) % v for j in range(n)] for i, n in enumerate(LENGTHS)]


def params() -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    sampled = SamplingParams(max_tokens=NEW, temperature=0.8, seed=11, ignore_eos=True)
    return [greedy, sampled, greedy, greedy, greedy]


def check(engine: Engine, label: str) -> None:
    ids, ps = prompts(engine), params()
    passes: list[list[int]] = []
    original = engine.runner.prefill

    def recorded(seqs, counts, *a, **k):
        passes.append(list(counts))
        return original(seqs, counts, *a, **k)

    engine.runner.prefill = recorded
    alone = [engine.generate_all(p, q) for p, q in zip(ids, ps)]
    assert all(len(c) == 1 for c in passes), f"{label}: a lone prompt ran in a batched pass"
    passes.clear()
    together = engine.generate_batch(ids, ps)
    ragged = [c for c in passes if len(c) > 1 and len(set(c)) > 1 and max(c) > 16]
    assert ragged, f"{label}: no padded multi-sequence prompt pass over 16 tokens ran ({passes})"
    for i, (a, t) in enumerate(zip(alone, together)):
        assert t.token_ids == a.token_ids, f"{label}: prompt {i} differs when prefilled with others"
        if ps[i].logprobs:
            got = [lp.logprob for lp in t.logprobs]
            assert got == pytest.approx([lp.logprob for lp in a.logprobs], abs=1e-10), label
    assert engine.blocks.num_used == 0


def engine_for(path, **kw) -> Engine:
    # batched on the CPU as on CUDA (a CPU's default is one pass a chunk): the batched passes' bits are the test
    return load_engine(str(path), dtype="float64", device="cpu", prefill_step_size=40, max_num_batched_tokens=200,
                       batch_prefill=True,
                       prefix_cache=False, **kw)


def speculating(engine: Engine, proposer, k: int) -> Engine:
    config = replace(engine.config, draft_schedule=f"1:{k}")
    return Engine(engine.model, engine.tokenizer, config, engine.model_dir, proposer=proposer, num_drafts=k)


def test_llama_plain_and_eagle3(tiny_models, tmp_path):
    d = tiny_models.get("prefill-llama", "llama", num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2)
    engine = engine_for(d)
    check(engine, "llama plain")
    drafter = write_random_eagle3(tmp_path / "eagle3", json.loads((d / "config.json").read_text()), seed=5)
    check(speculating(engine, Eagle3Proposer(load_eagle3(drafter, engine.model), engine.model.vocab_size), 2),
          "llama eagle3")


def test_qwen3_5_hybrid_plain_and_mtp(tmp_path, tokenizer_dir):
    d = tmp_path / "qwen3_5"
    build_tiny_qwen3_5(d, seed=17, tokenizer_dir=tokenizer_dir)
    write_mtp_sidecar(d / "mtp.safetensors", random_mtp_head(json.loads((d / "config.json").read_text()), seed=6))
    engine = engine_for(d)
    check(engine, "qwen3_5 plain")
    mtp = MtpProposer(load_mtp_head(d, engine.model), num_real_tokens=engine.num_real_tokens)
    check(speculating(engine, mtp, 2), "qwen3_5 mtp")


def test_qwen3_5_with_the_prefix_cache(tmp_path, tokenizer_dir):
    """The hybrid's prefix cache ends chunks at block edges (recurrent snapshots there): the
    snapshots taken in a batched pass are the ones a lone pass takes, so later hits agree."""
    d = tmp_path / "qwen3_5"
    build_tiny_qwen3_5(d, seed=19, tokenizer_dir=tokenizer_dir)
    engine = load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=40, max_num_batched_tokens=200,
                         batch_prefill=True)
    fresh = engine_for(d)
    ids, ps = prompts(engine), params()
    together = engine.generate_batch(ids, ps)
    again = engine.generate_batch([p + [3, 4] for p in ids], ps)  # hits the snapshots just taken
    for i, p in enumerate(ids):
        assert together[i].token_ids == fresh.generate_all(p, ps[i]).token_ids
        assert again[i].token_ids == fresh.generate_all(p + [3, 4], ps[i]).token_ids
    assert engine.prefix_cache_stats()["hits"] > 0


def test_gemma4_plain_and_assistant(tmp_path, tokenizer_dir):
    build_tiny_gemma4(tmp_path / "target", seed=43, tokenizer_dir=tokenizer_dir)
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    build_tiny_gemma4_assistant(tmp_path / "assistant", config, seed=44)
    engine = engine_for(tmp_path / "target")
    check(engine, "gemma4 plain")
    assistant = AssistantProposer(load_assistant(tmp_path / "assistant", engine.model), engine.model,
                                  engine.num_real_tokens)
    check(speculating(engine, assistant, 2), "gemma4 assistant")


def test_off_runs_each_chunk_alone(tiny_models):
    d = tiny_models.get("prefill-llama", "llama", num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2)
    engine = load_engine(str(d), dtype="float64", device="cpu", batch_prefill=False)
    sizes = []
    original = engine.runner.prefill
    engine.runner.prefill = lambda seqs, counts, *a, **k: (sizes.append(len(seqs)), original(seqs, counts, *a, **k))[1]
    engine.generate_batch(prompts(engine), params())
    assert sizes and set(sizes) == {1}


def test_groups_bound_the_padding():
    seqs = [object() for _ in range(6)]
    # four long first chunks and a 64-token one share a pass; 16-token tails group among themselves
    chunks = [(seqs[0], 496), (seqs[1], 16), (seqs[2], 496), (seqs[3], 496), (seqs[4], 64), (seqs[5], 16)]
    got = prefill.prefill_groups(chunks)
    assert [[n for _, n in g] for g in got] == [[496, 496, 496], [64, 16, 16]] or \
        all(len(g) * max(n for _, n in g) <= prefill.PADDING_ALLOWANCE * sum(n for _, n in g)
            + prefill.PADDING_SLACK * len(g) for g in got)
    assert sorted(n for g in got for _, n in g) == sorted(n for _, n in chunks)
    assert all((seqs[1], 16) not in g for g in got if any(n == 496 for _, n in g))  # no tail in a long pass
    assert prefill.prefill_groups([(seqs[0], 7)]) == [[(seqs[0], 7)]]
    # the plan's order is kept inside a group
    same = [(s, 32) for s in seqs]
    assert prefill.prefill_groups(same) == [same]


def test_padded_rows_leave_the_recurrent_state_alone(tmp_path, tokenizer_dir):
    """Runner level: a hybrid's state slot after a padded batched pass equals the one after the
    sequence's own pass, to float64 rounding."""
    d = tmp_path / "qwen3_5"
    build_tiny_qwen3_5(d, seed=23, tokenizer_dir=tokenizer_dir)
    engine = engine_for(d)
    ids = prompts(engine)[:3]
    states = {}
    for mode in ("alone", "together"):
        seqs = []
        for p in ids:
            greedy = SamplingParams(max_tokens=1, temperature=0.0)
            out = OutputBuilder(engine.tokenizer, greedy, 1, TokenHistory(engine.model.vocab_size, p, engine.device),
                                engine.eos_token_ids)
            seq = Sequence(p, greedy, 1, out, None, "test", sink=lambda chunk: None)
            assert engine.scheduler._grow(seq, len(p))
            seq.state_slot = engine.scheduler.slots.allocate()
            engine.pools.clear_state(seq.state_slot)
            seqs.append(seq)
        counts = [len(p) for p in ids]
        if mode == "alone":
            for seq, n in zip(seqs, counts):
                engine.runner.prefill([seq], [n], (), keep_all_rows=False)
        else:
            engine.runner.prefill(seqs, counts, (), keep_all_rows=False)
        states[mode] = [[engine.pools.ssm_states[layer][s.state_slot].clone() for layer in engine.pools.ssm_states]
                        for s in seqs]
        states[mode + "_conv"] = [[engine.pools.conv_states[layer][s.state_slot].clone()
                                   for layer in engine.pools.conv_states] for s in seqs]
        for seq in seqs:
            engine.scheduler.release(seq)
    for key in ("", "_conv"):
        for a, t in zip(states["alone" + key], states["together" + key]):
            for x, y in zip(a, t):
                torch.testing.assert_close(y, x, rtol=0, atol=1e-12)


def test_cli_flag(qwen3_dir):
    from verispec import cli

    on = cli._engine_config(cli.build_parser().parse_args(["serve", "-m", str(qwen3_dir), "--device", "cpu"]))
    off = cli._engine_config(cli.build_parser().parse_args(["serve", "-m", str(qwen3_dir), "--device", "cpu",
                                                            "--no-batch-prefill"]))
    assert on.batch_prefill is None and off.batch_prefill is False  # None: the device's default


def test_prompts_share_a_pass_by_default_on_cuda_only():
    from verispec.config import EngineConfig
    from verispec.engine.scheduler import batches_prompts

    default = EngineConfig(model="m").batch_prefill
    assert batches_prompts(default, "cuda") and not batches_prompts(default, "cpu")
    assert batches_prompts(True, "cpu") and not batches_prompts(False, "cuda")


def test_default_token_budget_scales_with_model_size():
    from verispec.engine.scheduler import default_token_budget

    assert default_token_budget(8_200_000_000, "cuda", 2048) == 2048  # an 8B model: 2048
    assert default_token_budget(27_000_000_000, "cuda", 2048) == 2048
    assert default_token_budget(1_700_000_000, "cuda", 2048) == 9472  # compute of 2048 8B tokens
    assert default_token_budget(20_000_000, "cuda", 2048) == 16384  # the demo model: capped
    assert default_token_budget(20_000_000, "cpu", 2048) == 2048  # compute-bound: unchanged
    assert default_token_budget(20_000_000, "cpu", 4096) == 4096
