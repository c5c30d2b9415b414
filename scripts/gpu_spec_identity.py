"""Speculative vs plain greedy on one device and dtype: identical, or where they first diverge.

Run on the lent GPU:  python3 scripts/gpu_spec_identity.py --device cuda --out $OUT/spec_identity.json
With --quant mlx-8bit,mlx-4bit the targets are first quantized by `verispec quantize` (MLX affine,
group 64): decode and verify passes then run the quantized kernels (the Gluon GEMV, tinygemm).
In float32 the outputs should be identical. In bf16 a verify pass over k+1 tokens runs other
kernel shapes than a 1-token decode step, so near-ties can flip: this measures how often and
after how many tokens.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from verispec.cli import main as main_cli
from tools.tiny import build_tiny_model, build_tokenizer, corpus_text, write_random_eagle3
from verispec.engine.engine import Engine, load_engine
from verispec.engine.params import SamplingParams
from verispec.spec.eagle3 import Eagle3Proposer, load_eagle3
from verispec.spec.proposer import Draft, Proposer

# intermediate 2048 (32 blocks of 64): whole steps of the 4-bit MLP's streaming kernel (kernels/stream_mlp.py)
SHAPE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096)


class Replay(Proposer):
    method = "replay"

    def __init__(self, cont, every: int, vocab_size: int):
        self.cont, self.every, self.vocab_size = cont, every, vocab_size  # every: wrong at each every-th slot

    def reset(self, prompt_ids):
        self.n = len(prompt_ids)

    def observe(self, step):
        self.i = step.start_position + len(step.token_ids) - self.n + 1

    def propose(self, k, params, gen):
        out = []
        for j in range(k):
            t = self.cont[self.i + j] if self.i + j < len(self.cont) else 0
            out.append(t if not self.every or (self.i + j) % self.every else (t + 1) % self.vocab_size)
        return Draft(out)


def divergence(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="prompts of exactly this many tokens (default: 400 characters each). ~8,150 makes "
                         "the tiny models' generations cross 8,192 keys, where split-K attention's shares grow "
                         "(64 splits of 128-key blocks for their 2 kv heads)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quant", default="none", help="comma-separated: none, mlx-8bit, mlx-4bit")
    ap.add_argument("--models", default="llama,qwen3")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--no-graphs", action="store_true", help="eager passes (EngineConfig.cuda_graphs=False)")
    ap.add_argument("--no-overlap", action="store_true", help="plain decode without the overlapped loop")
    args = ap.parse_args()
    t0 = time.time()
    root = Path(tempfile.mkdtemp())
    build_tokenizer(root / "tok")
    rows = []
    text = corpus_text()
    targets = []
    for model_type in args.models.split(","):
        fdir = root / model_type
        shape = dict(SHAPE, max_position_embeddings=max(SHAPE["max_position_embeddings"],
                                                        (args.prompt_tokens or 0) + args.new_tokens + 64))
        build_tiny_model(fdir, model_type, tokenizer_dir=root / "tok", **shape,
                         **({"head_dim": 64} if model_type == "qwen3" else {}))
        cfg = json.loads((fdir / "config.json").read_text())
        ddir = write_random_eagle3(root / f"{model_type}-eagle3", cfg)
        for quant in args.quant.split(","):
            mdir = fdir
            if quant != "none":
                mdir = root / f"{model_type}-{quant}"
                if main_cli(["quantize", "-m", str(fdir), "--format", quant, "--out", str(mdir)]) != 0:
                    raise SystemExit(f"quantize {quant} failed")
            targets.append((f"{model_type}" + ("" if quant == "none" else f" {quant}"), mdir, ddir))
    for model_type, mdir, ddir in targets:
        for dtype in args.dtypes.split(","):
            print(f"{model_type} {dtype}", flush=True)
            plain_engine = load_engine(str(mdir), dtype=dtype, device=args.device, cuda_graphs=not args.no_graphs,
                                       overlap_decode=False if args.no_overlap else None)
            tok = plain_engine.tokenizer
            if args.prompt_tokens:
                prompts = [tok.encode(text[i * 997: i * 997 + 12 * args.prompt_tokens])[:args.prompt_tokens]
                           for i in range(args.prompts)]
                assert all(len(p) == args.prompt_tokens for p in prompts), "corpus too short for --prompt-tokens"
            else:
                prompts = [tok.encode(text[i * 997: i * 997 + 400]) for i in range(args.prompts)]
            params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
            plain_engine.capture_graphs()
            plain = [plain_engine.generate_all(p, params).token_ids for p in prompts]
            eagle = Eagle3Proposer(load_eagle3(ddir, plain_engine.model), plain_engine.model.vocab_size)
            vocab = plain_engine.model.vocab_size
            for name, k, make in (("eagle3-random", 3, lambda c: eagle), ("replay-right", 3, lambda c: Replay(c, 0, vocab)),
                                  ("replay-right", 5, lambda c: Replay(c, 0, vocab)),
                                  ("replay-partial", 4, lambda c: Replay(c, 3, vocab))):
                print(f"  {name} k={k}", flush=True)
                divs, acc, drafted = [], 0, 0
                for p, cont in zip(prompts, plain):
                    eng = Engine(plain_engine.model, tok, plain_engine.config, proposer=make(cont), num_drafts=k)
                    eng.capture_graphs()
                    r = eng.generate_all(p, params)
                    divs.append(divergence(cont, r.token_ids))
                    acc += r.stats.accepted
                    drafted += r.stats.drafted
                rows.append(dict(model=model_type, dtype=dtype, proposer=name, k=k,
                                 identical=sum(d is None for d in divs), prompts=len(prompts),
                                 first_divergence=[d for d in divs if d is not None],
                                 acceptance=acc / max(drafted, 1)))
            del plain_engine
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"| model | dtype | proposer | k | identical ({args.new_tokens} tok) | first divergence at | acceptance |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dtype']} | {r['proposer']} | {r['k']} | {r['identical']}/{r['prompts']} | "
              f"{r['first_divergence'] or '-'} | {r['acceptance']:.2f} |")
    print(f"({time.time() - t0:.0f}s on {args.device}, torch {torch.__version__})")


if __name__ == "__main__":
    main()
