"""Decode attention at long context: the split-K Triton kernel vs torch SDPA, one layer's
attention for one query token (and a k+1 = 3 verify step), Qwen3-8B head layout (32 q heads,
8 kv heads, head dim 128), bf16, reading a KV cache of the given length.

Run on the lent GPU:  python3 scripts/gpu_attention_bench.py --contexts 4096,16384,32768,131072
Reports microseconds (median, CUDA events), achieved KV bandwidth, and SDPA / split-K time.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from verispec.kernels.decode_attention import decode_attention


def time_us(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,16384,32768,131072")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    print("| context | T | split-K us | SDPA us | SDPA / split-K | split-K KV GB/s |")
    print("|---|---|---|---|---|---|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        cap = ctx + 16
        k = torch.randn(1, args.hkv, cap, args.head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for t in (1, 3):
            q = torch.randn(1, args.hq, t, args.head_dim, device="cuda", dtype=torch.bfloat16)
            pos = torch.arange(ctx - t, ctx, device="cuda")[None]
            scale = args.head_dim ** -0.5
            mask = None
            if t > 1:
                key_pos = torch.arange(ctx, device="cuda")
                mask = (key_pos[None, :] <= pos[0, :, None])[None, None]
            kernel_us = time_us(lambda: decode_attention(q, k, v, pos, scale))
            sdpa_us = time_us(lambda: F.scaled_dot_product_attention(
                q, k[:, :, :ctx], v[:, :, :ctx], attn_mask=mask, scale=scale, enable_gqa=True))
            kv_bytes = 2 * args.hkv * ctx * args.head_dim * 2
            print(f"| {ctx} | {t} | {kernel_us:.1f} | {sdpa_us:.1f} | {sdpa_us / kernel_us:.2f}x | "
                  f"{kv_bytes / kernel_us / 1e3:.0f} |")


if __name__ == "__main__":
    main()
