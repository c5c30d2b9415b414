"""The drafters (EAGLE3, MTP: spec/chained.py, paged drafter rows indexed by the target's block
tables; the Gemma 4 assistant, reading every sequence's target rows in one pass) draft for a
sequence inside a batch exactly what they draft for it alone.

The drafts the engine verifies are scripted (the target's own continuation, right or wrong by a
pattern, so verify passes are committed partially at every chain depth); what is compared is what
the real drafter chose each round, which depends on every row it has observed. A drafter state
that kept a rejected row, missed an accepted one or read another sequence's rows would choose
differently.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace

import pytest

from tools.tiny import (build_tiny_gemma4, build_tiny_gemma4_assistant, build_tiny_qwen3_5, random_mtp_head,
                                write_mtp_sidecar, write_random_eagle3)
from verispec.engine.engine import Engine, load_engine
from verispec.sampling.params import SamplingParams
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3
from verispec.spec.gemma4_assistant import AssistantProposer, load_assistant
from verispec.spec.mtp import MtpProposer, load_mtp_head
from verispec.spec.proposer import Draft

TEXTS = ["def fibonacci(n):", "import collections\n\nclass Counter(dict):\n    def __init__(self):", "x",
         "for i in range(10):\n    print(i)"]
NEW = 30
K = 3


def scripted(base_class):
    class Scripted(base_class):
        """Records the real drafter's choices, hands the engine scripted drafts."""

        def setup(self, continuations: dict, vocab_size: int):
            self.continuations, self.vocab_size = continuations, vocab_size
            self.real = defaultdict(list)  # prompt -> the drafter's own drafts, round by round
            return self

        def _script(self, prompt: tuple, next_position: int, n: int) -> Draft:
            cont = self.continuations[prompt]
            out = []
            for j in range(n):
                i = next_position + 1 + j - len(prompt)  # the draft's index in the continuation
                tok = cont[i] if i < len(cont) else 0
                out.append(tok if (i + j) % 3 else (tok + 1) % self.vocab_size)  # wrong at varying depths
            return Draft(out)

        def propose(self, seqs, num_drafts, params, generators):
            positions = [self._states[s.id].next_position for s in seqs]
            own = super().propose(seqs, num_drafts, params, generators)
            for s, d in zip(seqs, own):
                self.real[tuple(s.prompt_ids)].append(d.token_ids)
            return [self._script(tuple(s.prompt_ids), p, n) for s, p, n in zip(seqs, positions, num_drafts)]

    return Scripted


def compare(engine: Engine, make_proposer) -> None:
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    continuations = {tuple(ids): engine.generate_all(ids, greedy).token_ids for ids in prompts}
    v = engine.model.vocab_size
    config = replace(engine.config, draft_schedule=f"1:{K}")  # K drafts whatever the batch size
    single = make_proposer().setup(continuations, v)
    alone = Engine(engine.model, engine.tokenizer, config, engine.model_dir, proposer=single, num_drafts=K)
    for ids in prompts:  # one at a time
        assert alone.generate_all(ids, greedy).token_ids == continuations[tuple(ids)]
    many = make_proposer().setup(continuations, v)
    batched = Engine(engine.model, engine.tokenizer, config, engine.model_dir, proposer=many, num_drafts=K)
    results = batched.generate_batch(prompts, greedy)
    assert [r.token_ids for r in results] == [continuations[tuple(ids)] for ids in prompts]
    assert all(0 < r.stats.accepted < r.stats.drafted for r in results)  # partial commits happened
    for ids in prompts:
        assert many.real[tuple(ids)] == single.real[tuple(ids)], "the drafter drafted differently inside a batch"
    assert batched.blocks.num_used == 0


def test_eagle3_drafts_in_a_batch_as_alone(tiny_models, tmp_path):
    d = tiny_models.get("batch-llama", "llama", num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2)
    engine = load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8, max_num_batched_tokens=24)
    drafter_dir = write_random_eagle3(tmp_path / "e3", json.loads((d / "config.json").read_text()), seed=5)
    drafter = load_eagle3(drafter_dir, engine.model)
    compare(engine, lambda: scripted(Eagle3Proposer)(drafter, engine.model.vocab_size))


def test_mtp_drafts_in_a_batch_as_alone(tmp_path, tokenizer_dir):
    d = tmp_path / "qwen3_5"
    build_tiny_qwen3_5(d, seed=33, tokenizer_dir=tokenizer_dir)
    write_mtp_sidecar(d / "mtp.safetensors", random_mtp_head(json.loads((d / "config.json").read_text()), seed=6))
    engine = load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8, max_num_batched_tokens=24)
    head = load_mtp_head(d, engine.model)
    compare(engine, lambda: scripted(MtpProposer)(head, num_real_tokens=engine.num_real_tokens))


def test_gemma4_assistant_drafts_in_a_batch_as_alone(tmp_path, tokenizer_dir):
    build_tiny_gemma4(tmp_path / "target", seed=41, tokenizer_dir=tokenizer_dir)
    build_tiny_gemma4_assistant(tmp_path / "assistant", json.loads((tmp_path / "target" / "config.json").read_text()),
                                seed=42)
    engine = load_engine(str(tmp_path / "target"), dtype="float64", device="cpu", prefill_step_size=8,
                         max_num_batched_tokens=24)
    drafter = load_assistant(tmp_path / "assistant", engine.model)
    compare(engine, lambda: scripted(AssistantProposer)(drafter, engine.model, engine.num_real_tokens))
