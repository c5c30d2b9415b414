"""The cost of speculation's parts, timed one step at a time at a given context.

A random drafter is never accepted, so its end-to-end speed says little; what does transfer to a
trained drafter of the same shape is the cost of each part, in units of one decode step:
- verify/decode: the target's pass over T = k+1 tokens vs over T = 1 (both with logits and the
  argmax the engine syncs on), at the same context, nothing committed;
- draft cost per token: the drafter's work in one round (observe one verified token, then
  propose k drafts) divided by k.
With those, a round of k drafts of which a are accepted yields a+1 tokens for
(verify/decode + k * draft) decode steps; the ceiling is every draft accepted.
These use the engine's own step functions (Engine._prefill, Engine._verify_pass), so they time
exactly what the engine runs.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from verispec.engine.engine import Engine
from verispec.engine.params import SamplingParams
from verispec.spec.proposer import TargetStep

WARMUP_STEPS = 3


@dataclass
class StepCosts:
    decode_step_ms: float
    verify_step_ms: float
    draft_round_ms: float
    num_drafts: int

    @property
    def verify_decode_ratio(self) -> float:
        return self.verify_step_ms / self.decode_step_ms

    @property
    def draft_ms_per_token(self) -> float:
        return self.draft_round_ms / self.num_drafts

    @property
    def draft_cost_fraction(self) -> float:
        return self.draft_ms_per_token / self.decode_step_ms

    @property
    def speedup_ceiling(self) -> float:
        """Tokens per decode-step-equivalent when all k drafts are accepted every round."""
        return (self.num_drafts + 1) / (self.verify_decode_ratio + self.num_drafts * self.draft_cost_fraction)

    def as_dict(self) -> dict:
        return {
            "decode_step_ms": self.decode_step_ms,
            "verify_step_ms": self.verify_step_ms,
            "draft_round_ms": self.draft_round_ms,
            "draft_ms_per_token": self.draft_ms_per_token,
            "verify_decode_ratio": self.verify_decode_ratio,
            "draft_cost_fraction": self.draft_cost_fraction,
            "speedup_ceiling": self.speedup_ceiling,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, iters: int, device: torch.device) -> float:
    for _ in range(WARMUP_STEPS):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def measure_step_costs(engine: Engine, prompt_ids: list[int], iters: int) -> StepCosts:
    """Prefill `prompt_ids` through the engine (the proposer observing, as in generation), then
    time decode, verify and draft steps at that context. Needs a speculative engine."""
    proposer = engine.proposer
    if proposer is None or engine.num_drafts < 1:
        raise ValueError("step costs need an engine with a proposer")
    k = engine.num_drafts
    context = len(prompt_ids)
    device = engine.device
    greedy = SamplingParams(temperature=0.0)
    capture = proposer.capture_layers
    cache = engine._cache_for(context + k + 1)
    proposer.reset(prompt_ids)
    hidden, aux, last_start, pre_norm = engine._prefill(prompt_ids, cache, capture)
    token = int(torch.argmax(engine._logits(hidden[-1:])[0]))
    proposer.observe(TargetStep(prompt_ids[last_start:], last_start, hidden, aux, token, pre_norm))
    drafts = proposer.propose(k, greedy, None).token_ids

    def decode_step():
        _, _, logits, _ = engine._verify_pass([token], context, cache, ())
        int(torch.argmax(logits[-1]))

    verified = {}

    def verify_step():
        hid, aux_rows, logits, _ = engine._verify_pass([token] + drafts, context, cache, capture)
        logits.argmax(dim=-1).tolist()
        verified["step"] = TargetStep([token], context, hid[:1], [a[:1] for a in aux_rows], drafts[0])

    def draft_round():
        # the drafter re-reads the verified row (its rows past the committed prefix are dropped), then drafts k
        proposer.observe(verified["step"])
        proposer.propose(k, greedy, None)

    decode_ms = _median_ms(decode_step, iters, device)
    verify_ms = _median_ms(verify_step, iters, device)
    draft_ms = _median_ms(draft_round, iters, device)
    return StepCosts(decode_ms, verify_ms, draft_ms, k)
