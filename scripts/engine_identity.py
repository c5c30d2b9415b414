"""In the engine, without a server: is each prompt's answer (tokens and logprobs, bit for bit) the
same alone, all at once, repeated (prefix-cache hits) and with 16-token prompt chunks without the
prefix cache? The quick check behind `served_identity.py`'s, for any model.

    python scripts/engine_identity.py                       # the embedded demo model, CUDA, bf16
    python scripts/engine_identity.py -m DIR --device cpu --dtype float16 --numerics exact

Exit status 1 when any answer differs.
"""
from __future__ import annotations

import argparse
import sys
import time

TEXTS = ["Tell me a story about a cat.", "What is the capital of France? Explain.",
         "Write a poem about the sea and the wind " * 8]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default=None, help="model (default: the embedded demo model)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--numerics", default="auto")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    from verispec.config import EngineConfig  # after the arguments: --help imports no torch
    from verispec.default_model import demo_default
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams

    started = time.monotonic()
    model = args.model or demo_default(args.device.split(":")[0]).model

    def load(**fields) -> Engine:
        return Engine.load(EngineConfig(model=model, dtype=args.dtype, device=args.device, numerics=args.numerics,
                                        cuda_graphs=False, max_num_seqs=8, kv_cache_gb=0.5, **fields))

    def answer(result) -> tuple:
        return tuple(result.token_ids), tuple((lp.token_id, lp.logprob) for lp in result.logprobs)

    engine = load()
    print(f"numerics {engine.describe().numerics}", flush=True)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    alone = [answer(engine.generate_all(p, params)) for p in prompts]
    ways = {"all at once": [answer(r) for r in engine.generate_batch(prompts, params)],
            "repeated": [answer(engine.generate_all(p, params)) for p in prompts]}
    chunked = load(prefill_step_size=16, prefix_cache=False)
    ways["16-token chunks, no prefix cache"] = [answer(chunked.generate_all(p, params)) for p in prompts]
    differs = False
    for way, answers in ways.items():
        same = sum(a == b for a, b in zip(alone, answers))
        differs |= same != len(prompts)
        print(f"{way} == alone: {same}/{len(prompts)}", flush=True)
    print(f"{time.monotonic() - started:.0f} s")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
