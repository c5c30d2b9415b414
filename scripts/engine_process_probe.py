#!/usr/bin/env python3
"""Chunk timing of the engine in its own process (engine/process.py) against the engine in this
process: the demo model with its MTP head, requests one at a time (prompts of different lengths)
then 8 at once; prints time to first chunk and to the last one per request.

  python scripts/engine_process_probe.py proc|single [--no-spec] [--device cuda]
"""
from __future__ import annotations

import argparse
import threading
import time


def main() -> None:
    from verispec.config import EngineConfig
    from verispec.demo.default import require_demo_model
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams
    from verispec.engine.process import EngineProcess

    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("proc", "single"))
    p.add_argument("--no-spec", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--prewarm", action="store_true")
    args = p.parse_args()
    cfg = EngineConfig(model=str(require_demo_model()), mtp=not args.no_spec, draft_block=3 if not args.no_spec else None,
                       device=args.device, max_model_len=4096)
    t0 = time.perf_counter()
    engine = EngineProcess(cfg) if args.mode == "proc" else Engine.load(cfg)
    print(f"{args.mode}: loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    if args.prewarm:
        print(f"{args.mode}: prewarm {engine.prewarm():.1f}s", flush=True)

    def run(batch: list[list[int]]) -> list[tuple[float, float, int]]:
        out = [None] * len(batch)
        done = threading.Semaphore(0)
        start = time.perf_counter()
        for i, ids in enumerate(batch):
            times = []

            def sink(item, times=times, i=i):
                times.append(time.perf_counter() - start)
                if isinstance(item, BaseException) or item.finish_reason is not None:
                    out[i] = (times[0], times[-1], len(times))
                    done.release()

            engine.submit(ids, SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True), sink)
        for _ in batch:
            done.acquire()
        return out

    for n in (480, 500, 520, 540):
        first, last, chunks = run([list(range(100, 100 + n))])[0]
        print(f"{args.mode} 1 x {n} tokens: first chunk {first * 1e3:.0f} ms, last {last * 1e3:.0f} ms, {chunks} chunks",
              flush=True)
    results = run([list(range(100 + i, 600 + 3 * i)) for i in range(8)])
    firsts = sorted(r[0] for r in results)
    lasts = sorted(r[1] for r in results)
    print(f"{args.mode} 8 at once: first chunks {firsts[0] * 1e3:.0f}-{firsts[-1] * 1e3:.0f} ms, "
          f"all done {lasts[-1] * 1e3:.0f} ms, {8 * 256 / lasts[-1]:.0f} tok/s", flush=True)
    if args.mode == "proc":
        engine.close()


if __name__ == "__main__":
    main()
