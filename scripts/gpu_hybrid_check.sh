#!/usr/bin/env bash
# On the lent GPU (device tool, carry .whl): the hybrid (Qwen3.5/3.6) graph path checked and measured.
#   1. kernel / fused-op / in-place tests on CUDA (GDN recurrent kernel vs torch, split-K, rewrites)
#   2. speculative == plain and graphed == eager on CUDA (scripts/gpu_spec_identity_families.py)
#   3. verispec bench: qwen3.6-27b ar + mtp (random head: cost rows), qwen3-8b ar (regression check)
# Results under $OUT; a short table last.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-tests,identity,bench27,bench8}
FAMILIES=${FAMILIES:-qwen3_5,gemma4}
TESTS=${TESTS:-tests/kernels tests/unit/test_fused_ops.py tests/unit/test_inplace_attention.py}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
if has tests; then
  timeout 240 python3 -m pytest -o addopts="" -q -x $TESTS 2>&1 | tail -4
fi
if has identity; then
  timeout 240 python3 scripts/gpu_spec_identity_families.py --families "$FAMILIES" --new-tokens 96 --out "$OUT/families.json" 2>&1 | tail -16
fi
if has bench27; then
  timeout 300 python3 -m verispec bench --shape qwen3.6-27b --methods ar,mtp --draft-block 3 --contexts 512 \
      --gen-tokens 64 --repeats 2 --step-iters 10 --out "$OUT/q36" 2>&1 | grep -E "^\||error" | head -8
fi
if has bench26; then
  timeout 200 python3 -m verispec bench --shape gemma4-26b-a4b --methods ar --contexts 512 --gen-tokens 64 \
      --repeats 2 --out "$OUT/g26" 2>&1 | grep -E "^\||error" | head -6
fi
if has bench8; then
  timeout 200 python3 -m verispec bench --shape qwen3-8b --methods ar,eagle3 --draft-block 3 --contexts 512 \
      --gen-tokens 128 --repeats 3 --step-iters 20 --out "$OUT/q8" 2>&1 | grep -E "^\||error" | head -6
fi
if has serve; then  # the embedded demo model: cold start to ready and the first request's latency, with prewarm
  timeout 150 python3 -m verispec bench "--serve=" "--serve=--no-spec" --contexts 512 --gen-tokens 128 --repeats 2 \
      --out "$OUT/serve" 2>&1 | grep -E "^\||ready|error" | head -10
fi
