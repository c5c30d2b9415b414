#!/usr/bin/env python3
"""Prefill attention backends on the GPU (efficient attention takes no grouped K/V heads: our
sdpa() expands them): first-call and steady time of torch's SDPA with a
boolean mask (the paged prefill path: queries at the end of the keys) per backend, at shapes a
server meets (a new prompt length is a new shape). cuDNN's backend builds an execution plan per
shape; the first call of each shape pays for it.

  python3 scripts/gpu_sdpa_backends.py [--heads 32 --kv-heads 8 --head-dim 128]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, iters: int = 10) -> tuple[float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return first * 1000, (time.perf_counter() - t0) / iters * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    shapes = [(512, 512), (517, 517), (24, 520), (31, 541), (2048, 2048), (16, 16384), (16384, 16384)]
    from verispec.models.layers.attention import sdpa

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "verispec sdpa (efficient, K/V heads expanded)": None}
    print("| queries | keys | backend | first call ms | steady ms |\n|---|---|---|---|---|")
    for t, s in shapes:
        q = torch.randn(1, args.heads, t, args.head_dim, device=dev, dtype=dt)
        k = torch.randn(1, args.kv_heads, s, args.head_dim, device=dev, dtype=dt)
        v = torch.randn_like(k)
        mask = (torch.arange(s, device=dev)[None, :] <= torch.arange(s - t, s, device=dev)[:, None])[None, None]
        for name, backend in backends.items():
            causal_only = name == "flash"  # flash takes no mask: is_causal, right only when t == s
            if causal_only and t != s:
                continue

            def call():
                if backend is None:
                    return sdpa(q, k, v, mask, args.head_dim ** -0.5)
                with sdpa_kernel([backend]):
                    if causal_only:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            try:
                first, steady = timed(call)
                print(f"| {t} | {s} | {name} | {first:.1f} | {steady:.3f} |", flush=True)
            except RuntimeError as exc:
                print(f"| {t} | {s} | {name} | unavailable: {str(exc).splitlines()[0][:80]} | |", flush=True)


if __name__ == "__main__":
    main()
