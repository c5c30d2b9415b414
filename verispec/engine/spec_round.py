"""A speculative round over every decoding sequence: each one's drafts, one target pass over
[last token] + drafts, then per sequence verification, commit of the accepted rows and output.

Greedy rounds of a proposer that drafts on the device wait for it once: the drafts become the verify
pass's inputs where they are, and the host reads drafts and the target's choices together after
it. Sampled drafts, logit processing and grammars read the drafts back first (engine/update.py
does the verification either way). Plain decode steps that draft nothing for a while run
overlapped instead (engine/overlap.py).
"""
from __future__ import annotations

import collections
import time

import torch

from verispec import log
from verispec.engine import constrained
from verispec.engine.draft_policy import DraftPolicy
from verispec.engine.runner import ModelRunner
from verispec.engine.sequence import Sequence
from verispec.engine.update import RoundInputs, StepUpdate
from verispec.grammar.constraint import GrammarCompiler
from verispec.spec.proposer import Draft


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeRounds:
    """Runs the engine's rounds; `timings` gets (sequences, tokens per sequence, draft+inputs ms,
    launch ms, device wait ms, host after ms) per round. profile: VERISPEC_EAGLE3_PROFILE's synced,
    logged rounds."""

    def __init__(self, runner: ModelRunner, update: StepUpdate, grammars: GrammarCompiler,
                 draft_policy: DraftPolicy, timings: collections.deque, profile: bool = False):
        self.runner, self.update, self.grammars = runner, update, grammars
        self.draft_policy, self.timings, self.profile = draft_policy, timings, profile

    def run(self, seqs: list[Sequence], num_drafts: list[int]) -> None:
        """One speculative round over every decoding sequence (num_drafts[b] drafts for seqs[b]):
        drafts, one target pass, then per sequence verification, commit of the accepted rows, and
        output."""
        profile = any(num_drafts) and self.profile
        t0 = time.perf_counter()
        counts = [min(k, s.remaining_tokens - 1) if s.drafting else 0 for s, k in zip(seqs, num_drafts)]
        grammar = constrained.RoundGrammar.of(self.grammars, seqs)  # None: no sequence is constrained
        if grammar is None and not profile and self._drafts_stay_on_device(seqs):
            pending = self.runner.propose_on_device(seqs, counts)
            if pending is not None:
                self._round_on_device(seqs, counts, pending, t0)
                return
        drafts = self.runner.propose(seqs, counts)
        if grammar is not None:
            drafts = grammar.cut_drafts(drafts)
        inputs = RoundInputs.of(seqs, drafts)
        if profile:
            _sync(self.runner.device)
            t_drafted = time.perf_counter()
        t_launch = time.perf_counter()
        out = self.runner.verify(seqs, inputs.rows, self.runner.capture_layers)
        t_launched = time.perf_counter()
        accepted, t_synced = self.update.verified(seqs, inputs, out, grammar)
        self.draft_policy.observe(seqs, [len(d.token_ids) for d in inputs.drafts], accepted)
        if profile:
            _sync(self.runner.device)
            log.info("[round] %d sequences: draft %.2f ms (k=%s), verify and update %.2f ms, accepted %s",
                     len(seqs), (t_drafted - t0) * 1000, counts, (time.perf_counter() - t_drafted) * 1000,
                     accepted)
        self._time_round(seqs, inputs, t0, t_launch, t_launched, t_synced)

    def _time_round(self, seqs: list[Sequence], inputs: RoundInputs, t0: float, t_launch: float,
                    t_launched: float, t_synced: float) -> None:
        """Where a round's time went (bench --concurrency reports medians): drafting and building the
        inputs, launching the target pass, waiting for the device, and the per-sequence host work after."""
        now = time.perf_counter()
        self.timings.append((len(seqs), len(inputs.rows[0]), (t_launch - t0) * 1000,
                             (t_launched - t_launch) * 1000, (t_synced - t_launched) * 1000,
                             (now - t_synced) * 1000))

    def _drafts_stay_on_device(self, seqs: list[Sequence]) -> bool:
        """Whether this round's drafts can go to the verify pass without reading them back: a
        proposer that drafts on the device, and every sequence choosing its tokens by plain greedy
        (no sampled draft's distribution, no logits processing before the argmax)."""
        proposer = self.runner.proposer
        return (proposer is not None and proposer.drafts_on_device
                and all(s.params.greedy and not s.params.adjusts_logits for s in seqs))

    def _round_on_device(self, seqs: list[Sequence], counts: list[int], pending: torch.Tensor, t0: float) -> None:
        """`run` whose drafts (pending [B, max(counts)] on the device) become the verify pass's
        inputs where they are: the drafter's passes, the target's pass and its argmax queue back to
        back, and the host waits for the device once, reading drafts and target tokens together
        (a round that read its drafts first left the device idle while the host built the pass)."""
        width = 1 + max(counts)
        last = torch.tensor([s.last_token for s in seqs], dtype=torch.long).to(self.runner.device, non_blocking=True)
        rows = torch.cat([last[:, None], pending[:, :width - 1]], dim=1)  # a row past its count: padding
        t_launch = time.perf_counter()
        out = self.runner.verify(seqs, rows, self.runner.capture_layers)
        t_launched = time.perf_counter()
        table = torch.cat([pending[:, :width - 1], out.logits.argmax(-1)], dim=1).tolist()  # the one wait
        t_synced = time.perf_counter()
        inputs = RoundInputs.of(seqs, [Draft(row[:k]) for row, k in zip(table, counts)])
        accepted, _ = self.update.verified(seqs, inputs, out, None, greedy_choices=[row[width - 1:] for row in table],
                                           synced_at=t_synced)
        self.draft_policy.observe(seqs, counts, accepted)
        self._time_round(seqs, inputs, t0, t_launch, t_launched, t_synced)
