#!/usr/bin/env python3
"""Where a warm prompt's time to first token goes (the demo model with its MTP head by default):
prompts of one length (distinct tokens: no prefix hit) are prefilled until nothing compiles any
more, then one more runs under cProfile, and prefills with and without the drafter are timed.

  python3 scripts/prefill_profile.py [--length 512] [--no-spec] [-m MODEL]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from dataclasses import replace

import torch


def main() -> None:
    from verispec.config import EngineConfig
    from verispec.demo.default import require_demo_model
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--no-spec", action="store_true")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--together", default="8", help="also time N prompts submitted at once, with and without "
                   "batched prefill (comma-separated Ns; empty: skip)")
    args = p.parse_args()
    model = args.model or str(require_demo_model())
    cfg = EngineConfig(model=model, mtp=not args.no_spec, draft_block=None if args.no_spec else 3, max_model_len=4096)
    engine = Engine.load(cfg)
    vocab = engine.num_real_tokens
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prompt(i: int) -> list[int]:
        return [(7919 * i + 31 * j + 11) % vocab for j in range(args.length)]

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    for i in range(4):  # compiles whatever this length needs
        engine.generate_all(prompt(i), params)
    times = []
    for i in range(4, 12):
        sync()
        t0 = time.perf_counter()
        engine.generate_all(prompt(i), params)
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    print(f"{args.length}-token prompt, first token: {sorted(times)[len(times) // 2]:.1f} ms median "
          f"({', '.join(f'{t:.1f}' for t in times)})", flush=True)
    for n in [int(x) for x in args.together.split(",") if x]:  # the first tokens of N clients arriving together
        for run, batched in enumerate((True, False, True, False)):  # distinct prompts: no prefix hits
            engine.config = replace(engine.config, batch_prefill=batched)
            batch = [prompt(1000 + 100 * n + 20 * run + i) for i in range(n)]
            sync()
            t0 = time.perf_counter()
            engine.generate_batch(batch, params)
            sync()
            print(f"{n} {args.length}-token prompts at once, batched prefill {'on ' if batched else 'off'}: "
                  f"all first tokens in {(time.perf_counter() - t0) * 1000:.1f} ms", flush=True)
    engine.config = replace(engine.config, batch_prefill=True)
    profile = cProfile.Profile()
    original = engine._prefill

    def profiled(*a, **k):
        profile.enable()
        try:
            return original(*a, **k)
        finally:
            sync()
            profile.disable()

    engine._prefill = profiled
    for i in range(12, 16):
        engine.generate_all(prompt(i), params)
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
        print("\n".join(line[:200] for line in out.getvalue().splitlines()), flush=True)


if __name__ == "__main__":
    main()
