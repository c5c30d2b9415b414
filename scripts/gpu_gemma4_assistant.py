"""The Gemma 4 assistant drafter on one device: the split-K kernel path against SDPA, speculative
vs plain greedy with CUDA graphs, and the per-round draft cost with and without --assistant-window.

Run on the lent GPU:  python3 scripts/gpu_gemma4_assistant.py --device cuda --out $OUT/assistant.json
Random weights (no checkpoints on the machine), a Gemma 4 target of toy width with a 128-token
sliding window and contexts up to 3K, so the window and the key bound both matter. float32: the
outputs must be identical; the kernel and SDPA drafter logits should agree to ~1e-5.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tools.tiny import build_tiny_gemma4, build_tiny_gemma4_assistant, build_tokenizer
from verispec.engine.engine import Engine, load_engine
from verispec.engine.params import SamplingParams
from verispec.spec.gemma4_assistant import AssistantProposer, load_assistant
from verispec.spec.proposer import TargetStep

TARGET = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
              global_head_dim=64, num_global_key_value_heads=2, sliding_window=128, max_position_embeddings=8192)


def divergence(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    root = Path(tempfile.mkdtemp())
    build_tokenizer(root / "tok")
    build_tiny_gemma4(root / "target", seed=1, tokenizer_dir=root / "tok", **TARGET)
    build_tiny_gemma4_assistant(root / "assistant", json.loads((root / "target" / "config.json").read_text()),
                                seed=2, hidden_size=128)
    device = torch.device(args.device)
    plain_engine = load_engine(str(root / "target"), dtype="float32", device=args.device)
    model = plain_engine.model
    drafter = load_assistant(root / "assistant", model)
    gen = torch.Generator().manual_seed(0)
    vocab = plain_engine.num_real_tokens
    report: dict = {"kernel_vs_sdpa": [], "identity": [], "draft_ms": []}

    # 1. the drafter's attention: split-K kernel (in place, bounded by the key position) vs SDPA
    for context in (50, 700, 3000):
        ids = torch.randint(0, vocab, (1, context), generator=gen).to(device)
        cache = model.make_cache(context + 8)
        with torch.inference_mode():
            hidden = model(ids, torch.arange(context, device=device)[None], cache).hidden
            cache.commit(context)
            inputs = torch.cat((model.embed(ids[:, -1:]), hidden[:, -2:-1]), -1)
            rope = torch.tensor([[context - 1]], device=device)
            last = torch.tensor([[context - 2]], device=device)
            for window in (None, 16):
                out = {}
                for kernel in (False, True):
                    cache.use_decode_kernel = kernel
                    out[kernel] = drafter(inputs, rope, last, context - 1, cache, window)[1].float()
                report["kernel_vs_sdpa"].append(dict(context=context, window=window,
                                                     max_abs_diff=float((out[True] - out[False]).abs().max())))

    # 2. speculative == plain greedy, CUDA graphs on
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (40, 600, 3000)]
    plain_engine.capture_graphs()
    plain = [plain_engine.generate_all(p, params).token_ids for p in prompts]
    for k in (1, 2, 3):
        for window in (None, 16):
            eng = Engine(model, plain_engine.tokenizer, plain_engine.config,
                         proposer=AssistantProposer(drafter, model, vocab, window), num_drafts=k)
            eng.capture_graphs()
            divs, drafted, accepted = [], 0, 0
            for p, cont in zip(prompts, plain):
                r = eng.generate_all(p, params)
                divs.append(divergence(cont, r.token_ids))
                drafted += r.stats.drafted
                accepted += r.stats.accepted
            report["identity"].append(dict(k=k, window=window, identical=sum(d is None for d in divs),
                                           prompts=len(prompts), first_divergence=[d for d in divs if d is not None],
                                           acceptance=accepted / max(drafted, 1)))

    # 3. one round of 2 drafts at a given context, window off / 16 (eager, after a warm-up)
    for context in (1000, 6000):
        ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
        cache = model.make_cache(context + 8)
        cache.use_decode_kernel = device.type == "cuda"
        with torch.inference_mode():
            hidden = model(torch.tensor([ids], device=device), torch.arange(context, device=device)[None], cache).hidden[0]
        cache.commit(context)
        for window in (None, 16):
            prop = AssistantProposer(drafter, model, vocab, window)
            prop.attach_target_cache(cache)
            prop.observe(TargetStep(ids, 0, hidden, [], ids[-1]))
            times = []
            for i in range(25):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                prop.propose(2, params, None)  # ends with a host sync (the draft ids)
                if i >= 5:
                    times.append((time.perf_counter() - t) * 1000)
            report["draft_ms"].append(dict(context=context, window=window, ms=statistics.median(times)))

    report["seconds"], report["device"], report["torch"] = time.time() - t0, args.device, torch.__version__
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
