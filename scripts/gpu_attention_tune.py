"""Split-K decode attention: graph-timed (no Python launch cost) against SDPA, over kernel
parameters. Run on the lent GPU:  python3 scripts/gpu_attention_tune.py
Prints, per context and T, SDPA's time, the default configuration's, and the best found.
  python3 scripts/gpu_attention_tune.py [--contexts 512,4096] [--tokens 1,4]"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from gpu_timing import graph_time_us

from verispec.kernels.decode_attention import decode_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="4096,16384,131072")
    parser.add_argument("--tokens", default="1,3", help="query tokens a pass (1: decode, 4: a 3-draft verify)")
    parser.add_argument("--configs", default=None,
                        help="SPLITSxBLOCK_NxWARPSxSTAGES,... to time (each printed) instead of the sweep")
    args = parser.parse_args()
    hq, hkv, d = 32, 8, 128
    print("| context | T | SDPA us | split-K default us | best us | best (splits, block_n, warps, stages) | SDPA / best |")
    print("|---|---|---|---|---|---|---|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        k = torch.randn(1, hkv, ctx + 16, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for t in (int(t) for t in args.tokens.split(",")):
            q = torch.randn(1, hq, t, d, device="cuda", dtype=torch.bfloat16)
            pos = torch.arange(ctx - t, ctx, device="cuda")[None]
            mask = None
            if t > 1:
                mask = (torch.arange(ctx, device="cuda")[None, :] <= pos[0, :, None])[None, None]
            sdpa = graph_time_us(lambda: F.scaled_dot_product_attention(
                q, k[:, :, :ctx], v[:, :, :ctx], attn_mask=mask, scale=d ** -0.5, enable_gqa=True))
            default = graph_time_us(lambda: decode_attention(q, k, v, pos, d ** -0.5))
            best, best_cfg = default, "default"
            configs = ([tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")] if args.configs
                       else itertools.product((4, 8, 16, 32, 64), (32, 64, 128), (4, 8), (2, 3)))
            for splits, block_n, warps, stages in configs:
                try:
                    us = graph_time_us(lambda: decode_attention(q, k, v, pos, d ** -0.5, num_splits=splits,
                                                                block_n=block_n, num_warps=warps, num_stages=stages))
                except Exception as exc:  # a configuration that does not fit (shared memory, registers)
                    if args.configs:  # one asked for by name says why it did not run
                        print(f"  {ctx} T={t} {splits}x{block_n}x{warps}x{stages}: {type(exc).__name__}: "
                              f"{str(exc)[:120]}", flush=True)
                    continue
                if args.configs:
                    print(f"  {ctx} T={t} {splits}x{block_n}x{warps}x{stages}: {us:.2f} us", flush=True)
                if us < best:
                    best, best_cfg = us, (splits, block_n, warps, stages)
            print(f"| {ctx} | {t} | {sdpa:.1f} | {default:.1f} | {best:.1f} | {best_cfg} | {sdpa / best:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
