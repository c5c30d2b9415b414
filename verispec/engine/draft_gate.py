"""Whether speculating pays at this batch size, as measured on this server: the adaptive draft
choice's last word.

The cost model (engine/draft_costs.py) prices the passes, but not what a speculative round costs
the host: drafting, building the pass, a sync to read its tokens, per-sequence verification. A
round that drafts nothing runs overlapped instead on CUDA (engine/overlap.py: the next step queued
while the host handles the last), which hides that work; on a CPU that work is a large share of a
step of its own. Where the host's share is large (a small model, many sequences, a CPU) speculating
loses even at good acceptance. So the engine times both kinds of round (tokens
per second per sequence, per batch-size bucket) and speculates only where its
rounds are the faster ones, trying the other kind again now and then, so a change in load or text
is noticed:

- a new bucket: after MIN_SPEC speculative rounds, a trial of TRIAL_STEPS plain steps (plain rounds
  before it, not overlapped while a prompt was pending, are not plain's speed); a bucket above one
  where plain steps won starts shut instead, until its first recheck (the gain per sequence only
  shrinks as the batch grows);
- speculation measured slower: plain steps, with TRIAL_ROUNDS speculative rounds every RECHECK steps;
- plain measured slower: speculation, with a plain trial every RECHECK rounds;
- a trial that changes nothing doubles the interval to the next (up to MAX_RECHECK), one that
  changes the choice sets it back to RECHECK: the losing kind's trials cost a settled server (a
  shut gate's recheck is TRIAL_ROUNDS losing rounds plus the drafter's catch-up over every row it
  did not see) a few percent at every RECHECK steps, a fraction of that once the choice holds.

A kind's rate is its latest WINDOW measurements' tokens over their time (a ratio of sums: a
speculative round makes 1 to k+1 tokens a sequence, and the median of per-round rates, mostly
one-token rounds, read a batch of one that sped up 1.2x as 0.85x), leaving out stalls (a
measurement over STALL times the median time a step: a compile, a server's first replays). A kind
counts as measured from MIN_MEASURED measurements on (plain: after its trial); until both are, the
cost model decides, so one round never settles a bucket. A trial measures its kind afresh; a
recheck in which nothing drafted (its sequences rest their drafters) measured nothing and keeps the
old rates. Rounds are timed from the step's planning on: the scheduler and the draft choice cost
every speculative round, but an overlapped run of plain steps once. The first
speculative round after plain steps carries the drafter's catch-up over the rows it did not see, a
cost of switching that a stretch of speculation pays once: it is not counted where the kind has
other measurements.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from verispec import log

MIN_SPEC = 8  # speculative rounds in a bucket before plain steps are tried there
TRIAL_STEPS = 16  # plain steps a trial runs (overlapped: several steps make one measurement)
TRIAL_ROUNDS = 8  # speculative rounds a recheck runs
MIN_MEASURED = 4  # speculative rounds before that kind counts as measured (plain steps: one run)
RECHECK = 256  # rounds or steps of the winning kind between trials of the other (at first)
MAX_RECHECK = 4096  # ... after trials that kept finding the same winner
WINDOW = 32  # measurements a kind's rate is computed over
STALL = 4.0  # a measurement slower a step than this many times the window's median is left out


def bucket(batch: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: throughput per sequence moves little within one."""
    return max(1, batch).bit_length()


def rate(window) -> float | None:
    """Tokens per second per sequence over (tokens a sequence, seconds, steps) measurements, stalls
    left out."""
    if not window:
        return None
    typical = statistics.median(seconds / steps for _, seconds, steps in window)
    kept = [(tokens, seconds) for tokens, seconds, steps in window if seconds / steps <= STALL * typical]
    return sum(t for t, _ in kept) / sum(s for _, s in kept)


@dataclass
class _Bucket:
    spec_rates: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (tokens/seq, seconds, steps)
    plain_rates: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    stale_spec: list = field(default_factory=list)  # a recheck's predecessors, back if it measured nothing
    plain_tried: bool = False  # a plain trial ran here (plain rounds outside one may not be overlapped)
    shut_until_recheck: bool = False  # started shut after a smaller bucket where plain steps won
    spec_rounds: int = 0
    since: int = 0  # rounds (or steps) of the winning kind since the other was last tried
    plain_trial: int = 0  # plain steps still to run in a trial
    spec_trial: int = 0  # speculative rounds still to run in a recheck
    after_plain: bool = False  # the last round was plain: the next speculative one catches up
    recheck: int = RECHECK  # the current interval between trials of the losing kind
    checking: bool | None = None  # speculation_wins when the trial under way began (None: none is)

    @property
    def spec(self) -> float | None:
        return rate(self.spec_rates)

    @property
    def plain(self) -> float | None:
        return rate(self.plain_rates)

    @property
    def speculation_wins(self) -> bool:
        """Unmeasured counts as winning: where the cost model has not drafted enough yet, it decides."""
        if self.shut_until_recheck:
            return False
        if len(self.spec_rates) < MIN_MEASURED or not self.plain_tried or not self.plain_rates:
            return True
        return self.spec >= self.plain


class ThroughputGate:
    def __init__(self):
        self.buckets: dict[int, _Bucket] = {}
        self.epoch = 0  # counts forget()s: a round timed across one is not recorded

    def forget(self) -> None:
        """Drop every measurement: the prewarm's rounds ran cold (first replays, compiles) and are
        not this server's speed (they kept a batch of one from speculating where it won 1.2x).
        A round in flight on the engine's thread (its tokens already out) is dropped too."""
        self.epoch += 1
        self.buckets.clear()

    def measuring(self, batch: int) -> bool:
        """Whether speculative rounds at this batch size are being measured for a decision now."""
        b = self._at(batch)
        return b.spec_trial > 0 or (not b.plain_tried and b.spec_rounds < MIN_SPEC)

    def _at(self, batch: int) -> _Bucket:
        key = bucket(batch)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = self._first_at(key)
        return b

    def _first_at(self, key: int) -> _Bucket:
        """A bucket's start: shut until its first recheck where the nearest smaller measured bucket
        found plain steps faster (speculation's gain per sequence only shrinks as the batch grows:
        the same acceptance, more rows to verify), so a growing batch does not pay MIN_SPEC losing
        rounds in each bucket it passes. Its rates stay its own (another batch size's are not
        comparable with them)."""
        smaller = [k for k, b in self.buckets.items()
                   if k < key and b.plain_tried and len(b.spec_rates) >= MIN_MEASURED]
        if smaller and not self.buckets[max(smaller)].speculation_wins:
            return _Bucket(plain_tried=True, shut_until_recheck=True)
        return _Bucket()

    def allows(self, batch: int) -> bool:
        """Whether a round of `batch` sequences may draft (the cost model then picks the counts)."""
        b = self._at(batch)
        if b.plain_trial > 0:
            return False
        if b.spec_trial > 0:
            return True
        if not b.plain_tried:
            if b.spec_rounds >= MIN_SPEC:
                b.plain_trial, b.plain_tried = TRIAL_STEPS, True
                b.plain_rates.clear()  # rounds outside a trial (not overlapped: a prompt was pending) are not its speed
                return False
            return True
        if b.speculation_wins:
            if b.since >= b.recheck:
                log.debug("draft gate, batch %d: plain trial (speculative %.0f vs plain %.0f tok/s a sequence)",
                          batch, b.spec or 0.0, b.plain or 0.0)
                b.since, b.plain_trial, b.checking = 0, TRIAL_STEPS, True
                b.plain_rates.clear()  # the trial measures plain steps afresh
                return False
            return True
        if b.since >= b.recheck:
            log.debug("draft gate, batch %d: speculative recheck (speculative %.0f vs plain %.0f tok/s a sequence)",
                      batch, b.spec or 0.0, b.plain or 0.0)
            b.since, b.spec_trial, b.shut_until_recheck, b.checking = 0, TRIAL_ROUNDS, False, False
            b.stale_spec = list(b.spec_rates)
            b.spec_rates.clear()
            return True
        return False

    def shut(self, batch: int) -> bool:
        """Whether rounds of `batch` sequences are settled on plain steps (measured, or started shut
        after a smaller batch size where plain won; no trial of speculation under way): a sequence
        joining them starts without its drafter, whose pass over its prompt every client would wait
        for, for drafts the gate would not let it make. (Asking creates no bucket.)"""
        key = bucket(batch)
        b = self.buckets.get(key) or self._first_at(key)
        return not b.speculation_wins and b.spec_trial == 0  # (an untried bucket counts as winning)

    def plain_steps(self, batch: int) -> int | None:
        """Plain steps to run before the gate may open again (None: it may open next round)."""
        b = self._at(batch)
        if b.plain_trial > 0:
            return b.plain_trial
        if not b.speculation_wins and b.spec_trial == 0:
            return max(1, b.recheck - b.since)
        return None

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float, steps: int = 1,
               epoch: int | None = None) -> None:
        """A decode round (or `steps` overlapped plain steps) of `batch` sequences made `tokens`
        tokens in `seconds`; `epoch`: the gate's when the round began (a forget() since drops it)."""
        if seconds <= 0 or batch <= 0 or (epoch is not None and epoch != self.epoch):
            return
        b = self._at(batch)
        measurement = (tokens / batch, seconds, steps)
        winning_before = b.speculation_wins
        if drafted:
            b.spec_rounds += 1
            b.spec_trial = max(0, b.spec_trial - 1)
            if not b.after_plain or not b.spec_rates:  # (a catch-up round beats no measurement)
                b.spec_rates.append(measurement)
            b.after_plain = False
            if winning_before:
                b.since += 1
        else:
            if b.spec_trial > 0 and not b.spec_rates:  # a recheck where nothing drafted: it measured nothing
                b.spec_trial = 0
                b.spec_rates.extend(b.stale_spec)
                b.shut_until_recheck = not b.spec_rates  # (a bucket that started shut stays so)
            b.plain_rates.append(measurement)
            b.after_plain = True
            b.plain_trial = max(0, b.plain_trial - steps)
            if not winning_before:
                b.since += steps
        if b.checking is not None and b.plain_trial == 0 and b.spec_trial == 0:  # a trial ended
            b.recheck = min(2 * b.recheck, MAX_RECHECK) if b.speculation_wins == b.checking else RECHECK
            b.checking = None
        if b.speculation_wins != winning_before:
            log.debug("draft gate, batch %d: %s (speculative %.0f vs plain %.0f tok/s a sequence)", batch,
                      "speculates" if b.speculation_wins else "plain steps", b.spec or 0.0, b.plain or 0.0)

    def as_dict(self) -> dict:
        """/metrics and the logs: per bucket's smallest batch size, the measured rates and the choice."""
        return {1 << (k - 1): {"speculative_tok_s": b.spec, "plain_tok_s": b.plain,
                               "speculates": b.speculation_wins} for k, b in sorted(self.buckets.items())}
