"""Whether speculating pays at this batch size, as measured on this server: the adaptive draft
choice's last word.

The cost model (engine/draft_costs.py) prices the passes, but not what a speculative round costs
the host: drafting, building the pass, a sync to read its tokens, per-sequence verification. A
round that drafts nothing runs overlapped instead (engine/overlap.py: the next step queued while the
host handles the last), which hides that work. Where the host's share is large (a small model, many
sequences) speculating loses even at good acceptance. So the engine times both kinds of round (tokens
per second per sequence, per batch-size bucket) and speculates only where its
rounds are the faster ones, trying the other kind again now and then, so a change in load or text
is noticed:

- no measurement of plain steps yet (the policy drafted every round so far): after MIN_SPEC rounds, a
  trial of TRIAL_STEPS plain steps;
- speculation measured slower: plain steps, with TRIAL_ROUNDS speculative rounds every RECHECK steps;
- plain measured slower: speculation, with a plain trial every RECHECK rounds.

A kind's rate is the median of its latest WINDOW measurements, and a trial measures its kind afresh
(its older measurements dropped): a moving average kept a server's first speculative rounds, slow
with first replays, and a few recheck rounds every RECHECK steps did not outweigh them. The first
speculative round after plain steps carries the drafter's catch-up over the rows it did not see, a
cost of switching that a stretch of speculation pays once: it is not counted where the kind has
other measurements (a recheck, which starts with none, counts it as one of its rounds' median).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

MIN_SPEC = 8  # speculative rounds in a bucket before plain steps are tried there
TRIAL_STEPS = 16  # plain steps a trial runs (overlapped: several steps make one measurement)
TRIAL_ROUNDS = 6  # speculative rounds a recheck runs (their median outweighs its catch-up round)
RECHECK = 256  # rounds or steps of the winning kind between trials of the other
WINDOW = 16  # measurements a kind's rate is the median of


def bucket(batch: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: throughput per sequence moves little within one."""
    return max(1, batch).bit_length()


@dataclass
class _Bucket:
    spec_rates: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # tokens/s/sequence
    plain_rates: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    spec_rounds: int = 0
    since: int = 0  # rounds (or steps) of the winning kind since the other was last tried
    plain_trial: int = 0  # plain steps still to run in a trial
    spec_trial: int = 0  # speculative rounds still to run in a recheck
    after_plain: bool = False  # the last round was plain: the next speculative one catches up

    @property
    def spec(self) -> float | None:
        return statistics.median(self.spec_rates) if self.spec_rates else None

    @property
    def plain(self) -> float | None:
        return statistics.median(self.plain_rates) if self.plain_rates else None

    @property
    def speculation_wins(self) -> bool:
        """Unmeasured counts as winning: where the cost model has not drafted yet, it decides."""
        spec, plain = self.spec, self.plain
        return plain is None or spec is None or spec >= plain


class ThroughputGate:
    def __init__(self):
        self.buckets: dict[int, _Bucket] = {}

    def _at(self, batch: int) -> _Bucket:
        return self.buckets.setdefault(bucket(batch), _Bucket())

    def allows(self, batch: int) -> bool:
        """Whether a round of `batch` sequences may draft (the cost model then picks the counts)."""
        b = self._at(batch)
        if b.plain_trial > 0:
            return False
        if b.spec_trial > 0:
            return True
        if not b.plain_rates:
            if b.spec_rounds >= MIN_SPEC:
                b.plain_trial = TRIAL_STEPS
                return False
            return True
        if b.speculation_wins:
            if b.since >= RECHECK:
                b.since, b.plain_trial = 0, TRIAL_STEPS
                b.plain_rates.clear()  # the trial measures plain steps afresh
                return False
            return True
        if b.since >= RECHECK:
            b.since, b.spec_trial = 0, TRIAL_ROUNDS
            b.spec_rates.clear()
            return True
        return False

    def plain_steps(self, batch: int) -> int | None:
        """Plain steps to run before the gate may open again (None: it may open next round)."""
        b = self._at(batch)
        if b.plain_trial > 0:
            return b.plain_trial
        if not b.speculation_wins and b.spec_trial == 0:
            return max(1, RECHECK - b.since)
        return None

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float, steps: int = 1) -> None:
        """A decode round (or `steps` overlapped plain steps) of `batch` sequences made `tokens`
        tokens in `seconds`."""
        if seconds <= 0 or batch <= 0:
            return
        b = self._at(batch)
        rate = tokens / seconds / batch
        winning_before = b.speculation_wins
        if drafted:
            b.spec_rounds += 1
            b.spec_trial = max(0, b.spec_trial - 1)
            if not b.after_plain or not b.spec_rates:  # (a catch-up round beats no measurement)
                b.spec_rates.append(rate)
            b.after_plain = False
            if winning_before:
                b.since += 1
        else:
            b.plain_rates.append(rate)
            b.after_plain = True
            b.plain_trial = max(0, b.plain_trial - steps)
            if not winning_before:
                b.since += steps

    def as_dict(self) -> dict:
        """/metrics and the logs: per bucket's smallest batch size, the measured rates and the choice."""
        return {1 << (k - 1): {"speculative_tok_s": b.spec, "plain_tok_s": b.plain,
                               "speculates": b.speculation_wins} for k, b in sorted(self.buckets.items())}
