#!/usr/bin/env python3
"""On the CPU: torch's built-in int4 product (`torch._weight_int4pack_mm_for_cpu`, bfloat16
activations, group 32 as in GGUF Q4_1) against float16 / float32 `F.linear`, on SmolLM2-135M's
layer shapes (merged qkv, gate_up, down, lm_head) at 1 and 3 rows (decode and a 2-draft verify).
Median of 5 runs of 100 calls each, microseconds per call. This is what the default model could
gain from keeping its Q4_1 weights quantized on a CPU (#15); the GGUF loader dequantizes them today.

  python scripts/cpu_int4_linear.py [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [("qkv", 960, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]


def median_us(fn, calls: int = 100) -> float:
    for _ in range(10):
        fn()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(runs)[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(parser.parse_args().threads)
    torch.manual_seed(0)
    print("| layer | rows | int4 (bf16 activations) us | float16 F.linear us | float32 F.linear us |")
    print("|---|---|---|---|---|")
    for name, n, k in SHAPES:
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 2)
        scale_zero = torch.stack([torch.rand(n, k // 32) * 0.01, torch.randn(n, k // 32) * 0.01], -1)
        scale_zero = scale_zero.transpose(0, 1).contiguous().bfloat16()
        w16 = torch.randn(n, k).half()
        w32 = w16.float()
        for rows in (1, 3):
            xb = torch.randn(rows, k).bfloat16()
            x16, x32 = xb.half(), xb.float()
            int4 = median_us(lambda: torch._weight_int4pack_mm_for_cpu(xb, packed, 32, scale_zero))
            print(f"| {name} | {rows} | {int4:.0f} | {median_us(lambda: F.linear(x16, w16)):.0f} | "
                  f"{median_us(lambda: F.linear(x32, w32)):.0f} |")


if __name__ == "__main__":
    main()
