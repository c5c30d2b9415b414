"""Rows a drafter has not observed (engine/deferred_rows.py): kept in order per sequence and handed
over as one step over the contiguous positions, with the target's features of each row."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from verispec.engine.deferred_rows import DeferredRows


def seq(sid: int, tokens: list[int]):
    return SimpleNamespace(id=sid, token_ids=tokens)


def pass_out(batch: int, width: int, base: float):
    """hidden [B, W, 2] whose values name (row b, position j); aux and pre_norm follow it."""
    hidden = torch.tensor([[[base + 10 * b + j, -(base + 10 * b + j)] for j in range(width)] for b in range(batch)],
                          dtype=torch.float64)
    return SimpleNamespace(hidden=hidden, aux=[hidden * 2], pre_norm=hidden * 3)


def test_deferred_rows_come_back_as_one_step_in_order():
    rows = DeferredRows(keep_features=True)
    a, b = seq(1, list(range(100, 120))), seq(2, list(range(200, 220)))
    assert rows.add([(a, 0, 5, 1), (b, 1, 7, 2)], pass_out(2, 3, 0.0)) == []
    assert rows.add([(a, 1, 6, 2)], pass_out(2, 3, 1000.0)) == []
    assert a in rows and b in rows and len(rows) == 2
    [(got_a, step)] = rows.take([a])
    assert got_a is a and a not in rows
    assert step.token_ids == [105, 106, 107] and step.start_position == 5 and step.next_token == 108
    # row 0 of the first pass, then rows 0-1 of the second pass's batch row 1
    assert step.hidden[:, 0].tolist() == [0.0, 1010.0, 1011.0]
    assert torch.equal(step.aux[0], step.hidden * 2) and torch.equal(step.pre_norm, step.hidden * 3)
    assert [s for s, _ in rows.take([a, b])] == [b]


def test_rows_past_the_limit_are_handed_over_at_once_and_dropped_with_the_sequence():
    rows = DeferredRows(keep_features=False, max_rows=3)
    a, b = seq(1, list(range(50))), seq(2, list(range(50)))
    assert rows.add([(a, 0, 10, 1), (b, 1, 20, 1)], None) == []
    assert rows.add([(a, 0, 11, 1), (b, 1, 21, 1)], None) == []
    [(full, step)] = rows.add([(a, 0, 12, 1)], None)
    assert full is a and step.token_ids == [10, 11, 12] and step.next_token == 13 and step.hidden is None
    rows.drop(b)
    assert len(rows) == 0


def test_sequences_taken_together_read_one_padded_batch():
    """A drafter observes them in one pass: every step is a row of the same [Z, n_max, H] tensors,
    a shorter sequence's rows padded with its last row (finite, never attended to)."""
    rows = DeferredRows(keep_features=True)
    a, b = seq(1, list(range(100, 120))), seq(2, list(range(200, 220)))
    rows.add([(a, 0, 5, 1), (b, 1, 7, 1)], pass_out(2, 1, 0.0))
    rows.add([(b, 1, 8, 1)], pass_out(2, 1, 1000.0))
    (_, step_a), (_, step_b) = rows.take([a, b])
    (batch, row_a), (same, row_b) = step_a.source, step_b.source
    assert batch is same and (row_a, row_b) == (0, 1) and batch.hidden.shape == (2, 2, 2)
    assert batch.hidden[:, :, 0].tolist() == [[0.0, 0.0], [10.0, 1010.0]]
    assert step_a.hidden[:, 0].tolist() == [0.0] and step_b.hidden[:, 0].tolist() == [10.0, 1010.0]
    assert torch.equal(batch.aux[0], batch.hidden * 2) and torch.equal(batch.pre_norm, batch.hidden * 3)
