#!/usr/bin/env bash
# On a GPU: quantized decode speed side by side, batch 1, random weights quantized on the device
# (`verispec bench --quant`). Results (bench.json / bench.md per run) under $OUT. STAGES picks what
# runs (default "qwen large"):
#   qwen  - Qwen3-8B: bf16, MLX 8-bit, MLX 4-bit (each layer on the kernel quant/dispatch.py binds),
#           each plain and with a random 3-draft EAGLE3 (verify_decode_ratio: the cost of a 4-token
#           verify pass); QWEN_ROWS picks rows by name (default all)
#   large - Gemma 4 26B-A4B (MoE: quantized experts), Gemma 4 31B dense and Qwen3.6-27B hybrid:
#           bf16 against 8-bit and 4-bit, plain decode
set -uo pipefail
usage() {  # the comment block above, as the usage text
    echo "usage: [STAGES='qwen large'] [QWEN_ROWS=...] [LARGE=...] [QUANTS=...] bash scripts/gpu_quant_measure.sh"
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
}
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-"qwen large"}
LARGE=${LARGE:-"gemma4-26b-a4b gemma4-31b qwen3.6-27b"}  # the large stage's shapes
QUANTS=${QUANTS:-"none mlx-8bit mlx-4bit"}  # and their weights
QWEN_ROWS=${QWEN_ROWS:-"bf16 mlx-8bit mlx-4bit"}
run() {  # run NAME [env assignments...] -- bench args...
    local name=$1; shift
    if [[ $name == qwen3-8b-* && " $QWEN_ROWS " != *" ${name#qwen3-8b-} "* ]]; then return; fi
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    echo "## $name"
    env "${envs[@]}" timeout 400 python3 -m verispec bench "$@" --out "$OUT/$name" 2>&1 | grep -E "^\||rror" | head -8
}
common=(--contexts 512 --gen-tokens 128 --repeats 3)
if [[ " $STAGES " == *" qwen "* ]]; then
    spec=(--shape qwen3-8b --methods ar,eagle3 --num-draft-tokens 3 "${common[@]}")
    run qwen3-8b-bf16 -- "${spec[@]}"
    run qwen3-8b-mlx-8bit -- "${spec[@]}" --quant mlx-8bit
    run qwen3-8b-mlx-4bit -- "${spec[@]}" --quant mlx-4bit
fi
if [[ " $STAGES " == *" large "* ]]; then
    for shape in $LARGE; do
        for quant in $QUANTS; do
            args=(--shape "$shape" --methods ar "${common[@]}")
            [ "$quant" != none ] && args+=(--quant "$quant")
            run "$shape-$quant" -- "${args[@]}"
        done
    done
fi
