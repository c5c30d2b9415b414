# Sourced by the scripts/gpu_*.sh runs on the lent GPU: installs the carried wheels (.whl/, see
# docs/gpu.md) when there are any, unbuffers Python, makes $OUT, and gives `has STAGE` for the
# script's comma-separated $STAGES (each script sets its default before sourcing this).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
