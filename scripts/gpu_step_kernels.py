#!/usr/bin/env python3
"""Where a batch-1 decode step's device time goes, kernel by kernel (#14: what besides the weight
products a 4-bit step pays). For each --quant (none = bf16): random weights of --shape, the
engine as `verispec bench` builds it (CUDA graphs), a 512-token prompt, then torch.profiler over
--steps decode steps (the prompt's prefill before the profile starts; the steps are counted by
the attention kernel's calls, as the engine's worker runs ahead of the consumer and the window
cuts steps at both ends): the kernels' device time per step by group (weight products, attention,
the fused small ops, copies) and by name; with --timeline also the device's idle time between
kernels and which kernels it comes before.

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
    from verispec.sampling.params import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--quant", default="none,mlx-4bit")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--timeline", action="store_true",
                   help="also the gaps: per kernel name, its mean duration and the idle time before it")
    p.add_argument("--passes", default="",
                   help="instead of generating: profile the runner's passes of these widths (e.g. 1,4: a decode "
                        "step and a 4-token verify pass, as `verispec bench` times verify / decode), each by "
                        "the critical path its kernels make")
    args = p.parse_args()
    if args.passes:
        for quant in args.quant.split(","):
            profile_passes(args, None if quant == "none" else quant, [int(w) for w in args.passes.split(",")])
        return
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
        # the chunks the consumer saw are not the steps the profile holds (the engine's worker runs
        # ahead, and the window cuts steps at both ends): count them by the attention kernel, which
        # runs once per layer per step
        layers = getattr(engine.model, "num_layers", 0)  # (a hybrid model has fewer attention layers)
        per_layer = [n for name, (_, n) in by_name.items() if "_split_kernel" in name or "_qk_prep" in name]
        if per_layer and layers:
            steps = max(per_layer) / layers
        total_us = sum(v[0] for v in by_name.values())
        groups: dict[str, float] = collections.defaultdict(float)
        for name, (us, _) in by_name.items():
            groups[group_of(name)] += us
        print(f"\n== {args.shape} {quant}: graphs {graphs}; wall {wall_ms:.1f} ms for prefill + {args.steps} steps; "
              f"profiled {steps:.1f} decode steps: kernels {total_us / steps:.0f} us per step", flush=True)
        for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {group:30s} {us / steps:8.0f} us/step  {100 * us / total_us:5.1f}%")
        print("  top kernels (us per step, calls per step):")
        for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"    {us / steps:8.1f}  {n / steps:5.1f}  {name[:110]}")
        if args.timeline:
            print_timeline(prof, steps, args.top)
        del engine, setup
        torch.cuda.empty_cache()


def profile_passes(args, quant: str | None, widths: list[int]) -> None:
    """The runner's pass of each width over one 512-token sequence (an EAGLE3 engine with random
    drafter weights, so passes of up to draft_block + 1 tokens run as captured graphs), repeated
    --steps times under the profiler."""
    from verispec.bench.offline import _capture_graphs, _engine, _prompt, setup_target
    from verispec.bench.options import BenchOptions, Method
    from verispec.bench.steps import prefilled_sequence

    opts = BenchOptions(shape=args.shape, quant=quant, contexts=(512,), gen_tokens=16, repeats=1,
                        draft_block=max(widths) - 1)
    setup = setup_target(opts)
    engine, _ = _engine(setup, Method.EAGLE3)
    graphs = _capture_graphs(engine)
    seq = prefilled_sequence(engine, _prompt(setup, 512, 0), engine.num_drafts)
    try:
        for width in widths:
            tokens = [[seq.token_ids[-1]] * width]
            capture = engine.proposer.capture_layers if width > 1 else ()  # as the bench's verify step
            for _ in range(5):
                engine.runner.verify([seq], tokens, capture).logits.argmax(-1).tolist()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    engine.runner.verify([seq], tokens, capture).logits.argmax(-1).tolist()
                torch.cuda.synchronize()
            print(f"\n== {args.shape} {quant or 'bf16'}: a {width}-token pass (graphs {graphs}), {args.steps} passes")
            print_timeline(prof, args.steps, args.top)
    finally:
        engine.scheduler.release(seq)


def print_timeline(prof, steps: float, top: int) -> None:
    """Kernels in device order: the span they cover, the device's idle time between them (a gap is
    the next kernel's start minus the latest end so far; a programmatic launch can make it
    negative), and which kernels the idle time comes before."""
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    if not kernels:
        return
    span = kernels[-1][1] - kernels[0][0]
    busy_end = kernels[0][1]
    idle = 0.0
    overlap = 0.0
    before: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, 0.0])
    pairs: dict[tuple, list] = collections.defaultdict(lambda: [0.0, 0])
    # the critical path's share: how far each kernel moves the latest end so far (what the step
    # would lose if the kernel took no time, as long as the others kept their order)
    advances: dict[str, float] = collections.defaultdict(float)
    advances_after: dict[tuple, float] = collections.defaultdict(float)  # the same by the kernel before
    previous = kernels[0][2]
    for start, end, name in kernels[1:]:
        gap = start - busy_end
        entry = before[name]
        entry[0] += gap
        entry[1] += 1
        entry[2] += end - start
        key = (previous[:40], name[:40])
        pair = pairs[key]
        pair[0] += gap
        pair[1] += 1
        if gap > 0:
            idle += gap
        else:
            overlap -= gap
        advance = max(0.0, end - max(busy_end, start))
        advances[name] += advance
        advances_after[key] += advance
        busy_end = max(busy_end, end)
        previous = name
    print(f"  timeline: span {span / steps:.0f} us/step, idle {idle / steps:.0f} us/step, "
          f"overlapped {overlap / steps:.0f} us/step, {len(kernels) / steps:.1f} kernels/step")
    print("  critical path by kernel (us per step the kernel moves the latest end, idle excluded):")
    for name, us in sorted(advances.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {us / steps:8.1f}  {name[:100]}")
    print("  critical path by (previous kernel -> kernel) (us per step; tells a layer's products apart):")
    for (a, b), us in sorted(advances_after.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {us / steps:8.1f}  {a} -> {b}")
    print("  idle before (us per step, calls per step, mean gap us, mean duration us):")
    for name, (gap, n, dur) in sorted(before.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {gap / steps:8.1f}  {n / steps:5.1f}  {gap / n:6.2f}  {dur / n:7.2f}  {name[:90]}")
    print("  idle by (previous kernel -> kernel) (us per step, mean gap us):")
    for (a, b), (gap, n) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {gap / steps:8.1f}  {gap / n:6.2f}  {a} -> {b}")


if __name__ == "__main__":
    main()
