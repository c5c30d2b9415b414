#!/usr/bin/env bash
# On the lent GPU (device tool), one call: what a change to a kernel on a generated token's path
# must pass before it stays, in the order that stops early and cheaply. Results under $OUT.
#   tests    - the small-op and attention kernels' tests on CUDA (qk_prep, kv_write, split-K
#              attention, the tensor-core product; rms_norm when present)
#   identity - speculative == plain greedy: Llama and Qwen3, bf16 and MLX 4-bit, 4 prompts x 128
#              tokens, every proposer (16 configurations; 16/16 identical is the bar)
#   bench    - Qwen3-8B decode / verify against bf16 (scripts/gpu_quant_measure.sh, QWEN_ROWS rows)
#   steps    - a 4-bit step's device time by kernel (scripts/gpu_step_kernels.py)
# STAGES picks (default "tests identity bench"); a failing stage stops the ones after it.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests identity bench"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has tests; then
    tests=(tests/kernels/test_qk_prep.py tests/kernels/test_kv_write.py tests/kernels/test_decode_attention.py
           tests/kernels/test_quant_mma.py tests/kernels/test_quant_frag.py tests/kernels/test_attention_partition.py
           tests/kernels/test_stream_mlp.py)
    [ -f tests/kernels/test_rms_norm.py ] && tests+=(tests/kernels/test_rms_norm.py)
    echo "## tests"
    timeout 420 python3 -m pytest -q -p no:warnings -x "${tests[@]}" > "$OUT/tests.log" 2>&1 || { tail -20 "$OUT/tests.log"; exit 1; }
    tail -1 "$OUT/tests.log"
fi
if has identity; then
    echo "## identity"
    timeout 240 python3 scripts/gpu_spec_identity.py --quant none,mlx-4bit --models llama,qwen3 --dtypes bfloat16 \
        --new-tokens 128 --prompts 4 --out "$OUT/identity.json" > "$OUT/identity.log" 2>&1
    grep "^|\|s on\|capture failed" "$OUT/identity.log" | tail -18
    grep -q "| 4/4 |" "$OUT/identity.log" || exit 1
    if grep "^| " "$OUT/identity.log" | grep -v "4/4\|identical\|---" | grep -q .; then echo "identity: not 16/16"; exit 1; fi
fi
if has bench; then
    echo "## bench"
    QWEN_ROWS=${QWEN_ROWS:-"bf16 mlx-4bit mlx-8bit"} STAGES=qwen timeout 300 bash scripts/gpu_quant_measure.sh 2>&1 \
        | grep "^## \|^| ar\|^| eagle3"
fi
if has steps; then
    echo "## steps"
    timeout 150 python3 scripts/gpu_step_kernels.py --shape qwen3-8b --quant mlx-4bit --steps 32 --top 12 \
        > "$OUT/steps.log" 2>&1
    grep -A18 "^== " "$OUT/steps.log" | cut -c1-120
fi
