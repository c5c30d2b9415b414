#!/usr/bin/env python3
"""A GGUF's Q4_1 weights kept quantized on CUDA (bfloat16): a tiny llama GGUF written with the
`gguf` library's writer, loaded as quantized layers that the engine converts to torch's int4 kernel,
against the same file loaded dense. Prints the converted layer count and how many greedy tokens
the two loads share.

  python3 scripts/gpu_gguf_int4.py
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch


def main() -> None:
    from transformers import AutoTokenizer

    from tests.gguf.files import write_gguf
    from verispec.config import EngineConfig
    from verispec.demo.tiny import build_tokenizer
    from verispec.engine.engine import Engine
    from verispec.engine.params import SamplingParams
    from verispec.loading.model_loader import load_model
    from verispec.loading.tokenizer import Tokenizer
    from verispec.quant.layers.linear import QuantizedLinear

    root = Path(tempfile.mkdtemp())
    build_tokenizer(root / "tok")
    case = write_gguf(root / "llama", "llama", "Q4_1", AutoTokenizer.from_pretrained(str(root / "tok")), seed=3)
    device, dtype = torch.device("cuda"), torch.bfloat16
    prompt = [5, 9, 200, 31, 77, 13, 8, 150]
    outputs = {}
    for keep in (True, False):
        model = load_model(case.path, dtype, device, keep_gguf_4bit=keep)
        engine = Engine(model, Tokenizer.from_dir(case.path), EngineConfig(model=str(case.path), kv_cache_gb=0.2))
        converted = sum(1 for m in model.modules() if isinstance(m, QuantizedLinear) and m.int4_packed is not None)
        got = engine.generate_all(prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)).token_ids
        outputs[keep] = got
        print(f"keep_gguf_4bit={keep}: {converted} layers on torch's int4 kernel, tokens {got[:12]}...")
    same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    print(f"kept vs dense greedy tokens equal: {same}/48 (bf16: the kernel rounds scales to bfloat16)")


if __name__ == "__main__":
    main()
