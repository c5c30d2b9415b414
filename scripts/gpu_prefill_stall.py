#!/usr/bin/env python3
"""Where the first chunk's time goes at a prompt length the process has not seen (the demo model
with MTP stalled 0.6-5 s on the H200; docs/benchmarks.md): cProfile around the engine's prefill
chunks and its first decode rounds, per request, after one warm-up request of 100 tokens.

  python3 scripts/gpu_prefill_stall.py [--no-spec] [--lengths 480,520]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def main() -> None:
    from verispec.config import EngineConfig
    from verispec.demo.default import require_demo_model
    from verispec.engine.engine import Engine
    from verispec.engine.params import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--no-spec", action="store_true")
    p.add_argument("--lengths", default="480,520")
    args = p.parse_args()
    cfg = EngineConfig(model=str(require_demo_model()), mtp=not args.no_spec,
                       draft_block=None if args.no_spec else 3, max_model_len=4096)
    engine = Engine.load(cfg)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate_all(list(range(100, 200)), params)
    for name in ("_prefill_chunk", "_round"):
        original = getattr(engine, name)

        def timed(*a, _original=original, _name=name, **k):
            profile = cProfile.Profile()
            start = time.perf_counter()
            profile.enable()
            try:
                return _original(*a, **k)
            finally:
                torch.cuda.synchronize()
                profile.disable()
                seconds = time.perf_counter() - start
                if seconds > 0.2:
                    out = io.StringIO()
                    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(22)
                    print(f"--- {_name} took {seconds:.2f}s", flush=True)
                    print("\n".join(line[:180] for line in out.getvalue().splitlines()[6:40]), flush=True)

        setattr(engine, name, timed)
    for n in (int(x) for x in args.lengths.split(",")):
        start = time.perf_counter()
        engine.generate_all(list(range(100, 100 + n)), params)
        print(f"=== {n} tokens: {time.perf_counter() - start:.2f}s", flush=True)


if __name__ == "__main__":
    main()
