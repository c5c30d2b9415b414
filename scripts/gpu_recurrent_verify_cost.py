"""What per-position recurrent state costs a verify pass on the Qwen3.6-27B shape (hybrid:
48 Gated DeltaNet layers): step time and memory of target passes over T = 1..5 tokens at a
given context, eager (the hybrid is not graph-captured yet), random bf16 weights.
Run on the lent GPU:  python3 scripts/gpu_recurrent_verify_cost.py
"""
from __future__ import annotations

import argparse

import torch

from verispec.bench.build import random_target
from verispec.bench.shapes import get_shape
from verispec.config import EngineConfig
from verispec.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3.6-27b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    shape = get_shape(args.shape)
    target = random_target(shape.name, shape.config, torch.device(args.device), torch.bfloat16)
    engine = Engine(target.model, target.tokenizer, EngineConfig(model=shape.name, max_model_len=8192))
    cache = engine._cache_for(args.context + 16)
    prompt = list(range(100, 100 + args.context))
    engine._prefill(prompt, cache, ())
    torch.cuda.synchronize()
    print("| T | step ms (median of 10) | ratio to T=1 | extra memory vs T=1 (MB) | per-position SSM state (MB) |")
    print("|---|---|---|---|---|")
    state_mb = sum(s.num_heads * s.key_dim * s.value_dim * 4 for s in target.model.cache_specs()
                   if hasattr(s, "conv_kernel")) / 2**20
    base_ms = base_mem = None
    for t in (1, 2, 3, 5):
        times = []
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for _ in range(12):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            engine._verify_pass(list(range(7, 7 + t)), args.context, cache, ())
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            cache.commit(0)  # nothing kept: the next pass starts from the same state
        ms = sorted(times[2:])[len(times[2:]) // 2]
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        base_ms = base_ms or ms
        base_mem = base_mem if base_mem is not None else peak
        print(f"| {t} | {ms:.2f} | {ms / base_ms:.3f} | {peak - base_mem:.0f} | {t * state_mb:.0f} |")


if __name__ == "__main__":
    main()
