"""The draft gate (engine/draft_gate.py): speculation only where this server measured its
speculative rounds faster than its plain steps, per batch-size bucket, with trials of the other
kind now and then; and the adaptive policy drafting nothing where the gate is shut although its cost
model says drafting pays."""
from __future__ import annotations

from verispec.engine import draft_gate
from verispec.engine.draft_costs import AnalyticCosts
from verispec.engine.draft_gate import ThroughputGate, bucket
from verispec.engine.draft_policy import AdaptiveDrafts


def measure(gate: ThroughputGate, batch: int, spec_rate: float, plain_rate: float, rounds: int) -> list[bool]:
    """Runs `rounds` rounds as the engine would (a plain step where the gate is shut) and returns
    whether each one speculated; rates are tokens per second per sequence."""
    choices = []
    for _ in range(rounds):
        speculates = gate.allows(batch)
        choices.append(speculates)
        rate = spec_rate if speculates else plain_rate
        gate.record(batch, speculates, tokens=batch * 10, seconds=batch * 10 / (rate * batch))
    return choices


def test_slower_speculation_is_shut_off_after_a_plain_trial():
    gate = ThroughputGate()
    choices = measure(gate, 8, spec_rate=100.0, plain_rate=200.0, rounds=draft_gate.MIN_SPEC + draft_gate.TRIAL_STEPS + 50)
    assert all(choices[:draft_gate.MIN_SPEC])  # nothing known of plain steps yet: the cost model's choice
    assert not any(choices[draft_gate.MIN_SPEC:])  # a trial, then plain: it was faster
    assert gate.plain_steps(8) > 1
    assert gate.as_dict()[8]["speculates"] is False


def test_shut_gate_rechecks_speculation_and_opens_when_it_got_faster():
    gate = ThroughputGate()
    measure(gate, 4, spec_rate=100.0, plain_rate=200.0, rounds=draft_gate.MIN_SPEC + draft_gate.TRIAL_STEPS)
    assert not gate.allows(4)
    choices = measure(gate, 4, spec_rate=400.0, plain_rate=200.0, rounds=draft_gate.RECHECK + 40)
    first = choices.index(True)
    assert first >= draft_gate.RECHECK - draft_gate.TRIAL_STEPS - 8  # plain (the trial counting) until the recheck
    assert all(choices[first:first + draft_gate.TRIAL_ROUNDS])
    assert gate.as_dict()[4]["speculates"] is True


def test_faster_speculation_stays_on_with_a_plain_trial_every_recheck():
    gate = ThroughputGate()
    choices = measure(gate, 1, spec_rate=300.0, plain_rate=200.0, rounds=2 * draft_gate.RECHECK + 100)
    plain = choices.count(False)
    assert 0 < plain <= 3 * draft_gate.TRIAL_STEPS
    assert gate.as_dict()[1]["speculates"] is True


def test_slow_first_rounds_do_not_shut_speculation_that_pays():
    """A server's first speculative rounds replay graphs for the first time (here 100x slower): the
    median of the latest rounds decides, not an average those rounds weigh on."""
    gate = ThroughputGate()
    for i in range(draft_gate.MIN_SPEC):
        assert gate.allows(1)
        gate.record(1, True, tokens=30, seconds=10.0 if i < 3 else 0.1)  # 3 tokens a round, 300 tok/s
    choices = measure(gate, 1, spec_rate=300.0, plain_rate=250.0, rounds=100)
    assert choices.count(True) > 80 and gate.as_dict()[1]["speculates"] is True


def test_a_recheck_measures_speculation_afresh():
    """Speculation measured slow once (a text nothing was accepted on) opens at the next recheck
    once it pays; the recheck's slow first round (the drafter catching up) does not decide it."""
    gate = ThroughputGate()
    measure(gate, 2, spec_rate=20.0, plain_rate=200.0, rounds=draft_gate.MIN_SPEC + draft_gate.TRIAL_STEPS + 10)
    assert not gate.allows(2)
    choices, caught_up = [], False
    for _ in range(draft_gate.RECHECK + 40):
        speculates = gate.allows(2)
        choices.append(speculates)
        if speculates and not caught_up:  # the catch-up round: slow
            gate.record(2, True, tokens=2, seconds=1.0)
            caught_up = True
            continue
        rate = 300.0 if speculates else 200.0
        gate.record(2, speculates, tokens=20, seconds=20 / (rate * 2))
    assert caught_up and gate.as_dict()[2]["speculates"] is True
    assert all(choices[-20:])


def test_a_rate_is_tokens_over_time_not_a_typical_round():
    """One sequence: most speculative rounds keep one token, one in three keeps all five (1,000
    tok/s over time against plain's 800). The median round (one token, 500 tok/s) would shut the
    gate; tokens over time keep it open. A stall (a compile) is left out rather than averaged in."""
    gate = ThroughputGate()
    for i in range(60):
        if gate.allows(1):
            tokens = 5 if i % 3 == 0 else 1
            gate.record(1, True, tokens=tokens, seconds=2.0 if i == 4 else 0.002)
        else:
            gate.record(1, False, tokens=16, seconds=16 / 800, steps=16)
    assert gate.as_dict()[1]["plain_tok_s"] is not None
    assert gate.as_dict()[1]["speculates"] is True and gate.allows(1)
    assert 900 < gate.as_dict()[1]["speculative_tok_s"] < 1400  # ~7/3 tokens a 2 ms round; the stall left out


def test_a_bucket_is_settled_by_a_plain_trial_not_by_rounds_outside_one():
    """A batch growing into a bucket may run plain rounds there first, not overlapped (a prompt was
    pending). They settle nothing: speculation runs its MIN_SPEC rounds, then a plain trial
    measures plain steps afresh (here faster: the bucket shuts)."""
    gate = ThroughputGate()
    gate.record(32, False, tokens=32, seconds=1.0)  # slow: it would make any speculation look good
    for _ in range(draft_gate.MIN_SPEC):
        assert gate.allows(32) and gate.plain_steps(32) is None
        gate.record(32, True, tokens=32, seconds=0.05)
    assert not gate.allows(32)  # the trial
    gate.record(32, False, tokens=32 * draft_gate.TRIAL_STEPS, seconds=0.002 * draft_gate.TRIAL_STEPS,
                steps=draft_gate.TRIAL_STEPS)
    assert not gate.allows(32) and gate.plain_steps(32) > draft_gate.RECHECK // 2


def test_a_bucket_past_one_where_plain_won_starts_shut():
    """Speculation's gain per sequence shrinks as the batch grows: a bucket above one that measured
    plain steps faster starts with its measurements, shut, instead of paying MIN_SPEC losing rounds;
    a smaller bucket is measured on its own."""
    gate = ThroughputGate()
    measure(gate, 8, spec_rate=100.0, plain_rate=200.0, rounds=draft_gate.MIN_SPEC + draft_gate.TRIAL_STEPS + 5)
    assert not gate.allows(8)
    assert not gate.allows(16) and not gate.allows(64) and gate.plain_steps(64) > 1
    assert gate.allows(4)
    gate.record(64, False, tokens=64, seconds=64 / (300 * 64))  # its own plain steps: shut still
    assert not gate.allows(64) and gate.as_dict()[64]["speculative_tok_s"] is None
    choices = measure(gate, 64, spec_rate=500.0, plain_rate=300.0, rounds=draft_gate.RECHECK + 30)
    assert not any(choices[:draft_gate.RECHECK // 2]) and all(choices[-10:])  # the recheck measured it faster


def test_a_recheck_where_nothing_drafts_keeps_the_gate_shut():
    """At a recheck the batch's sequences may all rest their drafters: the round drafts nothing,
    so it measured nothing; the gate keeps its rates and stays shut for another RECHECK steps
    instead of waiting, open, for a speculative round that never comes."""
    gate = ThroughputGate()
    measure(gate, 64, spec_rate=50.0, plain_rate=400.0, rounds=draft_gate.MIN_SPEC + draft_gate.TRIAL_STEPS)
    before = gate.as_dict()[64]
    assert before["speculates"] is False
    gate.record(64, False, tokens=64 * draft_gate.RECHECK, seconds=1.0, steps=draft_gate.RECHECK)
    assert gate.allows(64)  # the recheck
    gate.record(64, False, tokens=64, seconds=64 / (400 * 64))  # nothing drafted
    assert not gate.allows(64) and gate.plain_steps(64) >= draft_gate.RECHECK - 1
    assert gate.as_dict()[64]["speculative_tok_s"] == before["speculative_tok_s"]


def test_shut_says_where_new_sequences_start_without_their_drafters():
    gate = ThroughputGate()
    assert not gate.shut(8)  # unmeasured: the cost model decides, drafters start
    measure(gate, 8, spec_rate=100.0, plain_rate=200.0, rounds=draft_gate.MIN_SPEC + draft_gate.TRIAL_STEPS)
    assert gate.shut(8) and gate.shut(12)  # the same bucket
    assert gate.shut(32)  # a larger batch starts shut after a smaller one where plain won
    assert not gate.shut(2)  # a smaller one is unmeasured
    # a recheck under way measures speculation: sequences joining it draft
    for _ in range(2 * draft_gate.RECHECK):
        if gate.allows(8):
            break
        gate.record(8, False, tokens=80, seconds=0.4)
    assert gate.allows(8) and not gate.shut(8)


def test_buckets_are_measured_apart():
    gate = ThroughputGate()
    measure(gate, 32, spec_rate=50.0, plain_rate=200.0, rounds=60)
    measure(gate, 1, spec_rate=300.0, plain_rate=200.0, rounds=60)
    assert not gate.allows(40) and gate.allows(1)
    assert bucket(32) == bucket(63) != bucket(64)


class _Seq:
    """What the policy reads of a sequence."""

    def __init__(self, i: int):
        self.id = i
        self.drafting = True
        self.remaining_tokens = 100
        self.acceptance = None
        self.rounds_without_drafts = 0


def test_policy_drafts_nothing_where_the_gate_is_shut():
    policy = AdaptiveDrafts(AnalyticCosts(flat_rows=64, row_cost=1 / 384, draft_fraction=0.05), max_drafts=3)
    policy.gate = ThroughputGate()  # as the engine sets it where plain steps run overlapped
    seqs = [_Seq(i) for i in range(8)]
    assert any(policy.choose(seqs))  # the cost model alone: drafting pays at 8 sequences
    for _ in range(draft_gate.MIN_SPEC):
        policy.gate.record(8, True, tokens=8, seconds=0.01)
    assert not any(policy.choose(seqs))  # the plain trial
    for _ in range(draft_gate.TRIAL_STEPS):
        policy.gate.record(8, False, tokens=8, seconds=0.001)
    assert not any(policy.choose(seqs))
    assert policy.plain_rounds(seqs) >= draft_gate.RECHECK // 2


def test_a_round_timed_across_a_forget_is_not_recorded():
    """The prewarm forgets its cold rounds while the engine's thread may still be timing the last
    one (its tokens are out before it is recorded): that round must not land after the forget."""
    gate = ThroughputGate()
    began = gate.epoch
    gate.forget()
    gate.record(1, True, tokens=3, seconds=0.01, epoch=began)
    assert gate.buckets == {}
    gate.record(1, True, tokens=3, seconds=0.01, epoch=gate.epoch)
    assert gate.buckets[bucket(1)].spec_rounds == 1


def recheck_starts(choices: list[bool]) -> list[int]:
    """The rounds where a run of speculative rounds began after plain steps."""
    return [i for i in range(1, len(choices)) if choices[i] and not choices[i - 1]]


def test_rechecks_that_change_nothing_come_ever_less_often():
    """A settled gate's trials of the losing kind cost it a few percent each: each trial that finds
    the same winner doubles the interval to the next, up to MAX_RECHECK."""
    gate = ThroughputGate()
    start = draft_gate.MIN_SPEC + draft_gate.TRIAL_STEPS
    measure(gate, 2, spec_rate=100.0, plain_rate=200.0, rounds=start)
    choices = measure(gate, 2, spec_rate=100.0, plain_rate=200.0, rounds=3 * draft_gate.MAX_RECHECK)
    starts = recheck_starts([False] + choices)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    expected = [2 * draft_gate.RECHECK, 4 * draft_gate.RECHECK, 8 * draft_gate.RECHECK] + [draft_gate.MAX_RECHECK] * 2
    assert len(gaps) >= len(expected)
    for gap, interval in zip(gaps, expected):  # (the recheck's own rounds and its first step counting)
        assert abs(gap - interval) <= draft_gate.TRIAL_ROUNDS, gaps
    assert sum(choices) <= draft_gate.TRIAL_ROUNDS * (len(starts) + 1)


def test_a_trial_that_changes_the_choice_sets_the_interval_back():
    gate = ThroughputGate()
    measure(gate, 2, spec_rate=100.0, plain_rate=200.0, rounds=draft_gate.MIN_SPEC + draft_gate.TRIAL_STEPS)
    measure(gate, 2, spec_rate=100.0, plain_rate=200.0, rounds=8 * draft_gate.RECHECK)  # backed off
    assert gate.buckets[bucket(2)].recheck > draft_gate.RECHECK
    choices = measure(gate, 2, spec_rate=400.0, plain_rate=200.0, rounds=draft_gate.MAX_RECHECK + 100)
    flipped = choices.index(True)  # the next recheck found speculation faster: it speculates from there
    assert all(choices[flipped:flipped + 100])
    first_plain_trial = choices.index(False, flipped)
    assert abs(first_plain_trial - flipped - draft_gate.RECHECK) <= draft_gate.TRIAL_ROUNDS
