#!/usr/bin/env bash
# On the lent GPU (device tool, carry .whl): the batched engine checked and measured.
#   tests:    kernel tests on CUDA (paged split-K vs its torch reference, the rest) + the batch tests
#   identity: batch == alone with CUDA graphs (scripts/gpu_batch_identity.py)
#   bench8:   qwen3-8b shape, 512-token prompts, 128 tokens: --concurrency 1,8,32,64 plain
#   spec8:    qwen3-8b + random EAGLE3 of the real shape, k=3, at 1 and 8 sequences (verify/decode)
#   demo:     the demo model served over HTTP to 1 and 8 clients
#   demoproc: the demo model over HTTP, engine in its own process (--engine-process) vs one process,
#             with its MTP head and without speculation
# Results under $OUT; a short table last.
set -uo pipefail
STAGES=${STAGES:-tests,identity,bench8,spec8}
source "$(dirname "$0")/gpu_common.sh"
if has tests; then
  timeout 300 python3 -m pytest -o addopts="" -q -x tests/kernels/test_decode_attention.py tests/kernels/test_quant_matmul.py tests/engine 2>&1 | tail -4
fi
if has identity; then
  timeout 300 python3 scripts/gpu_batch_identity.py --out "$OUT" 2>&1 | grep -vE "Loading|Writing" | tail -12
fi
if has bench8; then
  timeout 400 python3 -m verispec bench --shape qwen3-8b --methods ar --contexts 512 --gen-tokens 128 --repeats 1 \
      --concurrency ${CONC:-1,8,32,64} --out "$OUT/q8batch" 2>&1 | grep -E "^\||error|Error|round ms" | head -16
fi
if has spec8; then
  timeout 300 python3 -m verispec bench --shape qwen3-8b --methods ar,eagle3 --draft-block 3 --contexts 512 \
      --gen-tokens 64 --repeats 1 --step-iters 10 --concurrency 1,8 --out "$OUT/q8spec" 2>&1 | grep -E "^\||error|Error" | head -8
fi
if has demo; then
  timeout 400 python3 -m verispec bench "--serve=" "--serve=--no-spec" --contexts 512 --gen-tokens 256 --repeats 1 \
      --concurrency 1,8 --out "$OUT/demo_http" 2>&1 | grep -E "^\||error|Error" | head -8
fi
if has demoproc; then
  timeout 500 python3 -m verispec bench "--serve=--demo --engine-process" "--serve=--demo" \
      "--serve=--demo --no-spec --engine-process" "--serve=--demo --no-spec" --contexts 512 --gen-tokens 256 --repeats 1 \
      --concurrency 1,8 --out "$OUT/demo_proc" 2>&1 | grep -E "^\||error|Error" | head -14
fi
