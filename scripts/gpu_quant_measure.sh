#!/usr/bin/env bash
# On the lent GPU (device tool): the quantized-weight kernel and layers checked on CUDA, then the
# issue #14 speed targets measured side by side in one session (Qwen3-8B shape, batch 1): bf16,
# MLX 8-bit and 4-bit decode, each with its bytes-per-token roofline, and the verify cost of 4
# tokens (eagle3 rows: verify_decode_ratio). Results (bench.json / bench.md per run) under $OUT.
# Needs the test extra's triton on the GPU image; mlx / compressed-tensors tests skip there if absent.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 300 python3 -m pytest tests/kernels/test_quant_matmul.py -q -x 2>&1 | tail -3
for quant in none mlx-8bit mlx-4bit; do
    args=(--shape qwen3-8b --methods ar,eagle3 --draft-block 3 --contexts 512 --gen-tokens 128 --repeats 3)
    [ "$quant" != none ] && args+=(--quant "$quant")
    timeout 600 python3 -m verispec bench "${args[@]}" --out "$OUT/qwen3-8b-$quant" 2>&1 | grep -E "^\||error" | head -8
done
