#!/usr/bin/env bash
# On the lent GPU: does a second start reuse the first one's compiled kernels? Two processes each
# build the `serve --demo` engine and prewarm it (phases logged; AUTOTUNE_CACHE=1 also keeps Triton's
# autotuning results on disk); then the Triton cache entries the second process wrote, by kernel
# name (what compiles at every start), in the directory the engine pins and in Triton's default.
set -uo pipefail
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
export TRITON_CACHE_AUTOTUNING=${AUTOTUNE_CACHE:-0}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PINNED=$(python3 -c "import torch; from verispec.engine.warmup import pin_triton_cache_dir; print(pin_triton_cache_dir(torch.device('cuda')))")
DEFAULT=$(python3 -c "import triton; print(triton.knobs.cache.dir)")
CACHE="$PINNED $DEFAULT"
echo "triton cache: pinned $PINNED, Triton's default $DEFAULT"
for i in 1 2; do
  touch "$OUT/start_$i"
  before=$(find $CACHE -name "*.json" 2>/dev/null | wc -l)
  timeout 280 python3 -c "
import time
from verispec import cli
from verispec.engine.engine import Engine
args = cli.build_parser().parse_args(['serve', '--demo'])
t0 = time.perf_counter(); engine = Engine.load(cli._engine_config(args)); t1 = time.perf_counter()
engine.prewarm(); print(f'process $i: load {t1 - t0:.1f} s, prewarm {time.perf_counter() - t1:.1f} s', flush=True)
" 2>&1 | grep -E "process|phases|Error"
  after=$(find $CACHE -name "*.json" 2>/dev/null | wc -l)
  echo "process $i: cache .json files $before -> $after"
done
echo "kernels the second process compiled (cache entries it wrote):"
find $CACHE -newer "$OUT/start_2" -name "*.json" ! -name "__grp__*" 2>/dev/null | xargs -r grep -ho '"name": "[^"]*"' | sort | uniq -c | sort -rn | head -25
