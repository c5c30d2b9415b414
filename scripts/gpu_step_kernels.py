#!/usr/bin/env python3
"""Where a batch-1 decode step's device time goes, kernel by kernel (#14: what besides the weight
products a 4-bit step pays). For each --quant (none = bf16): random weights of --shape, the
engine as `verispec bench` builds it (CUDA graphs), a 512-token prompt, then torch.profiler over
--steps decode steps (the prompt's prefill before the profile starts; a step or so may slip out of
the window, as the engine's worker runs ahead of the consumer): the kernels' device time per step by
group (weight products, attention, the fused small ops, copies) and by name.

  python3 scripts/gpu_step_kernels.py --shape qwen3-8b --quant none,mlx-4bit
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

GROUPS = (  # first match wins: (group, substrings of the kernel name)
    ("quantized product (Gluon: mma, GEMV)", ("_mma_kernel", "_gemv_kernel")),
    ("4-bit product (tinygemm)", ("int4", "tinygemm")),
    ("quantized product (Triton)", ("dequant", "quant_matmul")),
    ("bf16 product (cuBLAS)", ("gemv", "gemm", "nvjet", "cutlass", "sm90_xmma", "splitkreduce")),
    ("attention (split-K)", ("decode_attention", "split_k", "_attn", "flash")),
    ("recurrent", ("gated_delta", "recurrent", "chunk_")),
    ("fused small ops (inductor)", ("triton_",)),
    ("copies / fills", ("copy", "fill", "memcpy", "memset", "index")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def main() -> None:
    from verispec.bench.offline import _capture_graphs, _engine, _prompt, setup_target
    from verispec.bench.options import BenchOptions, Method
    from verispec.engine.params import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--quant", default="none,mlx-4bit")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args()
    for quant in args.quant.split(","):
        opts = BenchOptions(shape=args.shape, quant=None if quant == "none" else quant, contexts=(512,),
                            gen_tokens=args.steps, repeats=1)
        setup = setup_target(opts)
        engine, _ = _engine(setup, Method.AR)
        graphs = _capture_graphs(engine)
        prompt = _prompt(setup, 512, 0)
        params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
        engine.generate_all(prompt, params)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate_all(_prompt(setup, 512, 1), params)
        wall_ms = (time.perf_counter() - t0) * 1000
        chunks = engine.generate(_prompt(setup, 512, 2), params)
        next(chunks)  # the prompt's chunk: prefill is done, the profile holds decode steps only
        torch.cuda.synchronize()
        steps = 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in chunks:
                steps += 1
            torch.cuda.synchronize()
        by_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                entry = by_name[event.name]
                entry[0] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
                entry[1] += 1
        total_us = sum(v[0] for v in by_name.values())
        groups: dict[str, float] = collections.defaultdict(float)
        for name, (us, _) in by_name.items():
            groups[group_of(name)] += us
        print(f"\n== {args.shape} {quant}: graphs {graphs}; wall {wall_ms:.1f} ms for prefill + {args.steps} steps; "
              f"profiled {steps} decode steps: kernels {total_us / steps:.0f} us per step", flush=True)
        for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {group:30s} {us / steps:8.0f} us/step  {100 * us / total_us:5.1f}%")
        print("  top kernels (us per step, calls per step):")
        for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"    {us / steps:8.1f}  {n / steps:5.1f}  {name[:110]}")
        del engine, setup
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
