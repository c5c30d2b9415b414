#!/usr/bin/env bash
# One device call (~9 min): the quant kernel's default (whole-word) form re-timed after the
# exponent-trick change, then the #14 decode numbers with the best tiles found, then the #13 16K
# repeated-prompt numbers after whole-prompt hits, on the Qwen3-8B shape and the Qwen3.6-27B
# hybrid shape. Results under $OUT; the tables last. FAMILIES=dot,x-first,tf32 widens the sweep,
# TILE_BUDGET_S (60) bounds it, PREFIX ("8b 27b") picks the prefix shapes.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout $((${TILE_BUDGET_S:-60} + 40)) python3 scripts/gpu_quant_tiles.py --families "${FAMILIES:-dot}" --budget-s ${TILE_BUDGET_S:-60} --out "$OUT" > "$OUT/tiles.log" 2>&1
grep -E "^[0-9]|^\||row 0|rror" "$OUT/tiles.log" | tail -8
tiles() { python3 -c "import json,sys; print(json.dumps(json.load(open('$OUT/best_tiles.json'))['$1']))" 2>/dev/null; }
common=(--shape qwen3-8b --draft-block 3 --contexts 512 --gen-tokens 128 --repeats 3)
timeout 60 python3 -m verispec bench "${common[@]}" --methods ar --out "$OUT/q-bf16" > "$OUT/q-bf16.log" 2>&1
for bits in 8 4; do
  VERISPEC_QUANT_TILES=$(tiles $bits) timeout 80 python3 -m verispec bench "${common[@]}" --methods ar,eagle3 \
      --quant mlx-${bits}bit --out "$OUT/q-$bits" > "$OUT/q-$bits.log" 2>&1
done
[[ " ${PREFIX:-8b 27b} " == *" 8b "* ]] && timeout 150 python3 -m verispec bench --shape qwen3-8b --prefix-cache --contexts 16384 --gen-tokens 128 --repeats 3 \
    --concurrency 8 --out "$OUT/prefix-8b" > "$OUT/prefix-8b.log" 2>&1
[[ " ${PREFIX:-8b 27b} " == *" 27b "* ]] && timeout 240 python3 -m verispec bench --shape qwen3.6-27b --prefix-cache --contexts 16384 --gen-tokens 64 --repeats 2 \
    --concurrency 4 --out "$OUT/prefix-27b" > "$OUT/prefix-27b.log" 2>&1
for f in q-bf16 q-8 q-4; do grep -E "^\| (ar|eagle3) " "$OUT/$f/bench.md" 2>/dev/null | cut -c1-200 || tail -3 "$OUT/$f.log"; done
for f in prefix-8b prefix-27b; do grep -E "^\| ar" "$OUT/$f/bench.md" 2>/dev/null || tail -3 "$OUT/$f.log"; done
