#!/usr/bin/env python3
"""Where `verispec serve`'s prewarm goes: the engine `serve ARGS` would build (default: --demo),
then cProfile around Engine.prewarm. Run it twice on a fresh GPU machine: the second process starts
with warm Triton and inductor disk caches, as a user's second start does.

  python3 scripts/prewarm_profile.py [--serve-args "--demo"] [--top 40]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shlex
import time


def main() -> None:
    from verispec import cli
    from verispec.engine.engine import Engine

    p = argparse.ArgumentParser()
    p.add_argument("--serve-args", default="--demo")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    serve = cli.build_parser().parse_args(["serve", *shlex.split(args.serve_args)])
    t0 = time.perf_counter()
    engine = Engine.load(cli._engine_config(serve))
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    # graph capture runs on this thread; the warm generations on the engine's worker, whose steps
    # get a profiler of their own (one profiler is active at a time: the phases do not overlap)
    capture = cProfile.Profile()
    t0 = time.perf_counter()
    capture.runcall(engine.capture_graphs)
    print(f"graph capture {time.perf_counter() - t0:.1f} s (profiled)", flush=True)
    steps = cProfile.Profile()
    real_step = engine.step

    def profiled_step() -> None:
        steps.enable()
        try:
            real_step()
        finally:
            steps.disable()

    engine.step = profiled_step
    t0 = time.perf_counter()
    engine.prewarm()  # the graphs are captured: the warm generations and prompt lengths
    print(f"rest of prewarm {time.perf_counter() - t0:.1f} s (profiled)", flush=True)
    for name, profile in (("graph capture", capture), ("warm generations (engine steps)", steps)):
        for key in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
            print(f"== {name}, by {key}\n{out.getvalue()}", flush=True)


if __name__ == "__main__":
    main()
