#!/usr/bin/env python3
"""Where a batched decode round's host time goes: N sequences of one shape decode together (as
`verispec bench --concurrency N` runs them) and cProfile records the engine's steps on its worker
thread once every sequence decodes. Prints the round timing medians and the functions by own time.

  python3 scripts/round_profile.py --shape qwen3-8b --concurrency 64            # GPU
  python scripts/round_profile.py --shape tiny --device cpu --concurrency 64     # the same code paths on CPU
  python scripts/round_profile.py -m verispec/demo/model --device cpu --concurrency 8 [--method mtp]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's verispec

from verispec.bench.options import BenchOptions, Method  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("-m", "--model", default=None, help="a checkpoint instead of a shape (e.g. verispec/demo/model)")
    p.add_argument("--device", default=None)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--method", default="ar", choices=[m.value for m in Method],
                   help="speculation in the rounds (mtp: the checkpoint's MTP head)")
    p.add_argument("--draft-block", type=int, default=3)
    args = p.parse_args()
    from verispec.bench.concurrency import run_batch
    from verispec.bench.offline import _capture_graphs, _engine, _prompt, setup_target

    opts = BenchOptions(shape=None if args.model else args.shape, model=args.model, device=args.device, contexts=(args.context,), gen_tokens=args.gen_tokens,
                        concurrency=(args.concurrency,), repeats=1, draft_block=args.draft_block)
    setup = setup_target(opts)
    engine, _ = _engine(setup, Method(args.method))
    print(f"graphs: {_capture_graphs(engine)}", flush=True)
    n = args.concurrency
    run_batch(engine, [_prompt(setup, args.context, 5000 + i) for i in range(n)], 16)  # warm-up

    profile = cProfile.Profile()
    original = engine.step

    def profiled_step() -> None:
        full = len(engine.scheduler.running) == n and not engine.scheduler.waiting
        if full:
            profile.enable()
        try:
            original()
        finally:
            if full:
                profile.disable()

    engine.step = profiled_step
    result = run_batch(engine, [_prompt(setup, args.context, i) for i in range(n)], args.gen_tokens)
    full = [t for t in engine.round_timings if t[0] == n]
    print(f"{n} sequences: decode {result['decode_tok_s']:.1f} tok/s; {len(full)} full rounds, median ms: "
          + ", ".join(f"{k} {statistics.median(t[i] for t in full):.3f}"
                      for i, k in enumerate(("draft+inputs", "launch", "device", "host after"), 2)), flush=True)
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(args.top)
    print(out.getvalue(), flush=True)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
