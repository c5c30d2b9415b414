"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's log-probability given the
tokens before it, from the rows of the prompt's own passes.

They are the model's raw distribution (before penalties, bias, temperature and filters), as
generated tokens' logprobs are here and as OpenAI and vLLM return them: scoring a text (the
loglikelihood of evaluation harnesses) asks what the model thinks of it, not how a sampler would.
"""
from __future__ import annotations

from typing import Callable

import torch

from verispec.engine.sequence import Sequence
from verispec.sampling.sampler import rows_token_logprobs

# rows turned into logits at once: a prompt chunk of 2048 rows with a 150k vocabulary would be
# 1.2 GB of float32 logits; slices keep that to tens of MB at the same number of host syncs per row
ROWS_PER_SLICE = 128


@torch.inference_mode()
def score_chunk(seq: Sequence, start: int, hidden: torch.Tensor,
                logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """hidden [n, H]: the pass's rows at positions start..start+n-1 of `seq`; row p's logits score
    prompt token p + 1. Appends the entries not yet taken to seq.out.prompt_logprobs (a sequence
    prefilled again after a preemption keeps those it has)."""
    scores = seq.out.prompt_logprobs
    first = len(scores)  # the position whose row scores the next missing token
    end = min(start + hidden.shape[0], len(seq.prompt_ids) - 1)
    if first < start:  # cannot happen while scoring sequences skip prefix-cache hits (scheduler)
        raise RuntimeError(f"prompt logprobs from position {first} are missing (the pass starts at {start})")
    prompt_ids, top_n = seq.prompt_ids, seq.params.prompt_logprobs
    for lo in range(first, end, ROWS_PER_SLICE):
        hi = min(lo + ROWS_PER_SLICE, end)
        scores += rows_token_logprobs(logits(hidden[lo - start:hi - start]), prompt_ids[lo + 1:hi + 1], top_n)
