#!/usr/bin/env bash
# On the lent GPU: Qwen3-8B decode (`verispec bench`, batch 1, random weights) under each of
# scripts/gpu_fusion_bounds.py's patches, one process each. ROWS="QUANT:PATCH ..." (QUANT none for
# bf16); results (bench.json / bench.md per row) under $OUT/bounds-*.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROWS=${ROWS:-"none:base mlx-4bit:base mlx-4bit:small-pdl-off mlx-4bit:small-pdl-early mlx-4bit:no-norm mlx-4bit:no-combine"}
for row in $ROWS; do
    quant=${row%%:*}; patch=${row#*:}
    args=(--shape qwen3-8b --methods "${METHODS:-ar}" --contexts 512 --gen-tokens 128 --repeats 3)
    [ "$quant" != none ] && args+=(--quant "$quant")
    echo "## $quant $patch"
    timeout 400 python3 scripts/gpu_fusion_bounds.py "$patch" -- "${args[@]}" --out "$OUT/bounds-$quant-$patch" 2>&1 \
        | grep -E "^\||rror" | head -6
done
