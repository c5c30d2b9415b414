"""Speculative vs plain greedy on CUDA for the Qwen3.5 hybrid (MTP head; flash-linear-attention
when installed) and Gemma 4 (EAGLE3, assistant), in float32 and bf16: identical, or where
they first diverge. Run on the lent GPU:
    python3 scripts/gpu_spec_identity_families.py --out $OUT/families.json
Random drafters are rarely accepted (rejection paths); the replay proposer (the plain output,
wrong at every 3rd slot) exercises partial acceptance and recurrent/cache rollback.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from verispec.config import EngineConfig
from tools.tiny import (build_tiny_gemma4, build_tiny_gemma4_assistant, build_tiny_qwen3_5, build_tokenizer,
                                corpus_text, random_mtp_head, write_mtp_sidecar, write_random_eagle3)  # noqa: E501
from verispec.engine.engine import Engine
from verispec.engine.params import SamplingParams
from verispec.spec.proposer import Draft, Proposer


class Replay(Proposer):
    method = "replay"

    def __init__(self, cont, vocab_size):
        self.cont, self.vocab_size = cont, vocab_size

    def reset(self, prompt_ids):
        self.n = len(prompt_ids)

    def observe(self, step):
        self.i = step.start_position + len(step.token_ids) - self.n + 1

    def propose(self, k, params, gen):
        out = []
        for j in range(k):
            t = self.cont[self.i + j] if self.i + j < len(self.cont) else 0
            out.append(t if (self.i + j) % 3 else (t + 1) % self.vocab_size)
        return Draft(out)


def divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_family(root: Path, family: str, dtype: str, new_tokens: int, prompts_text: list[str]) -> list[dict]:
    rows = []
    mdir = root / family
    if family == "qwen3_5":
        cases = [("mtp", dict(mtp=True, mtp_depth=1)), ("mtp", dict(mtp=True, mtp_depth=3))]
    else:
        cases = [("eagle3", dict(eagle3=str(root / "gemma4-eagle3"), draft_block=3)),
                 ("assistant", dict(mtp=True, mtp_model=str(root / "gemma4-assistant"), num_mtp_tokens=2))]
    base = Engine.load(EngineConfig(model=str(mdir), dtype=dtype, device="cuda", max_model_len=2048))
    base.capture_graphs()
    tok = base.tokenizer
    prompts = [tok.encode(t) for t in prompts_text]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    plain = [base.generate_all(p, params).token_ids for p in prompts]
    # the graphed plain decode against the eager one (same kernels, no graphs): recurrent state
    # handling under replay must not change a token
    eager = Engine.load(EngineConfig(model=str(mdir), dtype=dtype, device="cuda", max_model_len=2048,
                                     cuda_graphs=False))
    divs = [divergence(cont, eager.generate_all(p, params).token_ids) for p, cont in zip(prompts, plain)]
    rows.append(dict(family=family, dtype=dtype, proposer="none: eager vs CUDA graphs", k=0,
                     identical=sum(d is None for d in divs), prompts=len(prompts),
                     first_divergence=[d for d in divs if d is not None], acceptance=0.0))
    del eager
    for name, options in cases:
        spec = Engine.load(EngineConfig(model=str(mdir), dtype=dtype, device="cuda", max_model_len=2048, **options))
        spec.capture_graphs()
        divs, acc, drafted = [], 0, 0
        for p, cont in zip(prompts, plain):
            r = spec.generate_all(p, params)
            divs.append(divergence(cont, r.token_ids))
            acc, drafted = acc + r.stats.accepted, drafted + r.stats.drafted
        k = spec.num_drafts
        rows.append(dict(family=family, dtype=dtype, proposer=f"{name} (method {r.stats.method})", k=k,
                         identical=sum(d is None for d in divs), prompts=len(prompts),
                         first_divergence=[d for d in divs if d is not None], acceptance=acc / max(drafted, 1)))
        divs, acc, drafted = [], 0, 0
        for p, cont in zip(prompts, plain):
            replay = Engine(spec.model, tok, spec.config, proposer=Replay(cont, spec.model.vocab_size), num_drafts=4)
            replay.capture_graphs()
            r = replay.generate_all(p, params)
            divs.append(divergence(cont, r.token_ids))
            acc, drafted = acc + r.stats.accepted, drafted + r.stats.drafted
        rows.append(dict(family=family, dtype=dtype, proposer="replay (wrong every 3rd)", k=4,
                         identical=sum(d is None for d in divs), prompts=len(prompts),
                         first_divergence=[d for d in divs if d is not None], acceptance=acc / max(drafted, 1)))
        del spec
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--families", default="qwen3_5,gemma4", help="comma-separated subset of qwen3_5,gemma4")
    args = ap.parse_args()
    t0 = time.time()
    root = Path(tempfile.mkdtemp())
    build_tokenizer(root / "tok")
    qwen = build_tiny_qwen3_5(root / "qwen3_5", tokenizer_dir=root / "tok")
    write_mtp_sidecar(root / "qwen3_5" / "mtp.safetensors", random_mtp_head(qwen.config.to_dict()))
    gemma = build_tiny_gemma4(root / "gemma4", tokenizer_dir=root / "tok")
    gemma_cfg = json.loads((root / "gemma4" / "config.json").read_text())
    write_random_eagle3(root / "gemma4-eagle3", gemma_cfg, aux_layer_ids=[1, 2, 3])
    build_tiny_gemma4_assistant(root / "gemma4-assistant", gemma_cfg)
    text = corpus_text()
    prompts = [text[i * 1500: i * 1500 + 300] for i in range(3)]
    rows = []
    for family in args.families.split(","):
        for dtype in ("float32", "bfloat16"):
            rows += run_family(root, family, dtype, args.new_tokens, prompts)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"| family | dtype | proposer | k | identical ({args.new_tokens} tok) | first divergence at | acceptance |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['dtype']} | {r['proposer']} | {r['k']} | {r['identical']}/{r['prompts']} | "
              f"{r['first_divergence'] or '-'} | {r['acceptance']:.2f} |")
    print(f"({time.time() - t0:.0f}s, torch {torch.__version__})")


if __name__ == "__main__":
    main()
