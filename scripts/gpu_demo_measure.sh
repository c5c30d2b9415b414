#!/usr/bin/env bash
# On the lent GPU (device tool; carry .whl and build/demo-work/{build.json,corpus/heldout.json,corpus/stats.json}):
# the demo model's speculation measured (the build's `select` stage: plain, MTP depth 1-3, EAGLE3
# 1-4 drafts on the GPU build's held-out prompts) and `verispec serve`'s cold start and first-request
# latency with prewarm (`verispec bench --serve`). Results under $OUT.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/demo-work; rm -rf $W; mkdir -p $W/corpus
cp build/demo-work/build.json $W/ && cp build/demo-work/corpus/heldout.json build/demo-work/corpus/stats.json $W/corpus/ || exit 1
cp -r verispec/demo/model $W/model
timeout 420 python3 scripts/train_demo_model.py --work $W --out $W/out --stages select --force select --device cuda \
    --select-seconds 330 2>&1 | grep -E "select|default|error" | tail -12
cp $W/model/demo.json $OUT/demo-gpu.json; cp $W/select-partial.json $OUT/select-partial-gpu.json 2>/dev/null
timeout 150 python3 -m verispec bench "--serve=" "--serve=--no-spec" --contexts 512 --gen-tokens 128 --repeats 2 \
    --out "$OUT/serve" 2>&1 | grep -E "^\||ready|error" | head -10
