"""Seeded sampling as a function of (seed, position, distribution) only.

A seeded request's token at absolute position t is the inverse-CDF sample of its processed
distribution at t, with one uniform number that depends on (seed, t) alone (a counter-based
draw: a hash, no generator state). So its text cannot depend on how many random numbers other
steps consumed: not on speculation (drafts drawn or rejected), the batch or the chunking.
Speculative verification of a seeded request accepts a draft iff it equals this sample
(spec/verify.py), which keeps the text identical to plain seeded sampling.
"""
from __future__ import annotations

import hashlib

import torch

# distinguishes these draws from any other use of blake2b on the same (seed, position) bytes
_DOMAIN = b"verispec-seeded-sample-v1"


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, position): 53 bits of blake2b over both."""
    digest = hashlib.blake2b(_DOMAIN + f":{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def inverse_cdf_sample(probs: torch.Tensor, u: float) -> int:
    """probs [V] (need not sum to 1 exactly) -> the token whose CDF interval holds u * total.

    The CDF is summed in float64 (float32 on MPS, which has no float64) on the probabilities'
    device; a zero-probability token is never chosen."""
    dtype = torch.float32 if probs.device.type == "mps" else torch.float64
    cdf = probs.to(dtype).cumsum(-1)
    target = (cdf[-1:] * u).contiguous()
    index = int(torch.searchsorted(cdf, target, right=True))
    if index >= probs.shape[-1]:  # u * total rounded up to the total: the last token with mass
        index = int(torch.nonzero(probs > 0)[-1])
    return index


def seeded_sample(probs: torch.Tensor, seed: int, position: int) -> int:
    """probs [V] at absolute position `position` of a request seeded with `seed` -> a token id."""
    return inverse_cdf_sample(probs, position_uniform(seed, position))
