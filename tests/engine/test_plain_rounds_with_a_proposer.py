"""With a proposer loaded, a round in which no sequence drafts is a plain decoding step: overlapped
(engine/overlap.py) and without any drafter pass. The drafter sees the rows of rounds it did not
draft in when the sequence next drafts (engine/deferred_rows.py), and then drafts exactly what it
drafts having observed every round: output and drafts are those of plain and of every-round drafting.

The engine verifies scripted drafts that are always wrong, so every round commits one token with
or without drafts and rounds line up across engines; what is compared is what the real drafter
chose at each length of the sequence.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace

import pytest

from tests.engine.test_overlap_decode import count_ahead
from tools.tiny import write_random_eagle3
from verispec.engine import draft_gate
from verispec.engine.draft_policy import DraftPolicy, draft_cap
from verispec.engine.engine import Engine, load_engine
from verispec.engine.runner import PassOutput
from verispec.sampling.params import SamplingParams
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3
from verispec.spec.proposer import Draft, PassRowStep
from verispec.spec.suffix import SuffixOptions, SuffixProposer

TEXTS = ["def fibonacci(n):", "import collections\n\nclass Counter(dict):\n    def __init__(self):", "x",
         "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)"]
NEW = 40
K = 3
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


class EveryNth(DraftPolicy):
    """K drafts for every sequence on every n-th round, none in between."""

    def __init__(self, n: int, max_drafts: int):
        super().__init__()
        self.n, self.max_drafts, self.round = n, max_drafts, 0

    def choose(self, seqs):
        self.round += 1
        k = self.max_drafts if self.round % self.n == 0 else 0
        counts = [min(k, draft_cap(s, self.max_drafts)) for s in seqs]
        self.stats.record(counts)
        return counts

    def plain_rounds(self, seqs) -> int:
        return (self.n - (self.round + 1) % self.n) % self.n

    def skip(self, seqs, num_rounds: int) -> None:
        super().skip(seqs, num_rounds)
        self.round += num_rounds

    def describe(self) -> str:
        return f"{self.max_drafts} drafts every {self.n}th round"


def scripted(base_class):
    class Scripted(base_class):
        """Records the real drafter's choices by sequence length; hands the engine wrong drafts."""

        def setup(self, continuations: dict, vocab_size: int):
            self.continuations, self.vocab_size = continuations, vocab_size
            self.real: dict[tuple, dict[int, list[int]]] = defaultdict(dict)
            self.observed_calls = self.verify_observes = self.decode_observes = self.propose_calls = 0
            return self

        def observe(self, rows):
            self.observed_calls += 1
            self.decode_observes += any(step.start_position >= len(seq.prompt_ids) for seq, step in rows)
            # rows of a verify pass: past the prompt, read from a target pass (not a deferred batch)
            self.verify_observes += any(isinstance(step, PassRowStep) and isinstance(step.source[0], PassOutput)
                                        and step.start_position >= len(seq.prompt_ids) for seq, step in rows)
            super().observe(rows)

        def propose(self, seqs, num_drafts, params, generators):
            self.propose_calls += 1
            own = super().propose(seqs, num_drafts, params, generators)
            wrong = []
            for s, d, k in zip(seqs, own, num_drafts):
                prompt = tuple(s.prompt_ids)
                self.real[prompt][s.num_tokens] = d.token_ids
                right = self.continuations[prompt][s.num_tokens - len(prompt)]
                wrong.append(Draft([(right + 1) % self.vocab_size] * k))
            return wrong

    return Scripted


@pytest.fixture(scope="module")
def target(tiny_models):
    d = tiny_models.get("plain-rounds-llama", "llama", num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2)
    return load_engine(str(d), dtype="float64", device="cpu", prefill_step_size=8)


def spec(target: Engine, proposer, policy: DraftPolicy | None, **config) -> Engine:
    cfg = replace(target.config, **{"draft_schedule": f"1:{K}", **config})
    engine = Engine(target.model, target.tokenizer, cfg, target.model_dir, proposer=proposer, num_drafts=K)
    if policy is not None:
        engine.draft_policy = policy
    return engine


def eagle3(target: Engine, tmp_path):
    drafter_dir = write_random_eagle3(tmp_path / "e3", json.loads((target.model_dir / "config.json").read_text()),
                                      seed=5)
    drafter = load_eagle3(drafter_dir, target.model)
    return lambda: scripted(Eagle3Proposer)(drafter, target.model.vocab_size)


def suffix(target: Engine, tmp_path):
    # no shared cache of finished outputs: when a batch's outputs finish would change the drafts
    return lambda: scripted(SuffixProposer)(SuffixOptions(cache_tokens=0))


@pytest.mark.parametrize("make", [eagle3, suffix])
def test_drafting_every_third_round_drafts_what_every_round_drafts(target, tmp_path, monkeypatch, make):
    new = make(target, tmp_path)
    prompts = [target.tokenizer.encode(t) for t in TEXTS]
    plain = {tuple(ids): target.generate_all(ids, GREEDY).token_ids for ids in prompts}
    v = target.model.vocab_size

    every = new().setup(plain, v)
    results = spec(target, every, None).generate_batch(prompts, GREEDY)
    assert [r.token_ids for r in results] == [plain[tuple(ids)] for ids in prompts]

    sparse = new().setup(plain, v)
    engine = spec(target, sparse, EveryNth(3, K), overlap_decode=True)
    ahead = count_ahead(engine, monkeypatch)
    results = engine.generate_batch(prompts, GREEDY)
    assert [r.token_ids for r in results] == [plain[tuple(ids)] for ids in prompts]
    assert ahead.count(1) > 5, "rounds without drafts never ran overlapped"
    for ids in prompts:
        chosen = sparse.real[tuple(ids)]
        assert len(chosen) >= NEW // 3 - 2
        assert chosen == {n: every.real[tuple(ids)][n] for n in chosen}, "drafts differ after deferred rows"
    # the drafter observed a verify pass only after the rounds that drafted (one in three)
    assert every.verify_observes >= NEW - 2 and sparse.propose_calls <= NEW // 3 + 2
    assert sparse.verify_observes == sparse.propose_calls
    assert engine.blocks.num_used == 0 and len(engine.runner.deferred) == 0


def test_without_drafts_a_loaded_drafter_never_runs_and_decoding_is_the_plain_step(target, tmp_path, monkeypatch):
    prompt = target.tokenizer.encode(TEXTS[1])
    plain = {tuple(prompt): target.generate_all(prompt, GREEDY).token_ids}
    proposer = eagle3(target, tmp_path)().setup(plain, target.model.vocab_size)
    engine = spec(target, proposer, None, draft_schedule="1:0", overlap_decode=True)
    rounds = []
    original = engine._round
    monkeypatch.setattr(engine, "_round", lambda seqs, counts: (rounds.append(counts), original(seqs, counts)))
    ahead = count_ahead(engine, monkeypatch)
    prefill_calls = -(-len(prompt) // 8)
    result = engine.generate_all(prompt, GREEDY)
    assert result.token_ids == plain[tuple(prompt)]
    assert rounds == [] and ahead.count(1) >= NEW - 3  # every decode step was the overlapped plain step
    assert proposer.real == {} and proposer.observed_calls == prefill_calls + (NEW - 1) // 32
    assert result.stats.drafted == 0


def test_a_suffix_output_joins_the_shared_cache_whole_though_its_last_rows_were_never_observed(target):
    prompt = target.tokenizer.encode(TEXTS[0])
    proposer = SuffixProposer(SuffixOptions())
    engine = spec(target, proposer, None, draft_schedule="1:0")
    result = engine.generate_all(prompt, GREEDY)
    assert list(proposer.cache.index.docs.values()) == [result.token_ids]


def test_adaptive_choice_with_overlap_measures_both_kinds_of_round_and_keeps_the_output(target, tmp_path):
    """The default policy where plain steps run overlapped gets the draft gate (engine/draft_gate.py):
    after its first speculative rounds it times plain steps too; whichever it then picks, the
    output is plain greedy's. Asserted where the whole batch runs (its bucket's rounds come first and
    longest): how many rounds the shrinking batch's smaller buckets see follows the gate's timings."""
    prompts = [target.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=3 * NEW, temperature=0.0, ignore_eos=True)
    plain_long = {tuple(ids): target.generate_all(ids, params).token_ids for ids in prompts}
    proposer = eagle3(target, tmp_path)().setup(plain_long, target.model.vocab_size)
    engine = spec(target, proposer, None, draft_schedule=None, overlap_decode=True)
    assert engine.draft_policy.gate is not None
    results = engine.generate_batch(prompts, params)
    assert [r.token_ids for r in results] == [plain_long[tuple(ids)] for ids in prompts]
    rates = engine.load_stats()["drafts"]["gate"]
    whole = rates[1 << (draft_gate.bucket(len(prompts)) - 1)]  # keyed by a bucket's smallest batch
    assert whole["speculative_tok_s"] is not None and whole["plain_tok_s"] is not None, rates


def test_a_batch_the_gate_holds_off_stops_drafting_and_keeps_the_output(target, tmp_path, monkeypatch):
    """Where the draft gate will not open for longer than a drafter's unseen rows are kept, the batch's
    sequences stop drafting (engine.py `_rest_drafters`): no catch-up passes, no rows copied for the
    drafter, the output plain greedy's. A request arriving later where the gate is still shut starts
    without its drafter (no pass over its prompt, no drafter features kept at its block ends); one
    arriving where it is open starts with one."""
    from verispec.engine.prefix_rows import KeptRows

    prompts = [target.tokenizer.encode(t) for t in TEXTS]
    plain = {tuple(ids): target.generate_all(ids, GREEDY).token_ids for ids in prompts}
    proposer = eagle3(target, tmp_path)().setup(plain, target.model.vocab_size)
    engine = spec(target, proposer, None, draft_schedule=None, overlap_decode=True)
    gate = engine.draft_policy.gate
    for batch in (1, 2, len(prompts)):  # speculation measured slower at every size this batch passes
        for _ in range(draft_gate.MIN_SPEC):
            gate.record(batch, True, tokens=batch, seconds=1.0)
        assert not gate.allows(batch)  # the plain trial
        gate.record(batch, False, tokens=batch, seconds=0.01, steps=draft_gate.TRIAL_STEPS)
        assert gate.plain_steps(batch) >= engine.runner.deferred.max_rows
    results = engine.generate_batch(prompts, GREEDY)
    assert [r.token_ids for r in results] == [plain[tuple(ids)] for ids in prompts]
    prompt_passes = proposer.observed_calls
    assert proposer.propose_calls == 0 and proposer.decode_observes == 0  # no catch-up pass: 40 rows > 32
    assert len(engine.runner.deferred) == 0 and engine.blocks.num_used == 0
    # a later request alone: batch 1 is shut too, so its drafter never starts (a new text: its
    # blocks are registered now)
    asked = []
    at = KeptRows.at
    monkeypatch.setattr(KeptRows, "at", lambda self, b, i: asked.append(i) or at(self, b, i))
    new_text = target.tokenizer.encode("while True:")
    result = engine.generate_all(new_text, GREEDY)
    assert proposer.observed_calls == prompt_passes and proposer.propose_calls == 0
    assert result.token_ids == target.generate_all(new_text, GREEDY).token_ids
    assert engine.prefix is not None and len(result.token_ids) > engine.blocks.block_size and asked == []
    # with batch 1 measured afresh (unmeasured: the cost model decides), the next one drafts again
    del gate.buckets[draft_gate.bucket(1)]
    result = engine.generate_all(prompts[0], GREEDY)
    assert result.token_ids == plain[tuple(prompts[0])]
    assert proposer.observed_calls > prompt_passes and proposer.propose_calls > 0


def test_the_prewarm_leaves_the_draft_gate_unmeasured(target, tmp_path):
    """The prewarm's rounds run cold (first replays, compiles): the gate forgets them, so a server's
    first measurements are its own speed (they had kept one sequence from speculating where it paid)."""
    from verispec.engine import warmup

    ids = warmup.prewarm_prompt(target.tokenizer)
    plain = {tuple(ids): target.generate_all(ids, SamplingParams(max_tokens=4 * K, temperature=0.0, ignore_eos=True)).token_ids}
    proposer = eagle3(target, tmp_path)().setup(plain, target.model.vocab_size)
    engine = spec(target, proposer, None, draft_schedule=None, overlap_decode=True)
    recorded = []
    record = engine.draft_policy.gate.record
    engine.draft_policy.gate.record = lambda *a, **k: (recorded.append(a), record(*a, **k))[1]
    warmup.prewarm(engine)
    assert recorded, "the prewarm decoded no round: nothing to forget"
    assert engine.draft_policy.gate.buckets == {}
