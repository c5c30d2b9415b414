"""What a speculative round costs: the target's verify pass by batch size and width, and the
drafter's work by the sequences it drafts for and the drafts each.

The adaptive draft choice (engine/draft_policy.py) weighs these against expected accepted tokens.
Units are free (a table's milliseconds, or multiples of one decode step); only ratios matter.
Three sources:
- `AnalyticCosts`: the default. A pass over `rows` = batch x width rows costs one step while
  reading the weights dominates, then grows linearly once the products turn compute-bound
  (CUDA: flat to 64 rows; a CPU's products are compute-bound from the first rows, so it is linear
  in rows over a fixed per-step overhead).
- `TableCosts`: measured points, from a JSON file `verispec bench --write-draft-costs` writes
  (format in docs/speculative-decoding.md), interpolated between them.
- `measure_costs(engine)` (engine/cost_measure.py) times the engine's own passes into a table.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from verispec.errors import VerispecError

TABLE_FORMAT = "verispec-draft-costs"
TABLE_VERSION = 1


class CostModel(Protocol):
    def verify(self, batch: int, width: int) -> float:
        """One target pass over `batch` sequences of `width` tokens each (1 + drafts, padded)."""

    def draft(self, batch: int, drafts: int) -> float:
        """The drafter's work in one round for `batch` sequences of up to `drafts` drafts each."""

    def describe(self) -> str:
        ...


@dataclass(frozen=True)
class AnalyticCosts:
    flat_rows: float  # rows a pass costs the same as one row (weight reads dominate)
    row_cost: float  # each row past flat_rows, in steps
    draft_fraction: float  # a chained drafter step over some rows, as a fraction of a target pass over them
    # a drafting sequence's share of a round's work outside the passes' arithmetic (the drafter
    # observing its rows, its verification and bookkeeping), in steps
    round_cost: float = 0.0

    @classmethod
    def default(cls, device_type: str, draft_fraction: float) -> "AnalyticCosts":
        if device_type == "cuda":
            # the Qwen3-8B shape on the H200: a 4-token verify pass costs 1.04-1.05 decode steps up
            # to 8 sequences (32 rows), 1.55 at 64 sequences (256 rows vs 64): ~1/384 step a row past 64
            # (a round's host work is the draft gate's to weigh there: engine/draft_gate.py)
            return cls(flat_rows=64, row_cost=1 / 384, draft_fraction=draft_fraction)
        # a CPU: one step's fixed overhead (Python, per-layer dispatch) about that of 4 rows of compute,
        # and ~0.2 step of other work per drafting sequence: the default model's passes timed on the
        # 2-core machine fit the rows' prices, yet its rounds ran ~8 ms a sequence longer (docs/benchmarks.md)
        return cls(flat_rows=0, row_cost=1 / 4, draft_fraction=draft_fraction, round_cost=0.2)

    def _pass(self, rows: int) -> float:
        return 1.0 + self.row_cost * max(0.0, rows - self.flat_rows)

    def verify(self, batch: int, width: int) -> float:
        return self._pass(batch * width)

    def draft(self, batch: int, drafts: int) -> float:
        if not batch or not drafts:
            return 0.0
        return self.draft_fraction * drafts * self._pass(batch) + self.round_cost * batch

    def describe(self) -> str:
        rounds = f"; +{self.round_cost:g} a drafting sequence" if self.round_cost else ""
        return (f"analytic: a pass costs one step to {self.flat_rows:g} rows, +{self.row_cost:.4g} a row past; "
                f"a drafter step {self.draft_fraction:g} of a pass{rounds}")


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys), xs ascending; extended past the ends along the end
    segments (never below zero); one point: constant."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class _Grid:
    """Values at (batch, n) points, interpolated over batch for each n, then over n."""

    def __init__(self, points: dict[tuple[int, int], float]):
        self.by_n: dict[int, tuple[list[float], list[float]]] = {}
        for n in sorted({n for _, n in points}):
            batches = sorted(b for b, m in points if m == n)
            self.by_n[n] = ([float(b) for b in batches], [points[(b, n)] for b in batches])

    def __call__(self, batch: int, n: int) -> float:
        ns = sorted(self.by_n)
        values = [_interp(*self.by_n[m], batch) for m in ns]
        return _interp([float(m) for m in ns], values, n)


class TableCosts:
    """Measured costs: verify passes at (batch, width) points, drafter rounds at (batch, drafts)
    points (none: the drafter costs nothing, as a model-free one nearly does)."""

    def __init__(self, verify: dict[tuple[int, int], float], draft: dict[tuple[int, int], float],
                 source: str = "measured"):
        if not verify:
            raise VerispecError(f"draft costs {source}: no verify points")
        self.verify_points, self.draft_points, self.source = verify, draft, source
        self._verify = _Grid(verify)
        self._draft = _Grid(draft) if draft else None

    def verify(self, batch: int, width: int) -> float:
        return self._verify(batch, width)

    def draft(self, batch: int, drafts: int) -> float:
        if self._draft is None or not batch or not drafts:
            return 0.0
        return self._draft(batch, drafts)

    def describe(self) -> str:
        return f"table ({self.source}): {len(self.verify_points)} verify and {len(self.draft_points)} draft points"

    def to_json(self, **meta) -> dict:
        return {"format": TABLE_FORMAT, "version": TABLE_VERSION, "unit": "ms", **meta,
                "verify": [{"batch": b, "width": w, "ms": ms} for (b, w), ms in sorted(self.verify_points.items())],
                "draft": [{"batch": b, "drafts": k, "ms": ms} for (b, k), ms in sorted(self.draft_points.items())]}

    def save(self, path: Path, **meta) -> None:
        Path(path).write_text(json.dumps(self.to_json(**meta), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "TableCosts":
        """A table file; any problem is one VerispecError naming the file and what is wrong."""
        where = f"--draft-costs {path}"
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise VerispecError(f"{where}: cannot read it ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise VerispecError(f"{where}: not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
            raise VerispecError(f"{where}: not a draft-cost table (expected \"format\": \"{TABLE_FORMAT}\", "
                                "as `verispec bench --write-draft-costs` writes)")
        if data.get("version") != TABLE_VERSION:
            raise VerispecError(f"{where}: version {data.get('version')!r}, this verispec reads {TABLE_VERSION}")
        verify = _points(data.get("verify"), "width", where, "verify")
        draft = _points(data.get("draft", []), "drafts", where, "draft")
        return cls(verify, draft, source=str(path))


def _points(items, key: str, where: str, name: str) -> dict[tuple[int, int], float]:
    if not isinstance(items, list) or (name == "verify" and not items):
        raise VerispecError(f"{where}: \"{name}\" must be a list of {{\"batch\", \"{key}\", \"ms\"}} points")
    out = {}
    for item in items:
        try:
            b, n, ms = int(item["batch"]), int(item[key]), float(item["ms"])
        except (TypeError, KeyError, ValueError):
            raise VerispecError(f"{where}: a \"{name}\" point needs integer \"batch\" and \"{key}\" and a number "
                                f"\"ms\" (got {item!r})") from None
        if b < 1 or n < 1 or ms < 0:
            raise VerispecError(f"{where}: \"{name}\" point {item!r} out of range (batch, {key} >= 1, ms >= 0)")
        out[(b, n)] = ms
    return out
