"""Perplexity of fixed texts with the paged KV cache stored as each `--kv-cache-dtype`, and
optionally a needle-retrieval check, on one model (float32 on the CPU by default).

Each text's first --tokens tokens are scored as one prompt (SamplingParams.prompt_logprobs, what
`/v1/completions` with echo and logprobs returns): every prompt token's logprob comes from
attention over keys and values read back from the compressed pools, its own chunk's included, as
a served request's would. The model loads once; an engine per format shares it.

    python scripts/kv_quality.py                  # SmolLM2-135M (the default model): a doc and a source file
    python scripts/kv_quality.py -m DIR --text a.md --text b.py --tokens 2048 --formats auto,fp8,tq4,tq3
    python scripts/kv_quality.py --needle 4096    # also: a number hidden in 4096 tokens, asked for at the end

`--formats` may also name `kXvY` (X-bit keys, Y-bit values, X, Y in 2..4): splits the server does
not offer, registered here only, to measure which of keys or values needs the bits (k3v4 is tq3's
size with the bit moved to the values).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ("docs/speculative-decoding.md", "verispec/cache/prefix.py")  # English prose, then code
NEEDLE = "The secret number is {number}. Remember it."
DEPTHS = (0.1, 0.5, 0.9)  # where in the context the needle sits
QUESTION = "\n\nQuestion: what is the secret number? Answer: The secret number is"


def register_splits(formats: list[str]) -> None:
    """Make `kXvY` names loadable for this measurement (the flag itself knows only tq4 and tq3)."""
    from verispec.cache import paged
    from verispec.engine import options
    from verispec.kernels import kv_turboquant

    for name in formats:
        match = re.fullmatch(r"k([2-4])v([2-4])", name)
        if match:
            kv_turboquant.FORMATS[name] = kv_turboquant.TurboQuantFormat(name, int(match[1]), int(match[2]))
            paged.KV_CACHE_DTYPES = options.KV_CACHE_DTYPES = (*paged.KV_CACHE_DTYPES, name)


def load_engines(model: str, formats: list[str], dtype: str, max_len: int) -> dict:
    """{format: Engine}, one model shared by all."""
    from verispec.config import EngineConfig
    from verispec.engine.engine import Engine

    base_config = EngineConfig(model=model, device="cpu", dtype=dtype, max_model_len=max_len, max_num_seqs=1,
                               prefix_cache=False, prefill_step_seconds=0, kv_cache_gb=0.5)
    first = Engine.load(replace(base_config, kv_cache_dtype=formats[0]))
    engines = {formats[0]: first}
    for fmt in formats[1:]:
        engines[fmt] = Engine(first.model, first.tokenizer, replace(first.config, kv_cache_dtype=fmt), first.model_dir)
    return engines


def perplexity(engine, ids: list[int]) -> float:
    from verispec.sampling.params import SamplingParams

    result = engine.generate_all(ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    logprobs = [lp.logprob for lp in result.prompt_logprobs]
    return math.exp(-sum(logprobs) / len(logprobs))


def needle_prompt(tokenizer, filler: list[int], length: int, depth: float, number: int) -> list[int]:
    """`length` tokens: filler text with the needle sentence at `depth` (0..1), then the question."""
    needle = tokenizer.encode(" " + NEEDLE.format(number=number) + " ")
    question = tokenizer.encode(QUESTION)
    room = length - len(needle) - len(question)
    body = (filler * (room // len(filler) + 1))[:room]
    at = int(room * depth)
    return body[:at] + needle + body[at:] + question


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default=None, help="model (default: the default model, SmolLM2-135M)")
    parser.add_argument("--text", action="append", default=None, help=f"a text file (default: {', '.join(TEXTS)})")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens scored of each text (default 2048)")
    parser.add_argument("--formats", default="auto,fp8,tq4,tq3,k3v4")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--needle", type=int, default=0, help="also a needle check at this many tokens (0: none)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # this checkout's verispec
    from verispec.cache.paged import kv_bytes_per_token
    from verispec.default_model import default_model

    model = args.model or default_model("cpu", fallback_to_demo=False).model
    formats = args.formats.split(",")
    register_splits(formats)
    engines = load_engines(model, formats, args.dtype, max(args.tokens, args.needle) + 16)
    first = engines[formats[0]]
    texts = [Path(t) if Path(t).is_absolute() else ROOT / t for t in (args.text or TEXTS)]
    token_ids = {t: first.tokenizer.encode(t.read_text())[:args.tokens] for t in texts}
    specs = first.model.cache_specs()
    print(f"model {Path(model).name}, {args.dtype} on the CPU; perplexity of each text's first tokens\n")
    names = [f"{t.name} ({len(ids)} tokens)" for t, ids in token_ids.items()]
    print("| kv cache | bytes/token | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    base: list[float] | None = None
    for fmt, engine in engines.items():
        t0 = time.perf_counter()
        ppl = [perplexity(engine, ids) for ids in token_ids.values()]
        base = base or ppl
        cells = [f"{p:.3f} ({100 * (p / b - 1):+.2f}%)" for p, b in zip(ppl, base)]
        per_token = kv_bytes_per_token(specs, first.dtype, fmt)
        print(f"| {fmt} | {per_token} | " + " | ".join(cells) + f" |  <!-- {time.perf_counter() - t0:.0f}s -->",
              flush=True)
    if args.needle:
        from verispec.sampling.params import SamplingParams

        filler = token_ids[texts[0]]
        print(f"\nneedle: a 5-digit number at depths {', '.join(map(str, DEPTHS))} of {args.needle} tokens, "
              "greedy answer\n")
        print("| kv cache | found |")
        print("|---|---|")
        for fmt, engine in engines.items():
            found = []
            for i, depth in enumerate(DEPTHS):
                number = 40_000 + 7919 * (i + 1)
                prompt = needle_prompt(engine.tokenizer, filler, args.needle, depth, number)
                out = engine.generate_all(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
                found.append(str(number) in out.text.replace(",", ""))
            print(f"| {fmt} | {sum(found)}/{len(found)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
