#!/usr/bin/env python3
"""Where a speculative round's host time goes, by engine function: N sequences decode together
and each wrapped call's wall time is summed per round (no profiler overhead beyond a timer per call).
"rest of round" is _round minus the wrapped calls: building inputs, the device wait for the greedy
choices, TargetStep slices. With no -m, a tiny random Qwen3.5 with an MTP head is built in a
temporary directory: on a CPU its passes are cheap, so the per-sequence Python stands out as it does
on a GPU.

  python scripts/round_breakdown.py --concurrency 8                       # tiny hybrid + MTP, CPU
  python3 scripts/round_breakdown.py -m verispec/demo/model --device cuda  # the demo on a GPU
"""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path


def tiny_mtp_model(root: Path) -> Path:
    from tools.tiny import build_tiny_qwen3_5, random_mtp_head, write_mtp_sidecar

    model = root / "tiny-qwen3_5"
    build_tiny_qwen3_5(model, seed=21)
    config = json.loads((model / "config.json").read_text())
    write_mtp_sidecar(model / "mtp.safetensors", random_mtp_head(config, seed=5))
    return model


def main() -> None:
    from verispec.bench.concurrency import run_batch
    from verispec.cache.paged import BatchCache
    from verispec.config import EngineConfig
    from verispec.engine.engine import Engine

    p = argparse.ArgumentParser()
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--draft-block", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=128)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_mtp_model(Path(tmp)))
        engine = Engine.load(EngineConfig(model=model, device=args.device, dtype=args.dtype, mtp=True,
                                          draft_block=args.draft_block, draft_schedule=f"1:{args.draft_block}",
                                          max_num_seqs=max(args.concurrency, 1)))
        if engine.device.type == "cuda":
            print(f"graphs captured in {engine.capture_graphs():.1f} s", flush=True)
        totals: dict[str, float] = collections.defaultdict(float)
        calls: dict[str, int] = collections.defaultdict(int)
        full = {"on": False}

        def timed(name, fn):
            def wrapper(*a, **kw):
                if not full["on"]:
                    return fn(*a, **kw)
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    totals[name] += time.perf_counter() - t0
                    calls[name] += 1
            return wrapper

        n = args.concurrency
        real_round = engine._round

        def round_(seqs, num_drafts):
            full["on"] = len(seqs) == n and not engine.scheduler.waiting
            t0 = time.perf_counter()
            try:
                return real_round(seqs, num_drafts)
            finally:
                if full["on"]:
                    totals["_round (all)"] += time.perf_counter() - t0
                    calls["_round (all)"] += 1
                full["on"] = False

        engine._round = round_
        for name in ("_propose", "_verify", "_commit_round", "_emit"):
            setattr(engine, name, timed(name, getattr(engine, name)))
        engine.runner.verify = timed("runner.verify (launch)", engine.runner.verify)
        if engine.proposer is not None and hasattr(engine.proposer, "observe_rows"):
            engine.proposer.observe_rows = timed("proposer.observe_rows", engine.proposer.observe_rows)
        real_commit = BatchCache.commit
        BatchCache.commit = timed("cache.commit", real_commit)
        vocab = engine.model.vocab_size
        prompts = [[(37 * i + 11 * j) % (vocab - 10) + 5 for j in range(args.prompt_tokens)] for i in range(n)]
        run_batch(engine, prompts, 16)  # warm-up
        totals.clear()
        calls.clear()
        result = run_batch(engine, prompts, args.gen_tokens)
        rounds = calls["_round (all)"] or 1
        print(f"{n} sequences, {rounds} full rounds, decode {result['decode_tok_s']:.0f} tok/s; per round (us):")
        wrapped = 0.0
        for name, total in sorted(totals.items(), key=lambda kv: -kv[1]):
            if name != "_round (all)" and name != "_propose":
                wrapped += total
            print(f"  {name:28s} {total / rounds * 1e6:9.1f}   ({calls[name] / rounds:.1f} calls)")
        rest = totals["_round (all)"] - wrapped - totals["_propose"]
        print(f"  {'rest of round':28s} {rest / rounds * 1e6:9.1f}")
        BatchCache.commit = real_commit
        engine.shutdown()


if __name__ == "__main__":
    main()
