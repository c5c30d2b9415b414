#!/usr/bin/env python3
"""Where the first chunk's time goes at a prompt length the process has not seen (the demo model
with MTP stalled 0.6-5 s on the H200; docs/benchmarks.md): cProfile around the engine's prefill
chunks and its first decode rounds, per request, after one warm-up request of 100 tokens.

  python3 scripts/gpu_prefill_stall.py [--no-spec] [--prewarm] [--lengths 480,520] [--batch 505,511,...]

--prewarm runs the server's prewarm first (what a served request meets). Every Triton kernel
compiled in the process is printed with its specialisation and seconds (Triton's JIT hooks), and
dynamo recompiles with their guard failures (torch._logging), so a stall names its kernels.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import time

import torch


def main() -> None:
    from verispec.config import EngineConfig
    from verispec.demo.default import require_demo_model
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--no-spec", action="store_true")
    p.add_argument("--lengths", default="480,520")
    p.add_argument("--prewarm", action="store_true")
    p.add_argument("--batch", default="", help="prompt lengths submitted together after --lengths")
    p.add_argument("--rounds", type=int, default=1, help="times the --batch prompts arrive (new tokens each time)")
    args = p.parse_args()
    log_compiles()
    cfg = EngineConfig(model=str(require_demo_model()), mtp=not args.no_spec,
                       draft_block=None if args.no_spec else 3, max_model_len=4096)
    engine = Engine.load(cfg)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    if args.prewarm:
        print(f"prewarm {engine.prewarm():.1f}s", flush=True)
    else:
        engine.generate_all(list(range(100, 200)), params)
    print("=== warm; requests follow", flush=True)
    for name in ("_prefill", "_round"):
        original = getattr(engine, name)

        def timed(*a, _original=original, _name=name, **k):
            profile = cProfile.Profile()
            start = time.perf_counter()
            profile.enable()
            try:
                return _original(*a, **k)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                profile.disable()
                seconds = time.perf_counter() - start
                if seconds > 0.2:
                    out = io.StringIO()
                    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(22)
                    print(f"--- {_name} took {seconds:.2f}s", flush=True)
                    print("\n".join(line[:180] for line in out.getvalue().splitlines()[6:40]), flush=True)

        setattr(engine, name, timed)
    for n in (int(x) for x in args.lengths.split(",") if x):
        start = time.perf_counter()
        engine.generate_all(list(range(100, 100 + n)), params)
        print(f"=== {n} tokens: {time.perf_counter() - start:.2f}s", flush=True)
    if args.batch:
        lengths = [int(x) for x in args.batch.split(",")]
        for r in range(args.rounds):
            # each round a little longer, as a server's requests differ in length
            prompts = [[(7919 * n + 31 * j + 104729 * r) % 4000 + 10 for j in range(n + r)] for n in lengths]
            start = time.perf_counter()
            results = engine.generate_batch(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
            ttft = sorted(res.stats.ttft_ms for res in results)
            print(f"=== batch {lengths} round {r}: {time.perf_counter() - start:.2f}s, TTFT ms "
                  f"{', '.join(f'{t:.0f}' for t in ttft)}", flush=True)


def log_compiles() -> None:
    """Print each Triton JIT compile (kernel, specialisation, seconds) and dynamo's recompiles."""
    import torch._logging

    torch._logging.set_logs(recompiles=True)
    try:
        from triton import knobs
    except ImportError:
        return
    started: dict = {}
    seen: dict = {}  # kernel name -> the argument specialisations compiled so far

    def before(*, key, repr, **_):
        started[str(key)] = time.perf_counter()
        return False  # do not skip the compile

    def after(*, key, repr, fn, **_):
        seconds = time.perf_counter() - started.pop(str(key), time.perf_counter())
        parts = re.findall(r"\('[^']*', [^()]*\)", str(key))
        names = [p.name for p in fn.jit_function.params]
        earlier = seen.setdefault(fn.name, [])
        note = ""
        if earlier:  # what differs from the closest earlier compile: the argument that made this one
            closest = min(earlier, key=lambda e: sum(a != b for a, b in zip(e, parts)))
            diff = [f"{names[i] if i < len(names) else i}: {a} -> {b}"
                    for i, (a, b) in enumerate(zip(closest, parts)) if a != b]
            note = f" new vs closest of {len(earlier)}: {'; '.join(diff) or 'options only'}"
        earlier.append(parts)
        print(f"[triton compile {seconds:.2f}s] {fn.name}{note}", flush=True)

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after


if __name__ == "__main__":
    main()
