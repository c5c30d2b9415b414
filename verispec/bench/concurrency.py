"""Batched throughput: N sequences submitted at once to one engine (offline `--concurrency`).

Numbers per (method, context, N):
- aggregate_tok_s: every generated token over the wall time from submission to the last finish
  (prefill included);
- decode_tok_s: the steady batched decode rate, tokens emitted between the moment every
  sequence has its first token and the moment the first one finishes, over that window (all N
  decode together in it);
- per_request_tok_s: the median over sequences of (generated - 1) / (finish - first token);
- ttft p50 / p99 from submission;
- batched roofline: one step reads the weights once and every sequence's KV, so
  N x bandwidth / (weight bytes + N x KV bytes per token at the mean decode context).
"""
from __future__ import annotations

import statistics
import threading
import time

from verispec.sampling.params import SamplingParams


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def run_batch(engine, prompts: list[list[int]], gen_tokens: int, grammar=None) -> dict:
    """Submit every prompt at once (greedy, eos ignored; constrained by `grammar` if given) and time
    the chunks as they arrive."""
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True, grammar=grammar)
    n = len(prompts)
    events: list[list[tuple[float, int]]] = [[] for _ in prompts]  # (arrival time, tokens) per chunk
    finals: list = [None] * n
    done = threading.Semaphore(0)

    def sink_for(i: int):
        def sink(item) -> None:
            if isinstance(item, BaseException):
                finals[i] = item
                done.release()
                return
            events[i].append((time.perf_counter(), len(item.token_ids)))
            if item.finish_reason is not None:
                finals[i] = item
                done.release()
        return sink

    engine.round_timings.clear()
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.submit(ids, params, sink_for(i))
    for _ in prompts:
        done.acquire()
    end = time.perf_counter()
    failed = [f for f in finals if isinstance(f, BaseException)]
    if failed:
        raise failed[0]
    first = [next(t for t, k in ev if k) for ev in events]
    finish = [ev[-1][0] for ev in events]
    window_start, window_end = max(first), min(finish)
    in_window = sum(k for ev in events for t, k in ev if window_start < t <= window_end)
    total = sum(k for ev in events for _, k in ev)
    per_request = [(sum(k for _, k in ev) - 1) / (f - t0) for ev, t0, f in zip(events, first, finish) if f > t0]
    stats = [f.stats for f in finals]
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    ttft = [(t - start) * 1000 for t in first]
    full = [t for t in engine.round_timings if t[0] == n]  # rounds with every sequence decoding
    timing = {}
    if full:
        for i, key in enumerate(("round_draft_ms", "round_launch_ms", "round_device_ms", "round_host_after_ms"), 2):
            timing[key] = statistics.median(t[i] for t in full)
    return {
        **timing,
        "concurrency": n,
        "aggregate_tok_s": total / (end - start),
        "decode_tok_s": in_window / (window_end - window_start) if window_end > window_start else None,
        "per_request_tok_s": statistics.median(per_request) if per_request else None,
        "ttft_p50_ms": _percentile(ttft, 0.5),
        "ttft_p99_ms": _percentile(ttft, 0.99),
        "wall_s": end - start,
        "generated_tokens": total,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "num_drafts": engine.draft_policy.stats.last_mean,  # the last round's mean per sequence
        "preemptions": engine.scheduler.num_preemptions,
    }


def batched_roofline_tok_s(bandwidth: float | None, weight_bytes: int, kv_bytes_per_seq: int, n: int) -> float | None:
    if not bandwidth:
        return None
    return n * bandwidth / (weight_bytes + n * kv_bytes_per_seq)
