#!/usr/bin/env bash
# On the lent GPU (device tool, carry .whl): where 8 HTTP clients' decode time goes (#12).
#   rounds:    offline round phases + host profile, demo model with MTP at 1 and 8 sequences
#   synthetic: scripts/http_overhead.py on this host's CPU (what streaming takes from the engine)
#   http:      the demo served to 1 and 8 clients, engine process (the CUDA default) vs one process (SERVES=)
# Results under $OUT.
set -uo pipefail
STAGES=${STAGES:-rounds,synthetic,http}
SERVES=${SERVES:-"--serve=--demo --engine-process|--serve=--demo --no-engine-process"}
source "$(dirname "$0")/gpu_common.sh"
if has rounds; then
  for n in 1 8; do
    timeout 300 python3 scripts/round_profile.py -m verispec/demo/model --method mtp --concurrency $n --gen-tokens 256 \
        --top 45 > "$OUT/rounds_mtp_$n.txt" 2>&1
    grep -E "sequences:|graphs" "$OUT/rounds_mtp_$n.txt"
  done
fi
if has synthetic; then
  timeout 200 python3 scripts/http_overhead.py --repeats 2 2>&1 | grep -E "offline|HTTP"
fi
if has http; then
  IFS='|' read -ra serve_args <<< "$SERVES"
  timeout ${HTTP_TIMEOUT:-420} python3 -m verispec bench "${serve_args[@]}" --contexts 512 --gen-tokens 256 --repeats ${REPEATS:-3} \
      --concurrency 1,8 --out "$OUT/http" 2>&1 | grep -E "^\||error|Error|aggregate" | head -20
fi
if has http; then  # where each server's start-up went (prewarm, graph capture)
  grep -hE "prewarm|ready|captured|KV cache" "$OUT"/http/serve-*.log 2>/dev/null | head -20
fi
