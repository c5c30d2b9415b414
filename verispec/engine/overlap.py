"""Overlapped plain decoding: the next step is queued on the device before the host handles this one.

A plain greedy step's next input is this step's argmax, which the device already has. So while
every decoding sequence is greedy and plain (no drafts, penalties, grammar, logprobs or drafter
to feed: a drafter sees the rows later, engine/deferred_rows.py), the engine launches step i+1 with step i's argmax as its input (a device-to-device copy
into the captured graph's buffer) before it waits for step i, and does step i's host work
(verification, output, detokenization, stop strings, the prefix cache, the clients' chunks)
while step i+1 runs. At 64 sequences of an 8B model that host work is ~1 ms of an ~8 ms step,
during which the device used to idle.

The pipeline stops launching, and drains what is in flight, as soon as a sequence finishes (its
rows already in flight are computed and dropped, never emitted), a request arrives or is
cancelled, blocks run short, or a sequence's remaining tokens would be exceeded. Finishing is the
same check as always (output.py, after each token), so output is identical to the one-step-at-a-
time path: the same graph runs on the same inputs. Models with recurrent layers stay on that path
(the prefix cache snapshots a recurrent state at block boundaries in host order, which a queued
step would have moved past).
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable

import torch

from verispec.engine.runner import ModelRunner
from verispec.engine.scheduler import Scheduler
from verispec.engine.sequence import Sequence
from verispec.engine.update import StepUpdate, row_features


@dataclass
class _InFlight:
    tokens: torch.Tensor  # [B] the step's greedy tokens (a host copy, filled when `ready` fires)
    ready: torch.cuda.Event | None  # None on CPU, where the copy is already done
    launch_ms: float
    features: _Features | None  # the step's target rows, for a drafter and the prefix cache


@dataclass
class _Features:
    """A step's target outputs at its one row per sequence, copied before the next replay reuses
    the graph's buffers: hidden [B, 1, H], aux each [B, 1, H_t], pre_norm [B, 1, H]."""

    hidden: torch.Tensor
    aux: list[torch.Tensor]
    pre_norm: torch.Tensor | None

    @classmethod
    def of(cls, out) -> "_Features":
        return cls(out.hidden[:, :1].clone(), [a[:, :1].clone() for a in out.aux],
                   out.pre_norm[:, :1].clone() if out.pre_norm is not None else None)


class OverlappedDecode:
    """The overlapped decode loop over the engine's public pieces. `new_work()` says whether a
    request arrived (the scheduler must run again); `timings` receives each step's round timing."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, update: StepUpdate, enabled: bool,
                 new_work: Callable[[], bool], timings: collections.deque,
                 rest_drafters: Callable[[int], bool] = lambda batch: False):
        self.scheduler = scheduler
        self.runner = runner
        self.update = update
        self.enabled = enabled and not runner.pools.recurrent_layers
        self.new_work = new_work
        self.timings = timings
        # whether a batch this size will not draft for longer than a drafter's rows are kept: its
        # sequences then stop drafting (engine.py `_rest_drafters`)
        self.rest_drafters = rest_drafters

    def eligible(self, seqs: list[Sequence], num_drafts: list[int]) -> bool:
        """Whether this decode step can run overlapped (see the module docstring): nobody drafts."""
        if not self.enabled or any(num_drafts):
            return False
        scheduler = self.scheduler
        if scheduler.waiting or len(scheduler.running) != len(seqs) or self.new_work():
            return False  # a sequence waits or is mid-prompt: its prefill needs the scheduler every step
        for seq in seqs:
            p = seq.params
            if (not p.greedy or p.adjusts_logits or p.logprobs or seq.constraint is not None
                    or seq.remaining_tokens < 2):
                return False
        return True

    def run(self, seqs: list[Sequence], max_steps: int) -> int:
        """Decode `seqs` step after step, one step queued ahead of the host, until something needs
        the scheduler (a finish, a new or cancelled request, a block shortage, a remaining-token
        limit) or max_steps ran (the draft policy would draft after them). Returns the steps run:
        0, having done nothing, when not even one step could be launched."""
        runner = self.runner
        on_cuda = runner.device.type == "cuda"
        inflight: collections.deque[_InFlight] = collections.deque()
        inputs: list[list[int]] | torch.Tensor = [[s.last_token] for s in seqs]
        if runner.deferred.keep_features and self.rest_drafters(len(seqs)):
            # keeping a model drafter in step (each step's rows copied, a drafter pass over them every
            # few dozen steps) costs a host-bound step more than speculation it will not do gives back
            runner.stop_drafting(seqs)
        # the target rows a drafter reads later, or the prefix cache keeps at a drafting sequence's block ends
        prefix = self.scheduler.prefix
        drafter_rows = runner.deferred.keep_features and any(s.drafting for s in seqs)
        block_rows = [s for s in seqs if prefix is not None and prefix.keeps_features_of(s)]
        block = runner.pools.block_size
        launching = True
        launched = done = 0
        while True:
            if launching and launched < max_steps and self._can_launch(seqs, ahead=len(inflight)):
                t0 = time.perf_counter()
                out = runner.verify(seqs, inputs, runner.capture_layers, ahead=len(inflight))
                launched += 1
                tokens = out.logits[:, 0].argmax(-1)  # [B] on the device: the next step's input
                host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=on_cuda)
                host.copy_(tokens, non_blocking=on_cuda)
                ready = None
                if on_cuda:
                    ready = torch.cuda.Event()
                    ready.record()
                ends_block = any((s.num_cached + len(inflight)) % block == block - 1 for s in block_rows)
                features = _Features.of(out) if drafter_rows or ends_block else None
                inflight.append(_InFlight(host, ready, (time.perf_counter() - t0) * 1000, features))
                inputs = tokens[:, None]
                if len(inflight) < 2:
                    continue  # keep a step queued behind the one the host waits for
            else:
                launching = False
            if not inflight:
                return done
            done += 1
            step = inflight.popleft()
            t_wait = time.perf_counter()
            if step.ready is not None:
                step.ready.synchronize()
            t_synced = time.perf_counter()
            if self._commit(seqs, step.tokens.tolist(), step.features) or self._interrupted(seqs):
                launching = False
            self.timings.append((len(seqs), 1, 0.0, step.launch_ms, (t_synced - t_wait) * 1000,
                                 (time.perf_counter() - t_synced) * 1000))

    def _can_launch(self, seqs: list[Sequence], ahead: int) -> bool:
        """Room for one more step with `ahead` unhandled steps before it: every sequence has tokens
        left for it and blocks for its position (new blocks zeroed before the launch)."""
        for seq in seqs:
            if seq.remaining_tokens <= ahead or not self.scheduler.reserve(seq, seq.num_cached + ahead + 1):
                self.runner.apply(self.scheduler.take_cache_ops())
                return False
        self.runner.apply(self.scheduler.take_cache_ops())
        return True

    def _interrupted(self, seqs: list[Sequence]) -> bool:
        return self.new_work() or any(s.cancel.is_set() for s in seqs)

    def _commit(self, seqs: list[Sequence], tokens: list[int], features: _Features | None) -> bool:
        """One step's host work: each live sequence keeps its token and emits its chunk (what a
        one-token round that drafted nothing does). Returns whether a sequence finished."""
        finished = False
        deferred, chunks = [], []
        kept = self.update.kept_rows(seqs, features, [s.num_cached for s in seqs], [1] * len(seqs)) \
            if features is not None else None
        for b, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.finished:
                continue  # finished at an earlier step: this row was computed in flight, and is dropped
            position = seq.num_cached
            chunks.append((seq, self.update.commit(seq, [], 0, token, None, row_features(kept, b))))
            if seq.drafting:
                deferred.append((seq, b, position, 1))
        self.runner.defer(deferred, features, owned=True)  # _Features are copies already
        for seq, chunk in chunks:
            self.update.emit(seq, chunk)
            finished = finished or chunk.finish_reason is not None
        return finished
