"""How many drafts each decoding sequence proposes this round.

Two policies behind one interface (`choose` before the round, `observe` after it):
- `AdaptiveDrafts` (the default): per sequence, per round, from a cost model (engine/draft_costs.py)
  and each sequence's running acceptance (engine/acceptance.py), the counts whose expected
  accepted tokens per unit of step time is highest; zero for everyone when drafting does not pay,
  and, where plain steps run overlapped (CUDA), for everyone where this server's speculative rounds
  measured slower than its plain steps (engine/draft_gate.py).
- `ScheduledDrafts`: `--draft-schedule B:K,...`, the same count for every sequence by batch size.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from verispec.engine.acceptance import AcceptanceEstimate
from verispec.engine.draft_costs import CostModel
from verispec.engine.draft_gate import ThroughputGate
from verispec.engine.draft_schedule import DraftSchedule
from verispec.engine.sequence import Sequence

UNBOUNDED = 1 << 30  # plain_rounds when no round would draft while the batch stays the same
PROBE_EVERY = 16  # a sequence that drafts nothing is tried with one draft every this many rounds
MIN_GAIN = 0.1  # a draft expected to add fewer tokens is not made: the cost model is an estimate
INITIAL_RATE = 0.5  # per-position acceptance assumed before any sequence has been verified
OVERALL_WEIGHT = 0.05  # the server-wide estimate (new sequences' prior) moves slower than a sequence's


@dataclass
class DraftStats:
    """What /metrics shows of the choices: the last round's, and a count of every sequence-round by
    the drafts it was given."""

    last_mean: float = 0.0
    last_zero: int = 0  # sequences given no drafts in the last round
    last_batch: int = 0
    histogram: dict[int, int] = field(default_factory=dict)  # drafts -> sequence-rounds since start

    def record(self, counts: list[int], num_rounds: int = 1) -> None:
        """num_rounds rounds that each gave these counts."""
        self.last_batch = len(counts)
        self.last_mean = sum(counts) / len(counts) if counts else 0.0
        self.last_zero = sum(1 for k in counts if k == 0)
        for k in counts:
            self.histogram[k] = self.histogram.get(k, 0) + num_rounds

    def as_dict(self) -> dict:
        return {"mean": self.last_mean, "zero": self.last_zero, "batch": self.last_batch,
                "histogram": dict(sorted(self.histogram.items()))}


def draft_cap(seq: Sequence, max_drafts: int) -> int:
    """The most drafts a sequence can use: none without drafter state, none past its last token."""
    return max(0, min(max_drafts, seq.remaining_tokens - 1)) if seq.drafting else 0


class DraftPolicy(ABC):
    max_drafts: int

    def __init__(self):
        self.stats = DraftStats()

    @abstractmethod
    def choose(self, seqs: list[Sequence]) -> list[int]:
        """Drafts for each decoding sequence this round (an upper bound: a model-free proposer may
        draft fewer)."""

    def observe(self, seqs: list[Sequence], drafted: list[int], accepted: list[int]) -> None:
        """The round's outcome per sequence: drafts verified and drafts accepted."""

    @abstractmethod
    def plain_rounds(self, seqs: list[Sequence]) -> int:
        """After a round in which `seqs` were all given no drafts: how many rounds after it would give
        them none too, as long as the batch stays the same (without choosing: nothing changes). The
        overlapped plain path runs that many rounds without asking, then `skip`s them."""

    def skip(self, seqs: list[Sequence], num_rounds: int) -> None:
        """Account for num_rounds rounds that ran without drafts, unchosen (see plain_rounds)."""
        if num_rounds:
            self.stats.record([0] * len(seqs), num_rounds)

    def describe_choices(self) -> dict:
        """What /metrics shows: the choices' statistics (and the adaptive policy's gate)."""
        return self.stats.as_dict()

    @abstractmethod
    def describe(self) -> str:
        ...


class ScheduledDrafts(DraftPolicy):
    def __init__(self, schedule: DraftSchedule):
        super().__init__()
        self.schedule = schedule
        self.max_drafts = schedule.max_drafts

    def choose(self, seqs: list[Sequence]) -> list[int]:
        k = self.schedule.drafts_for(len(seqs))
        counts = [min(k, draft_cap(s, self.max_drafts)) for s in seqs]
        self.stats.record(counts)
        return counts

    def plain_rounds(self, seqs: list[Sequence]) -> int:
        return UNBOUNDED  # the count depends on the batch size alone

    def describe(self) -> str:
        return f"drafts per round by batch size {self.schedule.describe()}"


class AdaptiveDrafts(DraftPolicy):
    def __init__(self, costs: CostModel, max_drafts: int, probe_every: int = PROBE_EVERY,
                 min_gain: float = MIN_GAIN, initial_rate: float = INITIAL_RATE):
        super().__init__()
        self.costs = costs
        self.max_drafts = max_drafts
        self.probe_every = probe_every
        self.min_gain = min_gain
        self.initial = [initial_rate] * max_drafts
        self.overall = AcceptanceEstimate(max_drafts, OVERALL_WEIGHT)
        self.num_rounds = 0
        # the engine's measured word on each batch size (engine/draft_gate.py says why)
        self.gate: ThroughputGate | None = None

    def estimate(self, seq: Sequence) -> AcceptanceEstimate:
        if seq.acceptance is None:
            seq.acceptance = AcceptanceEstimate(self.max_drafts)
        return seq.acceptance

    def choose(self, seqs: list[Sequence]) -> list[int]:
        self.num_rounds += 1
        caps = [draft_cap(s, self.max_drafts) for s in seqs]
        counts = [0] * len(seqs)
        if any(caps) and (self.gate is None or self.gate.allows(len(seqs))):
            prior = self.overall.rates(self.initial)
            gains = [self.estimate(s).expected_tokens(prior)[:cap] if cap else [] for s, cap in zip(seqs, caps)]
            counts = self.best_counts(gains)
            counts = self._probe(seqs, caps, counts)
        for seq, k in zip(seqs, counts):
            seq.rounds_without_drafts = 0 if k else seq.rounds_without_drafts + 1
        self.stats.record(counts)
        return counts

    def drafts_nothing_at(self, batch: int) -> bool:
        """Whether `batch` fresh sequences would draft nothing (the cost model's choice at the
        acceptance measured so far, never taken below the initial guess: a stretch of bad drafts
        must not keep every later sequence from ever drafting): one joining such a batch need not
        start its drafter."""
        rates = [max(r, r0) for r, r0 in zip(self.overall.rates(self.initial), self.initial)]
        gains = AcceptanceEstimate(self.max_drafts).expected_tokens(rates)
        return not any(self.best_counts([gains] * batch))

    def best_counts(self, gains: list[list[float]]) -> list[int]:
        """gains[b][i]: the tokens a draft i+1 of sequence b is expected to add. The counts with the
        most expected tokens per unit of cost: for each pass width, sequences join (best first, each
        with its drafts worth at least min_gain up to the width) while what one adds per unit of
        cost it adds beats the rate so far; then the best width."""
        n = len(gains)
        plain = self.costs.verify(n, 1)
        best, best_rate = [0] * n, n / plain
        useful = [sum(1 for _ in _while_at_least(g, self.min_gain)) for g in gains]
        for width in range(2, max(useful, default=0) + 2):
            depth = width - 1
            verify = self.costs.verify(n, width)
            offers = sorted(((sum(g[:min(u, depth)]), b) for b, (g, u) in enumerate(zip(gains, useful)) if u),
                            reverse=True)
            counts, tokens, rows = [0] * n, float(n), 0
            cost = verify
            for value, b in offers:
                new_cost = verify + self.costs.draft(rows + 1, depth)
                if (tokens + value) * cost <= tokens * new_cost:  # the rate would not rise
                    break
                counts[b] = min(useful[b], depth)
                tokens, cost, rows = tokens + value, new_cost, rows + 1
            if not rows:
                continue
            actual = max(counts)  # every sequence may stop short of the width
            rate = tokens / (self.costs.verify(n, actual + 1) + self.costs.draft(rows, actual))
            if rate > best_rate:
                best, best_rate = counts, rate
        return best

    def _probe(self, seqs: list[Sequence], caps: list[int], counts: list[int]) -> list[int]:
        """One draft for each sequence that has gone `probe_every` rounds without, so one whose
        acceptance collapsed can show it recovered; aligned across sequences (every probe_every-th
        round), so a batch widens its pass for probes at most that often."""
        if self.num_rounds % self.probe_every:
            return counts
        return [1 if k == 0 and cap and s.rounds_without_drafts + 1 >= self.probe_every else k
                for s, cap, k in zip(seqs, caps, counts)]

    def plain_rounds(self, seqs: list[Sequence]) -> int:
        """Acceptance estimates move only when something is drafted and caps only shrink, so the
        choice stays none until the next probing round."""
        if not any(draft_cap(s, self.max_drafts) for s in seqs):
            return UNBOUNDED
        rounds = (self.probe_every - (self.num_rounds + 1) % self.probe_every) % self.probe_every
        gated = self.gate.plain_steps(len(seqs)) if self.gate is not None else None
        return rounds if gated is None else max(rounds, gated - 1)

    def describe_choices(self) -> dict:
        return dict(self.stats.as_dict(), gate=self.gate.as_dict() if self.gate is not None else {})

    def skip(self, seqs: list[Sequence], num_rounds: int) -> None:
        super().skip(seqs, num_rounds)
        self.num_rounds += num_rounds
        for seq in seqs:
            seq.rounds_without_drafts += num_rounds

    def observe(self, seqs: list[Sequence], drafted: list[int], accepted: list[int]) -> None:
        for seq, k, a in zip(seqs, drafted, accepted):
            if k:
                self.estimate(seq).update(k, a)
                self.overall.update(k, a)

    def describe(self) -> str:
        drafts = "1 draft" if self.max_drafts == 1 else f"{self.max_drafts} drafts"
        return f"up to {drafts} per sequence, chosen per round by cost ({self.costs.describe()})"


def _while_at_least(gains: list[float], floor: float):
    for g in gains:
        if g < floor:
            return
        yield g


def draft_policy(config, proposer, max_drafts: int, device_type: str) -> DraftPolicy:
    """The engine's policy: --draft-schedule when given (checked even without a proposer), else the
    adaptive choice over --draft-costs (a table file; "measure": the analytic model until prewarm
    measures the engine's own passes; none: the analytic model)."""
    from verispec.engine.draft_costs import AnalyticCosts, TableCosts

    if config.draft_schedule or proposer is None or max_drafts < 1:
        return ScheduledDrafts(DraftSchedule.parse(config.draft_schedule, max_drafts))
    if config.draft_costs and config.draft_costs != MEASURE:
        costs = TableCosts.load(config.draft_costs)
    else:
        costs = AnalyticCosts.default(device_type, proposer.draft_cost_fraction)
    return AdaptiveDrafts(costs, max_drafts)


MEASURE = "measure"  # --draft-costs measure: time the engine's passes at start-up
