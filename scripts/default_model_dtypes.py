"""Which compute dtype the default model (SmolLM2-135M-Instruct) should use on this device:
plain greedy decode speed per dtype, and how far each dtype's greedy tokens agree with float32's
on a few chat prompts. What verispec/default_model.py's SMOLLM2_DTYPE_BY_DEVICE records.

  python scripts/default_model_dtypes.py [--device cpu] [--tokens 200]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a CPU cache is in two sentences.", "List three fruits.",
           "How do I reverse a list in Python?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per speed run")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's verispec
    import torch

    from verispec.bench.build import load_target
    from verispec.config import EngineConfig
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams

    device = torch.device(args.device)
    answers: dict[str, list[list[int]]] = {}
    print("| dtype | plain decode tok/s | greedy tokens equal to float32's (5 prompts x 60) |")
    print("|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        target = load_target("smollm2", device, dtype)
        engine = Engine(target.model, target.tokenizer, EngineConfig(model="smollm2", max_num_seqs=4,
                                                                     max_model_len=1024, kv_cache_gb=0.5))
        _, ids = target.tokenizer.chat_prompt_ids([{"role": "user", "content": "Tell me a long story."}])
        engine.generate_all(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
        began = time.perf_counter()
        engine.generate_all(ids, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
        speed = args.tokens / (time.perf_counter() - began)
        name = str(dtype).removeprefix("torch.")
        answers[name] = [engine.generate_all(target.tokenizer.chat_prompt_ids([{"role": "user", "content": p}])[1],
                                             SamplingParams(max_tokens=60, temperature=0.0)).token_ids
                         for p in PROMPTS]
        agree = []
        for mine, ref in zip(answers[name], answers["float32"]):
            agree.append(next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref))))
        print(f"| {name} | {speed:.1f} | {', '.join(map(str, agree))} |", flush=True)


if __name__ == "__main__":
    main()
