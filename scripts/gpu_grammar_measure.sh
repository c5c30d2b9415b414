#!/usr/bin/env bash
# On the lent GPU (device tool): the cost of constrained decoding (issue #16), Qwen3-8B shape, bf16,
# 512-token prompts, 128 tokens, at 1 and 8 sequences, each run measured without and with a grammar
# (rows "<method>+json"; the "vs no grammar" column is the cost; target at batch 1: >= 0.95x).
#   json:      --json-schema builtin (records of strings / numbers / enums / arrays, no length bounds)
#   maxlength: the same schema with maxLength on its strings (llguidance's slow case: docs/grammar.md)
#   masks:     llguidance vs xgrammar mask time per token on the CPU (scripts/grammar_mask_time.py)
# Needs llguidance on the GPU image (pip install llguidance==1.9.1, or carry a wheel in .whl/; xgrammar
# for the masks stage). Results (bench.json / bench.md per run) under $OUT; the tables last.
set -uo pipefail
usage() {  # the comment block above, as the usage text
    echo "usage: [STAGES=json,maxlength,masks] bash scripts/gpu_grammar_measure.sh"
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
}
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
STAGES=${STAGES:-json,maxlength,masks}
if ls .whl/*.whl >/dev/null 2>&1; then  # the carried wheels (docs/gpu.md)
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
python3 -c "import llguidance" || { echo "llguidance is not installed: pip install llguidance==1.9.1"; exit 1; }
common=(--shape qwen3-8b --contexts 512 --gen-tokens 128 --repeats 3 --concurrency 1,8)
if has json; then
  timeout 600 python3 -m verispec bench "${common[@]}" --methods ar,eagle3 --draft-block 3 --step-iters 10 \
      --json-schema builtin --out "$OUT/grammar-json" 2>&1 | grep -E "^\||error|Error|round ms" | head -16
fi
if has maxlength; then
  python3 - "$OUT/maxlength.json" <<'PY'
import copy, json, sys
from verispec.bench.options import BUILTIN_SCHEMA
schema = copy.deepcopy(BUILTIN_SCHEMA)
item = schema["properties"]["records"]["items"]["properties"]
item["name"]["maxLength"] = 24
item["tags"]["items"]["maxLength"] = 12
open(sys.argv[1], "w").write(json.dumps(schema))
PY
  timeout 600 python3 -m verispec bench "${common[@]}" --methods ar --json-schema "$OUT/maxlength.json" \
      --out "$OUT/grammar-maxlength" 2>&1 | grep -E "^\||error|Error|round ms" | head -10
fi
if has masks; then
  timeout 300 python3 scripts/grammar_mask_time.py --tokenizer tiny --repeat 3 2>&1 | tail -3
fi
