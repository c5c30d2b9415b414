"""A running estimate of how often a sequence's drafts are accepted, position by position.

rate(i) estimates P(draft i accepted | drafts 1..i-1 accepted), exponentially weighted so a
sequence whose text changes character (a quoted passage ends, an edit begins) is followed within
a few rounds. Each position also keeps how much evidence it has: a position seen rarely leans on
the one before it (a sequence probed with one draft learns about position 1 only), and position 1
on a prior (the engine's estimate over every sequence), so a new sequence starts from what the
server has seen.
"""
from __future__ import annotations

DEFAULT_WEIGHT = 0.3  # an observation's weight: ~3 rounds to follow a change


class AcceptanceEstimate:
    def __init__(self, max_drafts: int, weight: float = DEFAULT_WEIGHT):
        self.weight = weight
        # per position: the weighted sum of outcomes and the weight of evidence behind it (both start
        # at 0; rate = sum + (1 - evidence) x the fallback, which is a bias-corrected average)
        self.sums = [0.0] * max_drafts
        self.evidence = [0.0] * max_drafts

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """A round's outcome: positions 1..accepted were accepted, accepted+1 (if drafted) rejected;
        positions past the first rejection were never tested and stay as they are."""
        w = self.weight
        for i in range(min(num_drafted, num_accepted + 1, len(self.sums))):
            self.sums[i] = (1 - w) * self.sums[i] + w * (1.0 if i < num_accepted else 0.0)
            self.evidence[i] = (1 - w) * self.evidence[i] + w

    def rates(self, prior: list[float]) -> list[float]:
        """Per-position acceptance. Where a position has no evidence of its own it falls back on
        this sequence's rate at the position before (once any position before has evidence), else
        on `prior`."""
        out, seen = [], False
        for i, (s, e) in enumerate(zip(self.sums, self.evidence)):
            fallback = out[i - 1] if seen else prior[i]
            out.append(min(1.0, max(0.0, s + (1 - e) * fallback)))
            seen = seen or e > 0
        return out

    def expected_tokens(self, prior: list[float]) -> list[float]:
        """gain[k-1]: the expected accepted tokens that a k-th draft adds (the chance drafts 1..k all
        pass), for k = 1..max_drafts."""
        gains, p = [], 1.0
        for rate in self.rates(prior):
            p *= rate
            gains.append(p)
        return gains
