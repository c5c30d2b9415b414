"""Parity of verispec against transformers on one device and dtype, for every supported model type.

Run on the lent GPU (see docs/gpu.md):  python3 scripts/gpu_parity.py --device cuda --out $OUT/parity.json
For each model_type and dtype it reports: logits max-abs / relative error over a prompt, and how
many of N greedy tokens agree before the first divergence (bf16 kernels may legitimately differ).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from tools.tiny import build_tiny_model, build_tokenizer
from verispec.engine.engine import load_engine
from verispec.engine.params import SamplingParams

CASES = {
    "llama": dict(num_key_value_heads=2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(num_key_value_heads=2, head_dim=64),
    "mistral": dict(num_key_value_heads=2, sliding_window=32),
}
SIZE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            max_position_embeddings=2048)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def run(device: str, new_tokens: int, prompts: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    rows = []
    root = Path(tempfile.mkdtemp())
    build_tokenizer(root / "tok")
    gen = torch.Generator().manual_seed(0)
    for model_type, overrides in CASES.items():
        model_dir = root / model_type
        build_tiny_model(model_dir, model_type, tokenizer_dir=root / "tok", **{**SIZE, **overrides})
        for dtype_name, dtype in DTYPES.items():
            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
            engine = load_engine(str(model_dir), dtype=dtype_name, device=device, prefill_step_size=64)
            engine.capture_graphs()  # decode steps as CUDA graphs over the split-K kernel (no-op on CPU)
            vocab = engine.num_real_tokens
            agree, errs, rels = [], [], []
            for p in range(prompts):
                length = 40 + 37 * p  # some prompts longer than the prefill chunk
                ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
                with torch.no_grad():
                    ref = hf(torch.tensor([ids], device=device)).logits[0].float()
                    cache = engine.model.make_cache(length)
                    pos = torch.arange(length, device=device)[None]
                    out = engine.model(torch.tensor([ids], device=device), pos, cache)
                    ours = engine.model.logits(out.hidden)[0].float()
                errs.append(float((ours - ref).abs().max()))
                rels.append(float((ours - ref).norm() / ref.norm()))
                hf_ids = hf.generate(torch.tensor([ids], device=device), max_new_tokens=new_tokens, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, length:].tolist()
                res = engine.generate_all(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
                agree.append(first_divergence(hf_ids, res.token_ids))
            rows.append(dict(model_type=model_type, dtype=dtype_name, device=device,
                             logits_max_abs=max(errs), logits_rel=max(rels),
                             greedy_identical=sum(a == new_tokens for a in agree), prompts=prompts,
                             first_divergence=agree, new_tokens=new_tokens))
            del hf, engine
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compiled-qk", action="store_true",
                    help="prepare queries and keys with the compiled torch function, not kernels/qk_prep.py")
    args = ap.parse_args()
    if args.compiled_qk:
        from verispec.kernels import qk_prep
        qk_prep.unsupported_reason = lambda *a: "--compiled-qk"
    t0 = time.time()
    rows = run(args.device, args.new_tokens, args.prompts)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"| model | dtype | logits max-abs | rel | greedy identical ({args.new_tokens} tok) | first divergence |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model_type']} | {r['dtype']} | {r['logits_max_abs']:.2e} | {r['logits_rel']:.2e} | "
              f"{r['greedy_identical']}/{r['prompts']} | {r['first_divergence']} |")
    print(f"({time.time() - t0:.0f}s on {args.device}, torch {torch.__version__})")


if __name__ == "__main__":
    main()
