"""A first data point (not `verispec bench`, which a later issue builds): eager batch-1 decode
speed of the current engine on a real model shape with random weights, against the bandwidth
roofline. Run on the lent GPU:  python3 scripts/gpu_quick_speed.py --shape qwen3-8b
"""
from __future__ import annotations

import argparse
import time

import torch

from verispec.config import EngineConfig
from verispec.engine.engine import Engine
from verispec.engine.params import SamplingParams
from verispec.loading.tokenizer import Tokenizer
from verispec.models.llama import LlamaForCausalLM

SHAPES = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False),
}


def random_model(config: dict, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def step_ms(engine: Engine, num_tokens: int, position: int, repeats: int = 50) -> float:
    """Median milliseconds of one graphed target step over num_tokens tokens at `position`."""
    step = engine._graphs.get(num_tokens)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(list(range(5, 5 + num_tokens)), position)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.29, help="measured copy bandwidth (TB/s)")
    args = ap.parse_args()
    config = SHAPES[args.shape]
    model = random_model(config, "cuda", torch.bfloat16)
    from tools.tiny import build_tokenizer
    import tempfile
    tok_dir = tempfile.mkdtemp()
    build_tokenizer(tok_dir)
    tokenizer = Tokenizer.from_dir(tok_dir)
    prompt = torch.randint(1000, 100000, (args.context,)).tolist()
    params = SamplingParams(max_tokens=args.gen_tokens, temperature=0, ignore_eos=True)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    kv_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2 * (args.context + args.gen_tokens // 2)
    roofline = args.bandwidth_tbs * 1e12 / (weight_bytes + kv_bytes)
    rows = []
    outputs = {}
    for mode in ("eager-sdpa", "eager-splitk", "graphs", "graphs+fused"):
        engine = Engine(model, tokenizer, EngineConfig(model=args.shape, max_model_len=8192,
                                                       cuda_graphs=mode.startswith("graphs"),
                                                       fuse_small_ops=mode == "graphs+fused"), proposer=None)
        if mode == "eager-sdpa":
            engine._cache = model.make_cache(args.context + args.gen_tokens)  # use_decode_kernel stays False
        t0 = time.perf_counter()
        engine.generate_all(prompt[:16], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # compile
        compile_s = time.perf_counter() - t0
        capture_s = engine.capture_graphs() + compile_s
        engine.generate_all(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
        rates, first = [], None
        for _ in range(3):
            r = engine.generate_all(prompt, params)
            rates.append(r.stats.decode_tok_per_s)
            first = first or r.token_ids
        outputs[mode] = first
        rate = sorted(rates)[1]
        rows.append((mode, rate, capture_s))
        del engine
    same = outputs["graphs"] == outputs["eager-splitk"]
    print(f"fused == unfused graphs output: {outputs['graphs+fused'] == outputs['graphs']}")
    print("| mode | decode tok/s (median of 3) | roofline tok/s | fraction | compile+capture s |")
    print("|---|---|---|---|---|")
    for mode, rate, cap in rows:
        print(f"| {mode} | {rate:.1f} | {roofline:.1f} | {rate / roofline:.1%} | {cap:.2f} |")
    print(f"graphs output == eager split-k output: {same}; == eager sdpa: {outputs['graphs'] == outputs['eager-sdpa']}")
    # verify-step cost: graphs for T = 1..5 at the same context
    engine = Engine(model, tokenizer, EngineConfig(model=args.shape, max_model_len=8192), proposer=_NullProposer(),
                    num_drafts=4)  # fused: the model was fused above
    engine.capture_graphs()
    cache = engine._cache
    cache.length = args.context
    base = step_ms(engine, 1, args.context)
    print("| step tokens | ms | ratio to T=1 |")
    print("|---|---|---|")
    for t in (1, 2, 3, 5):
        ms = step_ms(engine, t, args.context)
        print(f"| {t} | {ms:.3f} | {ms / base:.3f} |")
    print(f"(weights read per token {weight_bytes / 1e9:.2f} GB; torch {torch.__version__}; peak mem "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)")


class _NullProposer:
    method = "null"
    capture_layers = ()


if __name__ == "__main__":
    main()
