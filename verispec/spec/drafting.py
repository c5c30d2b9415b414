"""Choosing a draft token from a drafter's logits: shared by every proposer.

Greedy requests draft the argmax (verification then treats the draft as one-hot); sampling
requests draw from the drafter's own distribution after the request's temperature / top-k /
top-p / min-p, and return it as q for rejection sampling.
"""
from __future__ import annotations

import torch

from verispec.sampling.params import SamplingParams
from verispec.sampling.sampler import processed_probs


def choose_draft(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 num_real_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [V] over the target vocabulary -> (token id [1] on the device, q [V] or None when greedy).

    Rows past `num_real_tokens` (a vocabulary padded past the tokenizer's) are never drafted."""
    if num_real_tokens is not None and num_real_tokens < logits.shape[-1]:
        logits = logits.clone()
        logits[num_real_tokens:] = float("-inf")
    if params.greedy:
        return torch.argmax(logits).view(1), None
    q = processed_probs(logits, params)
    return torch.multinomial(q, 1, generator=generator), q
