"""What a drafter needs at a prefix hit's edge (verispec/cache/prefix.py explains why): the target's
outputs at a block's last position, kept when the block is registered, and the first prefill step
after a hit led by that position, so the drafter recomputes its own row there."""
from __future__ import annotations

import torch

from verispec.cache.prefix import TargetFeatures
from verispec.spec.proposer import TargetStep


def features_at(out, b: int, i: int) -> TargetFeatures:
    """The target's outputs for batch row b, pass row i of a PassOutput (copied: CUDA-graph outputs
    are reused by the next replay)."""
    return TargetFeatures(out.hidden[b, i].clone(), [a[b, i].clone() for a in out.aux],
                          out.pre_norm[b, i].clone() if out.pre_norm is not None else None)


def prepend_row(step: TargetStep, token: int, features: TargetFeatures) -> TargetStep:
    """step (a prefill chunk starting at a hit's end) led by the hit's last position: `token` there,
    with its kept features."""
    def cat(row: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # [H], [n, H] -> [n + 1, H]
        return torch.cat([row[None].to(rows.dtype), rows])

    return TargetStep([token] + step.token_ids, step.start_position - 1, cat(features.hidden, step.hidden),
                      [cat(f, a) for f, a in zip(features.aux, step.aux)], step.next_token,
                      cat(features.pre_norm, step.pre_norm) if step.pre_norm is not None else None)
