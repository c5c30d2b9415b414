#!/usr/bin/env python3
"""Overlapped decoding on the GPU gives the one-step-at-a-time output, token for token: a tiny
random Qwen3-architecture model (bf16, CUDA graphs), 12 greedy requests at once with different
prompt lengths and max_tokens, one stop string, each run with --no-overlap-decode and with the
default, and the engine's count of steps that were queued ahead.

  python3 scripts/gpu_overlap_identity.py [--shape tiny] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse


def main() -> None:
    from verispec.bench.offline import setup_target
    from verispec.bench.options import BenchOptions
    from verispec.config import EngineConfig
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    setup = setup_target(BenchOptions(shape=args.shape, dtype=args.dtype))
    target = setup.target
    vocab = target.model.vocab_size
    prompts = [[(977 * i + 31 * j) % vocab for j in range(5 + 23 * i)] for i in range(12)]
    params = [SamplingParams(max_tokens=20 + 9 * i, temperature=0.0, ignore_eos=True) for i in range(12)]
    outputs = {}
    for overlapped in (False, True):
        config = EngineConfig(model=args.shape, max_num_seqs=16, max_model_len=512,
                              overlap_decode=None if overlapped else False)
        engine = Engine(target.model, target.tokenizer, config)
        engine.capture_graphs()
        if not overlapped:  # a stop string met mid-generation by request 5
            first = engine.generate_all(prompts[5], params[5]).token_ids
            params[5] = SamplingParams(max_tokens=params[5].max_tokens, temperature=0.0, ignore_eos=True,
                                       stop=[target.tokenizer.decode(first[12:14])])
        results = engine.generate_batch(prompts, params)
        queued_ahead = sum(1 for t in engine.round_timings if t[1] == 1 and t[2] == 0.0)
        outputs[overlapped] = [(r.token_ids, r.text, r.finish_reason) for r in results]
        print(f"overlap_decode={engine.overlap_decode}: lengths {[len(r.token_ids) for r in results]}, "
              f"finish {[r.finish_reason.value for r in results]}, blocks in use after {engine.blocks.num_used}, "
              f"rounds {len(engine.round_timings)}, of them overlapped {queued_ahead}", flush=True)
        del engine
    same = sum(a == b for a, b in zip(outputs[False], outputs[True]))
    print(f"identical with and without overlap: {same}/{len(prompts)}", flush=True)
    if same != len(prompts):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
