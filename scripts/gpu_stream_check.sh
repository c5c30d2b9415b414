#!/usr/bin/env bash
# On the lent GPU (device tool), one call: the persistent streaming kernel of verispec/kernels/stream_chain.py
# as it stands (docs/gpu.md, the twentieth session's next steps). Results under $OUT.
#   chain - gate_up -> down and o -> gate_up -> down against the launches, 1 and 4 rows (same bits
#           as frag_gemv with the same tiles, a row alone == the same row among 4)
#   norm  - o -> add + RMSNorm -> gate_up -> down, the norm inside (the new residual's bits, the
#           output against the launched products around a torch norm, a row alone) against o + the
#           engine's add + RMSNorm kernel + gate_up + down
#   bounds - the copies alone and the arithmetic alone (--mode 0, 2)
# STAGES picks (comma-separated, default "chain,norm"); every stage prints one JSON line a configuration.
STAGES=${STAGES:-chain,norm}
source scripts/gpu_common.sh
run() { timeout 240 python3 scripts/gpu_stream_chain.py --slots "${SLOTS:-2,3}" "$@" 2>&1 | grep "^{" ; }
if has chain; then
    echo "## chain"; run --chain mlp,layer --rows 1,4 --out "$OUT" | tee "$OUT/chain.jsonl"
fi
if has norm; then
    echo "## norm"; run --chain layer --norm --rows 1,4 | tee "$OUT/norm.jsonl"
fi
if has bounds; then
    echo "## bounds"; run --chain mlp,layer --rows 1 --mode 0,2 | tee "$OUT/bounds.jsonl"
fi
