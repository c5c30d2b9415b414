"""Overlapped plain decoding: the next step is queued on the device before the host handles this one.

A plain greedy step's next input is this step's argmax, which the device already has. So while
every decoding sequence is greedy and plain (no drafts, penalties, grammar, logprobs or drafter
to feed), the engine launches step i+1 with step i's argmax as its input (a device-to-device copy
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

import torch

from verispec.engine.sequence import Sequence


@dataclass
class _InFlight:
    tokens: torch.Tensor  # [B] the step's greedy tokens (a host copy, filled when `ready` fires)
    ready: torch.cuda.Event | None  # None on CPU, where the copy is already done
    launch_ms: float


def eligible(engine, seqs: list[Sequence], num_drafts: int) -> bool:
    """Whether this decode step can run overlapped (see the module docstring)."""
    if not engine.overlap_decode or num_drafts or engine.runner.pools.recurrent_layers:
        return False
    if engine.prefix is not None and engine.prefix.keep_features:
        return False
    scheduler = engine.scheduler
    if scheduler.waiting or len(scheduler.running) != len(seqs) or not engine._inbox.empty():
        return False  # a sequence waits or is mid-prompt: its prefill needs the scheduler every step
    for seq in seqs:
        p = seq.params
        if (not p.greedy or p.has_penalties or p.logprobs or seq.constraint is not None
                or seq.proposer is not None or seq.remaining_tokens < 2):
            return False
    return True


def run(engine, seqs: list[Sequence]) -> bool:
    """Decode `seqs` step after step, one step queued ahead of the host, until something needs the
    scheduler (a finish, a new or cancelled request, a block shortage, a remaining-token limit).
    Returns False, having done nothing, when not even one step could be launched."""
    runner = engine.runner
    on_cuda = engine.device.type == "cuda"
    inflight: collections.deque[_InFlight] = collections.deque()
    inputs: list[list[int]] | torch.Tensor = [[s.last_token] for s in seqs]
    launching = True
    done = 0
    while True:
        if launching and _can_launch(engine, seqs, ahead=len(inflight)):
            t0 = time.perf_counter()
            out = runner.verify(seqs, inputs, (), ahead=len(inflight))
            tokens = out.logits[:, 0].argmax(-1)  # [B] on the device: the next step's input
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=on_cuda)
            host.copy_(tokens, non_blocking=on_cuda)
            ready = None
            if on_cuda:
                ready = torch.cuda.Event()
                ready.record()
            inflight.append(_InFlight(host, ready, (time.perf_counter() - t0) * 1000))
            inputs = tokens[:, None]
            if len(inflight) < 2:
                continue  # keep a step queued behind the one the host waits for
        else:
            launching = False
        if not inflight:
            return done > 0
        done += 1
        step = inflight.popleft()
        t_wait = time.perf_counter()
        if step.ready is not None:
            step.ready.synchronize()
        t_synced = time.perf_counter()
        if _commit(engine, seqs, step.tokens.tolist()) or _interrupted(engine, seqs):
            launching = False
        engine.round_timings.append((len(seqs), 1, 0.0, step.launch_ms, (t_synced - t_wait) * 1000,
                                     (time.perf_counter() - t_synced) * 1000))


def _can_launch(engine, seqs: list[Sequence], ahead: int) -> bool:
    """Room for one more step with `ahead` unhandled steps before it: every sequence has tokens
    left for it and blocks for its position."""
    for seq in seqs:
        if seq.remaining_tokens <= ahead or not engine.scheduler.reserve(seq, seq.num_cached + ahead + 1):
            return False
    return True


def _interrupted(engine, seqs: list[Sequence]) -> bool:
    return not engine._inbox.empty() or any(s.cancel.is_set() for s in seqs)


def _commit(engine, seqs: list[Sequence], tokens: list[int]) -> bool:
    """One step's host work: each live sequence keeps its token and emits its chunk (what
    Engine._round does for a one-token round). Returns whether a sequence finished."""
    finished = False
    for seq, token in zip(seqs, tokens):
        if seq.finished:
            continue  # finished at an earlier step: this row was computed in flight, and is dropped
        chunk = engine._commit_round(seq, [], 0, token, None)
        engine._emit(seq, chunk)
        finished = finished or chunk.finish_reason is not None
    return finished
