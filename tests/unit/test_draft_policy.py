"""The adaptive draft choice: per sequence, per round, by a cost model and running acceptance."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from verispec.config import EngineConfig
from verispec.engine.acceptance import AcceptanceEstimate
from verispec.engine.draft_costs import AnalyticCosts, TableCosts
from verispec.engine.draft_policy import AdaptiveDrafts, ScheduledDrafts, draft_policy
from verispec.errors import VerispecError


@dataclass
class Seq:
    """What the policy reads of an engine sequence."""

    remaining_tokens: int = 1000
    drafting: bool = True
    acceptance: AcceptanceEstimate | None = None
    rounds_without_drafts: int = 0


def table(verify, draft=lambda b, k: 0.0, batches=(1, 2, 4, 8, 16, 32, 64), max_drafts=5) -> TableCosts:
    return TableCosts({(b, w): verify(b, w) for b in batches for w in range(1, max_drafts + 2)},
                      {(b, k): draft(b, k) for b in batches for k in range(1, max_drafts + 1)}, source="test")


def rate(policy: AdaptiveDrafts, gains: list[list[float]], counts: list[int]) -> float:
    """Expected tokens per unit of cost of `counts`, in the policy's own cost model."""
    n, depth = len(counts), max(counts)
    tokens = n + sum(sum(g[:k]) for g, k in zip(gains, counts))
    return tokens / (policy.costs.verify(n, depth + 1) + policy.costs.draft(sum(k > 0 for k in counts), depth))


def trained(rates: list[float]) -> AcceptanceEstimate:
    """An estimate settled on per-position acceptance `rates` (as after many rounds of them)."""
    est = AcceptanceEstimate(len(rates))
    est.sums, est.evidence = list(rates), [1.0] * len(rates)
    return est


def test_where_drafting_loses_in_the_cost_model_nothing_is_drafted():
    """Cost linear in rows from zero: k drafts cost k+1 steps for at most k+1 tokens, never a gain."""
    policy = AdaptiveDrafts(table(lambda b, w: float(b * w)), max_drafts=5)
    seqs = [Seq(acceptance=trained([1.0] * 5)) for _ in range(8)]
    for _ in range(10):
        assert policy.choose(seqs) == [0] * 8


def test_the_choice_never_rates_below_plain_decoding_in_its_own_model():
    rng = random.Random(1)
    for trial in range(200):
        flat = rng.choice([0, 8, 32, 128])
        slope = rng.uniform(0.001, 0.5)
        frac = rng.choice([0.0, 0.05, 0.3])
        policy = AdaptiveDrafts(AnalyticCosts(flat, slope, frac), max_drafts=rng.randint(1, 6))
        n = rng.randint(1, 40)
        gains = []
        for _ in range(n):
            p, g = 1.0, []
            for _ in range(policy.max_drafts):
                p *= rng.random()
                g.append(p)
            gains.append(g)
        counts = policy.best_counts(gains)
        assert rate(policy, gains, counts) >= rate(policy, gains, [0] * n) - 1e-12, (trial, counts)
        if any(counts):  # drafting was chosen: the model says it wins
            assert rate(policy, gains, counts) > rate(policy, gains, [0] * n)


def test_a_sequence_whose_acceptance_collapses_stops_drafting_and_is_probed():
    policy = AdaptiveDrafts(AnalyticCosts(64, 1 / 384, 0.05), max_drafts=4, probe_every=8)
    seq = Seq()
    assert policy.choose([seq]) != [0]  # the prior: half of drafts accepted, and drafting is cheap
    history = []
    for _ in range(40):
        [k] = policy.choose([seq])
        history.append(k)
        policy.observe([seq], [k], [0])  # never accepted
    late = history[10:]
    assert set(late) <= {0, 1}
    assert late.count(1) <= len(late) // 8 + 1  # only probes: one draft every 8 rounds
    assert 1 in late
    # it recovers: probes accepted raise its estimate until it drafts every round again
    for _ in range(60):
        [k] = policy.choose([seq])
        policy.observe([seq], [k], [k])
    assert all(policy.choose([seq])[0] >= 2 for _ in range(5))


def test_a_high_acceptance_sequence_gets_more_drafts_than_a_low_one():
    policy = AdaptiveDrafts(AnalyticCosts(64, 1 / 384, 0.05), max_drafts=5)
    high, low = Seq(acceptance=trained([0.95] * 5)), Seq(acceptance=trained([0.25] * 5))
    counts = policy.choose([high, low])
    assert counts[0] > counts[1], counts
    assert counts[0] == 5
    # on a CPU each row costs: alone, the low one is not worth a wider pass, the high one is
    cpu = AdaptiveDrafts(AnalyticCosts.default("cpu", 0.05), max_drafts=5)
    assert cpu.choose([high])[0] >= 2 and cpu.choose([Seq(acceptance=trained([0.15] * 5))]) == [0]


def test_on_a_cpu_four_sequences_at_middling_acceptance_draft_nothing():
    """The CPU's default prices a drafting sequence's round work besides the passes: the default
    model at 4 clients and 62% acceptance ran 0.89x plain drafting one each, at 1 client and 93%
    1.36x (docs/benchmarks.md)."""
    cpu = AdaptiveDrafts(AnalyticCosts.default("cpu", 0.06), max_drafts=1)
    assert cpu.choose([Seq(acceptance=trained([0.62])) for _ in range(4)]) == [0] * 4
    assert cpu.choose([Seq(acceptance=trained([0.93]))]) == [1]


def test_sequences_without_drafter_state_or_tokens_left_get_none():
    policy = AdaptiveDrafts(AnalyticCosts(64, 1 / 384, 0.0), max_drafts=3)
    good = trained([1.0] * 3)
    seqs = [Seq(acceptance=good), Seq(acceptance=good, drafting=False), Seq(acceptance=good, remaining_tokens=2),
            Seq(acceptance=good, remaining_tokens=1)]
    assert policy.choose(seqs) == [3, 0, 1, 0]


def test_the_stats_count_every_choice():
    policy = AdaptiveDrafts(table(lambda b, w: float(b * w)), max_drafts=2)
    policy.choose([Seq(), Seq()])
    stats = policy.stats.as_dict()
    assert stats["zero"] == 2 and stats["mean"] == 0 and stats["histogram"] == {0: 2}


def test_metrics_show_the_choices():
    from verispec.server.metrics import ServerMetrics

    policy = AdaptiveDrafts(AnalyticCosts(64, 1 / 384, 0.0), max_drafts=2)
    policy.choose([Seq(acceptance=trained([1.0, 1.0])), Seq(drafting=False)])
    metrics = ServerMetrics()
    metrics.observe_engine({"running": 2, "waiting": 0, "kv_blocks_used": 1, "kv_blocks_total": 8,
                            "preemptions": 0, "drafts": policy.stats.as_dict(), "prefix_cache": None})
    text = metrics.render().decode()
    assert "verispec_spec_drafts_per_round 1.0" in text
    assert "verispec_spec_sequences_drafting_zero 1.0" in text
    assert 'verispec_spec_draft_choices_total{drafts="2"} 1.0' in text


def test_a_schedule_overrides_the_adaptive_choice():
    config = EngineConfig(model="x", draft_schedule="1:3,4:1")
    policy = draft_policy(config, object(), 3, "cpu")
    assert isinstance(policy, ScheduledDrafts)
    assert policy.choose([Seq()] * 3) == [3, 3, 3] and policy.choose([Seq()] * 4) == [1] * 4


def test_acceptance_estimate_falls_back_position_by_position():
    est = AcceptanceEstimate(3)
    assert est.rates([0.5, 0.4, 0.3]) == [0.5, 0.4, 0.3]  # no evidence: the prior
    for _ in range(20):
        est.update(1, 1)  # probed with one draft, always accepted
    rates = est.rates([0.0, 0.0, 0.0])
    assert rates[0] > 0.99 and rates[1] > 0.99 and rates[2] > 0.99  # deeper positions follow position 1
    est.update(3, 1)  # position 2 rejected once
    assert est.rates([0.0] * 3)[1] < 0.75


def test_table_interpolates_between_points_and_extends_past_them():
    costs = TableCosts({(1, 1): 10.0, (1, 2): 10.0, (8, 1): 12.0, (8, 2): 20.0}, {(1, 1): 1.0, (8, 1): 2.0})
    assert costs.verify(1, 1) == 10 and costs.verify(8, 2) == 20
    assert costs.verify(4, 2) == pytest.approx(10 + 10 * 3 / 7)
    assert costs.verify(15, 2) == pytest.approx(30)  # along the last segment
    assert costs.verify(8, 3) == pytest.approx(28)
    assert costs.draft(8, 2) == pytest.approx(2) and costs.draft(0, 2) == 0


def test_table_file_round_trip(tmp_path):
    costs = table(lambda b, w: 5.0 + b * w / 16, lambda b, k: 0.1 * k, max_drafts=2)
    path = tmp_path / "costs.json"
    costs.save(path, device="cpu")
    again = TableCosts.load(path)
    assert again.verify_points == costs.verify_points and again.draft_points == costs.draft_points
    assert json.loads(path.read_text())["device"] == "cpu"


@pytest.mark.parametrize("content, match", [
    ("not json", "not JSON"),
    ('{"verify": []}', "not a draft-cost table"),
    ('{"format": "verispec-draft-costs", "version": 9, "verify": []}', "version 9"),
    ('{"format": "verispec-draft-costs", "version": 1, "verify": []}', '"verify" must be a list'),
    ('{"format": "verispec-draft-costs", "version": 1, "verify": [{"batch": 1}]}', "needs integer"),
    ('{"format": "verispec-draft-costs", "version": 1, "verify": [{"batch": 0, "width": 1, "ms": 1}]}',
     "out of range"),
])
def test_bad_table_files_are_one_line_errors(tmp_path, content, match):
    path = tmp_path / "costs.json"
    path.write_text(content)
    with pytest.raises(VerispecError, match=match) as info:
        TableCosts.load(path)
    assert "--draft-costs" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(VerispecError, match="cannot read"):
        TableCosts.load(tmp_path / "missing.json")


@pytest.mark.parametrize("args, message", [
    (["--draft-costs", "/nowhere/costs.json"], "--draft-costs /nowhere/costs.json: cannot read it"),
    (["--draft-costs", "measure", "--draft-schedule", "1:2"],
     "--draft-costs weighs the adaptive draft choice and --draft-schedule replaces it; use one of them"),
])
def test_cli_bad_draft_cost_flags_are_one_line(capsys, args, message):
    """Refused before any model loads (the model path does not exist)."""
    from verispec.cli import main as cli_main

    code = cli_main(["generate", "-m", "/nowhere/model", "--prompt", "x", "--suffix", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines()[0].startswith(f"verispec: error: {message}"), err
    assert len(err.splitlines()) == 1


def test_plain_rounds_then_skip_choose_as_every_round_would():
    """The overlapped plain path asks how many rounds after a draft-free one stay draft-free, runs
    them unchosen and skips them: the rounds that draft (probes) come where choosing every round
    puts them, with the same counts."""
    def run(skipping: bool) -> list[list[int]]:
        policy = AdaptiveDrafts(table(lambda b, w: float(b * w)), max_drafts=3, probe_every=5)
        seqs = [Seq(acceptance=trained([0.0] * 3)) for _ in range(3)]
        rounds: list[list[int]] = []
        while len(rounds) < 23:
            counts = policy.choose(seqs)
            rounds.append(counts)
            if skipping and not any(counts):
                ahead = min(policy.plain_rounds(seqs), 23 - len(rounds))
                policy.skip(seqs, ahead)
                rounds += [[0] * 3] * ahead
        return rounds, policy.stats.as_dict()

    every, every_stats = run(False)
    skipped, skipped_stats = run(True)
    assert skipped == every and every_stats == skipped_stats
    assert [i for i, c in enumerate(every) if any(c)] == [4, 9, 14, 19]  # the probes


def test_a_schedule_without_drafts_has_no_end_of_plain_rounds():
    from verispec.engine.draft_schedule import DraftSchedule

    policy = ScheduledDrafts(DraftSchedule.parse("1:2,4:0", 2))
    assert policy.plain_rounds([Seq()] * 4) >= 1 << 20
    policy.skip([Seq()] * 4, 10)
    assert policy.stats.as_dict()["histogram"] == {0: 40}


def test_new_sequences_start_without_a_drafter_only_where_fresh_ones_would_draft_nothing():
    """A sequence joining a batch where the cost model would give fresh sequences no drafts starts
    without its drafter (engine.py `_starts_plain`); good acceptance widens where they draft, and
    bad acceptance never narrows it below the initial guess (speculation must not switch itself
    off for good after a bad stretch)."""
    policy = AdaptiveDrafts(AnalyticCosts.default("cpu", 0.06), max_drafts=1)
    assert not policy.drafts_nothing_at(1)
    assert policy.drafts_nothing_at(2) and policy.drafts_nothing_at(8)
    for _ in range(200):
        policy.overall.update(1, 1)  # every draft accepted
    assert not policy.drafts_nothing_at(3) and policy.drafts_nothing_at(8)
    for _ in range(2000):
        policy.overall.update(1, 0)  # none accepted
    assert not policy.drafts_nothing_at(1) and policy.drafts_nothing_at(2)
