"""The cost of speculation's parts, timed one step at a time at a given context.

A random drafter is never accepted, so its end-to-end speed says little; what does transfer to a
trained drafter of the same shape is the cost of each part, in units of one decode step:
- verify/decode: the target's pass over T = k+1 tokens vs over T = 1 (both with logits and the
  argmax the engine syncs on), at the same context, nothing committed;
- draft cost per token: the drafter's work in one round (observe one verified token, then
  propose k drafts) divided by k.
With those, a round of k drafts of which a are accepted yields a+1 tokens for
(verify/decode + k * draft) decode steps; the ceiling is every draft accepted.
These use the engine's own runner (ModelRunner.prefill / verify, graphs included), so they time
exactly what the engine runs; with batch=B, every step covers B sequences (the cost of a round
inside a batch of B).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from verispec.engine.cost_measure import prefilled_sequence
from verispec.engine.engine import Engine
from verispec.sampling.params import SamplingParams
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


def _interleaved_median_ms(fns, iters: int, device: torch.device) -> list[float]:
    """Each function's median time in ms over `iters` rounds that run them once each, in turn: a
    drift of the GPU's clocks (or of anything else) during the measurement reaches every function
    alike, so their ratios hold (timed one after another, 20 times each, a 4-bit verify / decode
    ratio moved between 1.06 and 1.13 across runs of one build)."""
    for _ in range(WARMUP_STEPS):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, taken in zip(fns, times):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            taken.append((time.perf_counter() - t0) * 1000)
    return [statistics.median(taken) for taken in times]


def measure_step_costs(engine: Engine, prompt_ids: list[int], iters: int, batch: int = 1) -> StepCosts:
    """Prefill `batch` copies of `prompt_ids` through the engine (the proposer observing, as in
    generation), then time decode, verify and draft steps over all of them at that context.
    Needs a speculative engine."""
    proposer = engine.proposer
    if proposer is None or engine.num_drafts < 1:
        raise ValueError("step costs need an engine with a proposer")
    k = engine.num_drafts
    device = engine.device
    greedy = SamplingParams(temperature=0.0)
    capture = proposer.capture_layers
    seqs = [prefilled_sequence(engine, prompt_ids, k) for _ in range(batch)]
    try:
        token = seqs[0].token_ids[-1]

        def propose_all():
            return [d.token_ids for d in proposer.propose(seqs, [k] * len(seqs), [greedy] * len(seqs),
                                                          [None] * len(seqs))]

        # a model-free proposer drafts only what matches (maybe nothing): padded to k, the verify pass
        # is timed at its full width
        drafts = [(d + [token] * k)[:k] for d in propose_all()]
        context = len(prompt_ids)

        def decode_step():
            out = engine.runner.verify(seqs, [[s.token_ids[-1]] for s in seqs], ())
            out.logits[:, -1].argmax(-1).tolist()

        verified = {}

        def verify_step():
            out = engine.runner.verify(seqs, [[s.token_ids[-1]] + d for s, d in zip(seqs, drafts)], capture)
            out.logits.argmax(dim=-1).tolist()
            verified["steps"] = [TargetStep([token], context, out.hidden[b, :1], [a[b, :1] for a in out.aux], d[0])
                                 for b, d in enumerate(drafts)]

        def draft_round():
            # the drafter re-reads the verified row (its rows past the committed prefix are dropped), then drafts k
            proposer.observe(list(zip(seqs, verified["steps"])))
            propose_all()

        # verify_step before draft_round in every round: the draft round observes its verified row
        decode_ms, verify_ms, draft_ms = _interleaved_median_ms((decode_step, verify_step, draft_round), iters,
                                                                device)
    finally:
        for s in seqs:
            engine.scheduler.release(s)
        engine.runner.apply(engine.scheduler.take_cache_ops())
    return StepCosts(decode_ms, verify_ms, draft_ms, k)
