"""`--draft-schedule`: the same drafts for every sequence, by the number of sequences decoding together.

A verify pass over k+1 tokens costs about one decode step while weights dominate; as the batch
grows the step becomes compute-bound and drafting costs more than it saves (EAGLE-3 paper:
2.36x at batch 1, 1.32x at 32). The schedule is a list of (from batch size, drafts) steps:
"1:3,8:1,32:0" drafts 3 below 8 sequences, 1 from 8, none from 32. It overrides the default,
drafts chosen per sequence by cost (engine/draft_policy.py).
"""
from __future__ import annotations

from verispec.errors import VerispecError


class DraftSchedule:
    def __init__(self, steps: list[tuple[int, int]], max_drafts: int):
        self.steps = sorted(steps)
        self.max_drafts = max_drafts

    @classmethod
    def parse(cls, text: str | None, max_drafts: int) -> "DraftSchedule":
        """`text` from --draft-schedule; None: no schedule, nothing drafted (without a proposer; with
        one the default is the per-sequence choice, engine/draft_policy.py)."""
        if not text:
            return cls([(1, 0)], 0)
        steps = []
        for part in text.split(","):
            try:
                size, drafts = (int(x) for x in part.split(":"))
            except ValueError:
                raise VerispecError(f"--draft-schedule {text!r}: each entry is BATCH:DRAFTS with integers, "
                                    f"e.g. '1:3,8:1,32:0' (got {part!r})") from None
            if size < 1 or drafts < 0:
                raise VerispecError(f"--draft-schedule {text!r}: batch sizes are >= 1 and drafts >= 0 (got {part!r})")
            steps.append((size, min(drafts, max_drafts)))
        if min(s for s, _ in steps) != 1:
            steps.append((1, max_drafts))
        if max_drafts <= 0:  # checked above all the same: a bad flag is an error with or without a drafter
            return cls([(1, 0)], 0)
        return cls(steps, max_drafts)

    def drafts_for(self, batch_size: int) -> int:
        drafts = self.steps[0][1]
        for size, k in self.steps:
            if batch_size >= size:
                drafts = k
        return drafts

    def describe(self) -> str:
        return ",".join(f"{size}:{k}" for size, k in self.steps)
