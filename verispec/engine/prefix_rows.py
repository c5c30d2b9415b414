"""What a drafter needs at a prefix hit's edge (verispec/cache/prefix.py explains why): the target's
outputs at a block's last position, kept when the block is registered, and the first prefill step
after a hit led by that position, so the drafter recomputes its own row there."""
from __future__ import annotations

import torch

from verispec.cache.prefix import TargetFeatures
from verispec.engine.deferred_rows import device_index
from verispec.spec.proposer import TargetStep


def features_at(out, b: int, i: int) -> TargetFeatures:
    """The target's outputs for batch row b, pass row i of a PassOutput (copied: CUDA-graph outputs
    are reused by the next replay)."""
    return TargetFeatures(out.hidden[b, i].clone(), [a[b, i].clone() for a in out.aux],
                          out.pre_norm[b, i].clone() if out.pre_norm is not None else None)


class KeptRows:
    """The target's outputs at the rows of one pass the prefix cache keeps (each block's last
    position among row b's `counts[b]` rows from position `starts[b]`), copied together when one is
    first asked for: one gather per tensor, the parts packed side by side, then one copy per row that
    owns its memory (a view would keep the pass's whole copy alive while any of its blocks stays
    cached). Copying each part of each row alone cost a block end at 64 sequences ~5 ms of host
    time, which the overlapped loop's steps then waited for."""

    def __init__(self, out, starts: list[int], counts: list[int], block_size: int):
        self.out, self.starts, self.counts, self.block_size = out, starts, counts, block_size
        self._kept: dict[tuple[int, int], TargetFeatures] | None = None

    def at(self, b: int, i: int) -> TargetFeatures:
        if self._kept is None:  # (most passes end no block: nothing is asked for, nothing computed)
            size = self.block_size
            rows = [(b, i) for b, (start, n) in enumerate(zip(self.starts, self.counts))
                    for i in range((size - 1 - start) % size, n, size)]
            self._kept = _copy_rows(self.out, rows)
        kept = self._kept.get((b, i))
        return kept if kept is not None else features_at(self.out, b, i)


def _copy_rows(out, rows: list[tuple[int, int]]) -> dict[tuple[int, int], TargetFeatures]:
    parts = [out.hidden, *out.aux] + ([out.pre_norm] if out.pre_norm is not None else [])
    if not rows or len({p.dtype for p in parts}) > 1:  # (packing needs one dtype)
        return {r: features_at(out, *r) for r in rows}
    device = out.hidden.device
    bs, ts = device_index([b for b, _ in rows], device), device_index([i for _, i in rows], device)
    packed = torch.cat([p[bs, ts] for p in parts], dim=-1)  # [R, H + sum of aux widths (+ H)]
    widths, n_aux = [p.shape[-1] for p in parts], len(out.aux)
    kept = {}
    for row, values in zip(rows, packed.unbind(0)):
        pieces = values.clone().split(widths)
        kept[row] = TargetFeatures(pieces[0], list(pieces[1:1 + n_aux]),
                                   pieces[1 + n_aux] if out.pre_norm is not None else None)
    return kept


def prepend_row(step: TargetStep, token: int, features: TargetFeatures) -> TargetStep:
    """step (a prefill chunk starting at a hit's end) led by the hit's last position: `token` there,
    with its kept features."""
    def cat(row: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # [H], [n, H] -> [n + 1, H]
        return torch.cat([row[None].to(rows.dtype), rows])

    return TargetStep([token] + step.token_ids, step.start_position - 1, cat(features.hidden, step.hidden),
                      [cat(f, a) for f, a in zip(features.aux, step.aux)], step.next_token,
                      cat(features.pre_norm, step.pre_norm) if step.pre_norm is not None else None)
