#!/usr/bin/env python3
"""CPU decode of the default model with and without freeing the caller's OpenMP pool
(verispec/engine/cpu_threads.py): each mode in its own process, alternated, 4 generations of 100
greedy tokens each after a warm-up. `keep` turns the release off (the engine as it was before).

  python scripts/cpu_thread_pools.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

CHILD = "--child"


def child(mode: str) -> None:
    import torch

    from verispec.bench.build import load_target
    from verispec.config import EngineConfig
    from verispec.engine import cpu_threads
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams

    if mode == "keep":
        cpu_threads.release_thread_pool = lambda: False
    target = load_target("smollm2", torch.device("cpu"), torch.float16)
    engine = Engine(target.model, target.tokenizer, EngineConfig(model="smollm2", max_num_seqs=4,
                                                                 max_model_len=1024, kv_cache_gb=0.5))
    _, ids = target.tokenizer.chat_prompt_ids([{"role": "user", "content": "Tell me a long story about a robot."}])
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    engine.generate_all(ids, params)
    rates = []
    for _ in range(4):
        start = time.perf_counter()
        engine.generate_all(ids, params)
        rates.append(round(100 / (time.perf_counter() - start), 1))
    print(f"| {'caller keeps its pool (before)' if mode == 'keep' else 'caller pool freed (now)'} | {rates} |")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == CHILD:
        child(sys.argv[2])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    rounds = parser.parse_args().rounds
    print("| engine thread | tok/s, 4 runs of 100 tokens |\n|---|---|")
    for _ in range(rounds):
        for mode in ("keep", "release"):
            out = subprocess.run([sys.executable, __file__, CHILD, mode], capture_output=True, text=True)
            print(out.stdout.strip() or out.stderr[-500:])


if __name__ == "__main__":
    main()
