"""Several prompts arriving at once on a CPU: each one's time to first token with the step's prompt
chunks in one pass (batched prefill) and with a pass each (the CPU's default), the default model.

    python scripts/cpu_prompts_at_once.py --prompts 4 --words 345
"""
from __future__ import annotations

import argparse
import random
import time

from verispec.default_model import default_model
from verispec.engine.engine import load_engine
from verispec.sampling.params import SamplingParams

WORDS = "bright word island game car child river stone light table ocean music paper glass".split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--words", type=int, default=345, help="random words a prompt")
    args = parser.parse_args()
    chosen = default_model("cpu")
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for batched in (True, False):
        engine = load_engine(chosen.model, device="cpu", dtype=chosen.dtype, batch_prefill=batched)

        def prompt(seed: int) -> list[int]:
            rng = random.Random(seed)
            return engine.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(args.words)))

        engine.generate_all(prompt(0), one_token)  # warm
        t0 = time.perf_counter()
        engine.generate_all(prompt(1), one_token)
        alone = time.perf_counter() - t0
        prompts = [prompt(10 + i) for i in range(args.prompts)]
        t0 = time.perf_counter()
        results = engine.generate_batch(prompts, [one_token] * len(prompts))
        together = time.perf_counter() - t0
        firsts = ", ".join(f"{r.stats.ttft_ms / 1000:.2f}" for r in results)
        print(f"{'one pass' if batched else 'a pass each'}: {len(prompts[0])}-token prompt alone {alone:.2f} s; "
              f"{len(prompts)} at once {together:.2f} s, first tokens at {firsts} s", flush=True)


if __name__ == "__main__":
    main()
