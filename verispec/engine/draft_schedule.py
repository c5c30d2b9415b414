"""How many drafts each sequence makes per round, by the number of sequences decoding together.

A verify pass over k+1 tokens costs about one decode step while weights dominate; as the batch
grows the step becomes compute-bound and drafting costs more than it saves (EAGLE-3 paper:
2.36x at batch 1, 1.32x at 32). The schedule is a list of (from batch size, drafts) steps:
"1:3,8:1,32:0" drafts 3 below 8 sequences, 1 from 8, none from 32.
"""
from __future__ import annotations

from verispec.errors import VerispecError


class DraftSchedule:
    def __init__(self, steps: list[tuple[int, int]], max_drafts: int):
        self.steps = sorted(steps)
        self.max_drafts = max_drafts

    @classmethod
    def parse(cls, text: str | None, max_drafts: int, device_type: str = "cuda") -> "DraftSchedule":
        """`text` from --draft-schedule; None: the measured default for `max_drafts` drafts."""
        if not text:
            return cls.default(max_drafts, device_type) if max_drafts > 0 else cls([(1, 0)], 0)
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

    @classmethod
    def default(cls, max_drafts: int, device_type: str = "cuda") -> "DraftSchedule":
        if device_type != "cuda":
            # a CPU's matrix products are compute-bound after a few rows, so k+1 rows per sequence
            # cost ~k+1 times one: measured with the demo model over HTTP (docs/benchmarks.md), 8
            # clients got 107 tok/s plain vs 71 with 4 drafts each; one draft each pays from 2 to 16
            # clients (4: 162-168 vs 102-117 tok/s plain; 8: 178-197 vs 141-172; 16: 215-235 vs
            # 193-201). Past 16 it is not measured: none from 32, as on a GPU
            return cls([(1, max_drafts), (2, min(max_drafts, 1)), (32, 0)], max_drafts)
        # the verify pass stays near one decode step up to ~8 sequences x 4 tokens (measured on the
        # H200, docs/benchmarks.md); past that one draft, and none from 32 sequences
        return cls([(1, max_drafts), (9, min(max_drafts, 1)), (32, 0)], max_drafts)

    def drafts_for(self, batch_size: int) -> int:
        drafts = self.steps[0][1]
        for size, k in self.steps:
            if batch_size >= size:
                drafts = k
        return drafts

    def describe(self) -> str:
        return ",".join(f"{size}:{k}" for size, k in self.steps)
