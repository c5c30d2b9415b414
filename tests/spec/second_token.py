"""What the engine-level speculative sampling tests share: the target's distribution of the second
generated token (the first one a draft is verified for), given the greedy first token, and seeded
samples that start with that token. Drafting must leave that distribution as it is (chi-square)."""
from __future__ import annotations

from collections import Counter

import torch

from verispec.sampling.params import SamplingParams

# top_k 4 keeps the chi-square's cells few; the third token makes the second one a verified draft's
PARAMS = dict(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
CHI2_CRIT_3DF_P001 = 16.27


def second_token_target(engine, ids: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(the greedy first token, the 4 most likely second tokens, their probabilities under PARAMS),
    from the target model itself (float64 logits)."""
    first = engine.generate_all(ids, SamplingParams(temperature=0.0, max_tokens=1)).token_ids[0]
    with torch.no_grad():
        seq = torch.tensor([ids + [first]])
        hidden = engine.model(seq, torch.arange(seq.shape[1])[None], engine.model.make_cache(seq.shape[1])).hidden
        logits = engine.model.logits(hidden[0, -1]).double()
    top = torch.topk(logits, 4)
    return first, top.indices, torch.softmax(top.values, -1)


def samples_after(spec, ids: list[int], first: int, tries: int = 2500, wanted: int = 600) -> list:
    """The results of seeded PARAMS samples whose first token is `first`: up to `wanted` of them
    from seeds 0..tries-1. Enough of them (300) for the chi-square is asserted here."""
    results = []
    for seed in range(tries):
        result = spec.generate_all(ids, SamplingParams(seed=seed, **PARAMS))
        if result.token_ids[0] == first:
            results.append(result)
            if len(results) >= wanted:
                break
    assert len(results) >= 300, len(results)
    return results


def second_token_counts(results: list, top: torch.Tensor) -> Counter:
    """How often each of the top tokens came second (index into `top`)."""
    ranks = top.tolist()
    return Counter(ranks.index(r.token_ids[1]) for r in results)
