"""Verification: which drafts the target accepts. Pure functions over tensors.

Greedy: accept the longest prefix where draft == the target's choice, then one bonus token.
Sampling: standard speculative (rejection) sampling — accept d with probability
min(1, p(d) / q(d)); on rejection resample from normalise(max(p - q, 0)); after k accepts draw
the bonus from p. The output distribution is exactly the target's.
Seeded sampling (coupled): the target's token at each position is its seeded sample there
(sampling/seeded.py: fixed by seed, position and distribution); a draft is accepted iff it equals
it, so the text is the one plain seeded sampling gives. For a one-hot draft d this accepts with
probability p(d), as rejection sampling does; for a drafter with a distribution q it accepts with
sum_x p(x) q(x), below rejection sampling's sum_x min(p(x), q(x)), which unseeded requests keep.

The target's choice/distribution at draft position i is passed as a function, because with
penalties it depends on the drafts accepted before i (computed on the committed sequence).
"""
from __future__ import annotations

from typing import Callable

import torch


def verify_greedy(draft_ids: list[int], target_argmax: Callable[[int], int]) -> tuple[int, int]:
    """Returns (number of drafts accepted, bonus token). target_argmax(i): choice after i drafts."""
    for i, d in enumerate(draft_ids):
        choice = target_argmax(i)
        if choice != d:
            return i, choice
    return len(draft_ids), target_argmax(len(draft_ids))


def verify_seeded(draft_ids: list[int], target_sample: Callable[[int], int]) -> tuple[int, int]:
    """Returns (number of drafts accepted, next token). target_sample(i): the request's seeded
    sample at the position after i drafts. The rule is greedy's with the sample as the choice."""
    return verify_greedy(draft_ids, target_sample)


def verify_sampling(draft_ids: list[int], draft_probs: torch.Tensor | None,
                    target_probs: Callable[[int], torch.Tensor],
                    generator: torch.Generator | None) -> tuple[int, int]:
    """Rejection sampling. draft_probs [k, V] or None (one-hot drafts); target_probs(i) -> [V]."""
    for i, d in enumerate(draft_ids):
        p = target_probs(i)
        q_d = float(draft_probs[i, d]) if draft_probs is not None else 1.0
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_d > 0 and u < min(1.0, float(p[d]) / q_d):
            continue
        if draft_probs is not None:
            residual = torch.clamp(p - draft_probs[i].to(p.dtype), min=0.0)
        else:
            residual = p.clone()
            residual[d] = 0.0
        total = residual.sum()
        # p == q exactly leaves no residual mass, but then rejection has probability 0.
        dist = residual / total if total > 0 else p
        return i, int(torch.multinomial(dist, 1, generator=generator))
    p = target_probs(len(draft_ids))
    return len(draft_ids), int(torch.multinomial(p, 1, generator=generator))
