"""The adaptive draft choice (the engine's default) keeps speculative greedy output identical to
plain greedy output, alone and in batches, and stops drafting for a proposer that is never right."""
from __future__ import annotations

from tests.doubles import KeyedReplay
from tests.spec.conftest import greedy, spec_engine

NEW_TOKENS = 48
K = 4


def _continuations(engine, prompt_ids) -> dict[tuple, list[int]]:
    return {tuple(ids): engine.generate_all(ids, greedy(NEW_TOKENS)).token_ids for ids in prompt_ids}


def test_adaptive_greedy_equals_plain_alone_right_and_wrong(targets, prompt_ids):
    engine = targets["qwen3"]
    plain = _continuations(engine, prompt_ids)
    right = spec_engine(engine, KeyedReplay(plain, engine.model.vocab_size), K, adaptive=True)
    wrong = spec_engine(engine, KeyedReplay(plain, engine.model.vocab_size, wrong_at=lambda i: True), K,
                        adaptive=True)
    for ids in prompt_ids:
        ok = right.generate_all(ids, greedy(NEW_TOKENS))
        bad = wrong.generate_all(ids, greedy(NEW_TOKENS))
        assert ok.token_ids == bad.token_ids == plain[tuple(ids)]
        assert ok.stats.accepted == ok.stats.drafted > 0
        assert ok.stats.rounds < NEW_TOKENS - 1  # drafts paid: fewer passes than tokens
        assert bad.stats.accepted == 0
        # a proposer never right stops being asked, but for the odd probe
        assert bad.stats.drafted < NEW_TOKENS // 2, bad.stats


def test_adaptive_greedy_equals_plain_in_a_mixed_batch(targets, prompt_ids):
    """Sequences right, wrong and right-then-wrong decode together: each gets its own count per
    round (the pass is padded to the widest), and each output is its plain one."""
    engine = targets["qwen3"]
    prompts = [list(ids) for ids in prompt_ids] + [list(ids) + [7] for ids in prompt_ids]
    plain = _continuations(engine, prompts)
    kinds = {tuple(ids): i % 3 for i, ids in enumerate(prompts)}
    # right everywhere (kind 0), wrong everywhere (1), wrong from the 16th generated token on (2)
    class Mixed(KeyedReplay):
        def reset(self, prompt):
            super().reset(prompt)
            kind = kinds[tuple(prompt)]
            self.wrong_at = {0: lambda i: False, 1: lambda i: True, 2: lambda i: i >= 16}[kind]

    mixed = Mixed(plain, engine.model.vocab_size)
    spec = spec_engine(engine, mixed, K, adaptive=True)
    results = spec.generate_batch(prompts, greedy(NEW_TOKENS))
    for ids, result in zip(prompts, results):
        assert result.token_ids == plain[tuple(ids)]
    assert any(r.stats.accepted for r in results)
    stats = spec.load_stats()["drafts"]
    assert sum(stats["histogram"].values()) > 0 and stats["histogram"].get(0, 0) > 0


def test_measured_costs_fill_a_table_and_keep_the_output(targets, prompt_ids):
    """--draft-costs measure: the engine times its own passes at its first step (every batch size
    x width, every drafts count) and decodes with them; the output is the plain one."""
    from dataclasses import replace

    from tests.spec.conftest import Engine
    from verispec.engine.draft_costs import TableCosts

    engine = targets["qwen3"]
    plain = _continuations(engine, prompt_ids[:1])
    config = replace(engine.config, draft_costs="measure", max_num_seqs=3)
    spec = Engine(engine.model, engine.tokenizer, config, engine.model_dir,
                  proposer=KeyedReplay(plain, engine.model.vocab_size), num_drafts=2)
    result = spec.generate_all(prompt_ids[0], greedy(NEW_TOKENS))
    assert result.token_ids == plain[tuple(prompt_ids[0])]
    costs = spec.draft_policy.costs
    assert isinstance(costs, TableCosts)
    assert set(costs.verify_points) == {(b, w) for b in (1, 2, 3) for w in (1, 2, 3)}
    assert set(costs.draft_points) == {(b, n) for b in (1, 2, 3) for n in (1, 2)}
    assert all(ms > 0 for ms in costs.verify_points.values())
    assert spec.blocks.num_used == 0  # the timed sequences gave their blocks back
