#!/usr/bin/env python3
"""The 8-bit GEMV (kernels/gemv_int8.py) on the GPU (#14): correctness against the float64
reference and row-invariance, then one Qwen3-8B decode step's quantized layers (merged qkv, o,
merged gate_up, down x 36, lm_head x 1; MLX affine 8-bit, group 64, bf16 activations) timed under
CUDA graphs for a sweep of its configurations, against the tensor-core kernel
(kernels/quant_matmul.py, what 8-bit runs today) and a bf16 F.linear of the same shapes.

  python3 scripts/gpu_gemv_int8.py [--rows 1,4,8]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import graph_time_us  # noqa: E402
from verispec.kernels import gemv_int8, quant_matmul  # noqa: E402
from verispec.quant.packing import pack_rows  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 4096, 12288, 151936, 36
SHAPES = {"qkv": (6144, HIDDEN, LAYERS), "o": (HIDDEN, HIDDEN, LAYERS), "gate_up": (2 * INTER, HIDDEN, LAYERS),
          "down": (HIDDEN, INTER, LAYERS), "lm_head": (VOCAB, HIDDEN, 1)}
GROUP = 64


def operands(n: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=gen, device="cuda", dtype=torch.int32)
    packed = pack_rows(q, 8)
    scales = (torch.rand(n, k // GROUP, generator=gen, device="cuda") * 0.01).to(torch.bfloat16)
    biases = (torch.randn(n, k // GROUP, generator=gen, device="cuda") * 0.01).to(torch.bfloat16)
    return packed, scales, biases


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,4,8")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]

    # correctness and row-invariance on the GPU
    packed, scales, biases = operands(1000, 4096, 0)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    ref = quant_matmul.dequant_matmul_reference(x.double(), packed, scales, biases, 8, GROUP)
    wide = gemv_int8.gemv_int8(x, packed, scales, biases, GROUP)
    err = float((wide.double() - ref).norm() / ref.norm())
    same = all(torch.equal(gemv_int8.gemv_int8(x[r:r + 1], packed, scales, biases, GROUP)[0], wide[r]) for r in range(8))
    old = quant_matmul.dequant_matmul(x, packed, scales, biases, 8, GROUP)
    old_err = float((old.double() - ref).norm() / ref.norm())
    print(f"gemv vs float64 reference: relative {err:.2e} (tensor-core kernel {old_err:.2e}); "
          f"rows of 8 == each row alone, bitwise: {same}", flush=True)

    configs = [gemv_int8.GemvConfig(bn, bk, w, st) for bn, bk, w, st in
               itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (2,))]
    for m in rows:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        xi = torch.randn(m, INTER, device="cuda", dtype=torch.bfloat16)
        best: dict[str, tuple[float, gemv_int8.GemvConfig]] = {}
        per_config: dict[gemv_int8.GemvConfig, float] = {c: 0.0 for c in configs}
        base, dense = 0.0, 0.0
        for name, (n, k, count) in SHAPES.items():
            packed, scales, biases = operands(n, k, 1)
            inp = xi if k == INTER else x
            w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            t_old = graph_time_us(lambda: quant_matmul.dequant_matmul(inp, packed, scales, biases, 8, GROUP))
            t_dense = graph_time_us(lambda: F.linear(inp, w16))
            base += t_old * count
            dense += t_dense * count
            for cfg in configs:
                try:
                    t = graph_time_us(lambda: gemv_int8.gemv_int8(inp, packed, scales, biases, GROUP, cfg=cfg))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile (registers)
                    print(f"  {name} {cfg}: {type(exc).__name__}", flush=True)
                    t = float("inf")
                per_config[cfg] += t * count
                if name not in best or t < best[name][0]:
                    best[name] = (t, cfg)
            gbs = n * k * (1 + 4 / GROUP) / (best[name][0] * 1e-6) / 1e9
            print(f"M={m} {name:8s} [{n}x{k}]: gemv best {best[name][0]:8.1f} us ({gbs:6.0f} GB/s) {best[name][1]}; "
                  f"tensor-core kernel {t_old:8.1f}; bf16 F.linear {t_dense:8.1f}", flush=True)
            del packed, scales, biases, w16
        top = min(per_config, key=per_config.get)
        per_shape = sum(best[name][0] * SHAPES[name][2] for name in SHAPES)
        print(f"M={m} one decode step's quantized layers: gemv {per_config[top]:.0f} us with one config {top}, "
              f"{per_shape:.0f} us with the best per shape; tensor-core kernel {base:.0f} us; bf16 {dense:.0f} us",
              flush=True)


if __name__ == "__main__":
    main()
