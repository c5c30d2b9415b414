"""On the GPU: a sequence's greedy output inside a batch vs alone, with the CUDA graphs captured.

For a tiny random Qwen3 model (float32 and bf16; plain, always-right replay, always-wrong replay)
and the embedded demo model (its default MTP speculation and plain): N prompts are generated
alone, then all together; prints how many are identical. float32 must be N/N; bf16 shows what
batch-size-dependent GEMM reduction order does today (the exact-bf16 issue). With --quant mlx-4bit
the tiny target is MLX 4-bit (`verispec quantize`, group 64) and wide enough (hidden 512, MLP 1,024)
for its MLPs to take the streaming kernel (kernels/stream_mlp.py): 8 rows a decode step, 32 a
speculative round (four 8-row launches); --skip-demo leaves out the demo model.

    python3 scripts/gpu_batch_identity.py [--quant mlx-4bit] [--dtypes float32,bfloat16] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

from test_batch_identity import KeyedReplay  # noqa: E402
from tools.tiny import build_tiny_model, build_tokenizer  # noqa: E402
from verispec.engine.engine import Engine, load_engine  # noqa: E402
from verispec.engine.params import SamplingParams  # noqa: E402

TEXTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "x = [",
         "for i in range(10):\n    print(i)\n", "# A function that sorts a list\ndef sort(xs):",
         "while True:\n    line = input()", "with open('f.txt') as f:\n    for line in f:"]


def compare(engine: Engine, prompts: list[list[int]], tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    alone = [engine.generate_all(ids, params).token_ids for ids in prompts]
    t0 = time.perf_counter()
    together = engine.generate_batch(prompts, params)
    seconds = time.perf_counter() - t0
    same = [a == r.token_ids for a, r in zip(alone, together)]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, r.token_ids)) if x != y), None)
                  for a, r in zip(alone, together)]
    return {"identical": sum(same), "of": len(same), "first_divergence": first_diff,
            "batch_seconds": round(seconds, 3), "blocks_leaked": engine.blocks.num_used}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quant", default="none", help="none or mlx-4bit (the tiny target's weights)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--skip-demo", action="store_true")
    args = ap.parse_args()
    results = {}
    root = Path(tempfile.mkdtemp())
    build_tokenizer(root / "tok")
    shape = dict(hidden_size=128, intermediate_size=256) if args.quant == "none" else dict(hidden_size=512,
                                                                                          intermediate_size=1024)
    build_tiny_model(root / "qwen3", "qwen3", seed=0, tokenizer_dir=root / "tok", num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, **shape)
    target = root / "qwen3"
    if args.quant != "none":
        from verispec.cli import main as main_cli
        target = root / f"qwen3-{args.quant}"
        if main_cli(["quantize", "-m", str(root / "qwen3"), "--format", args.quant, "--out", str(target)]) != 0:
            raise SystemExit(f"quantize {args.quant} failed")
    for dtype in args.dtypes.split(","):
        base = load_engine(str(target), dtype=dtype, device="cuda", max_num_seqs=16)
        base.capture_graphs()
        prompts = [base.tokenizer.encode(t) for t in TEXTS]
        results[f"tiny {args.quant} {dtype} plain"] = compare(base, prompts, args.tokens)
        greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        conts = {tuple(ids): base.generate_all(ids, greedy).token_ids for ids in prompts}
        for right in (True, False):
            eng = Engine(base.model, base.tokenizer, base.config, base.model_dir,
                         proposer=KeyedReplay(conts, base.model.vocab_size, right), num_drafts=3)
            eng.capture_graphs()
            label = f"tiny {args.quant} {dtype} replay-{'right' if right else 'wrong'}"
            results[label] = compare(eng, prompts, args.tokens)
            del eng
        del base
        torch.cuda.empty_cache()
    demo = Path(__file__).resolve().parents[1] / "verispec" / "demo" / "model"
    if (demo / "config.json").is_file() and not args.skip_demo:
        for label, kwargs in (("demo plain", {}), ("demo mtp-3", {"mtp": True, "mtp_depth": 3, "num_mtp_tokens": 3})):
            eng = load_engine(str(demo), device="cuda", max_num_seqs=16, **kwargs)
            eng.prewarm()
            prompts = [eng.tokenizer.encode(t) for t in TEXTS]
            results[label] = compare(eng, prompts, 128)
            del eng
            torch.cuda.empty_cache()
    for name, r in results.items():
        print(f"{name:28s} identical {r['identical']}/{r['of']}  first divergence {r['first_divergence']}  "
              f"batch {r['batch_seconds']}s  leaked blocks {r['blocks_leaked']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "batch_identity.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
