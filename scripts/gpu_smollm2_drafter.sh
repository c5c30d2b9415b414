#!/usr/bin/env bash
# On the lent GPU (device tool): train SmolLM2-135M-Instruct's EAGLE3 drafter with
# `verispec train-drafter` and measure plain vs EAGLE3 decoding, for the default model (issue #15).
#
# The GGUF (98 MB) is larger than what one call may carry (64 MiB with the working tree), so it
# travels in parts made by scripts/device_parts.py; a warm machine keeps /tmp between calls made
# within ~30 s, so earlier calls stash parts and the `train` call joins them (sha256-checked).
#
#   stash    copy the carried part(s) of build/device-parts/p*/ to /tmp/smollm2-parts (seconds)
#   train    stash, join the GGUF, build the chat corpus (scripts/make_chat_corpus.py), train the
#            drafter (~8 min in all); the drafter -> $OUT/smollm2-eagle3/, also kept in /tmp/smollm2
#   measure  on the machine `train` left warm: scripts/measure_speculation.py (plain, EAGLE3 1-4
#            drafts, held-out chat prompts) -> $OUT/speculation.json, and `verispec bench` (ar vs eagle3)
#   dry      train + measure on the CPU with tiny settings (checks this script's logic; ~2 min here)
#
# Carry build/gpu-wheels (the gguf wheel: the GPU image lacks it) in the `train` and `measure` calls.
# Knobs (env): TRAIN_SECONDS (330), GEN_SEQUENCES (4096), BATCH (64), SEQ_LEN (512), DRAFT_VOCAB (4096).
set -uo pipefail
usage() {  # the comment block above, as the usage text
    echo "usage: bash scripts/gpu_smollm2_drafter.sh stash|train|measure|remeasure|dry"
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"
}
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
PY=${PY:-python3}  # dry: the venv python here (PY=.venv/bin/python)
stage=${1:?usage: gpu_smollm2_drafter.sh stash|train|measure|remeasure|dry (--help: what each does)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/smollm2; PARTS=/tmp/smollm2-parts; GGUF=$W/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p $W $PARTS
export PYTHONUNBUFFERED=1
say() { echo "[smollm2 $(date +%T)] $*"; }

install_wheels() {
    if [ "$stage" = dry ]; then export PYTHONPATH=$PWD; return; fi
    "$PY" -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site build/gpu-wheels/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || { say "could not install build/gpu-wheels (carry it)"; exit 1; }
}

stash() {
    for f in build/device-parts/p*/part* build/device-parts/p*/manifest.json; do
        [ -f "$f" ] && cp "$f" $PARTS/
    done
    say "parts on this machine: $(cd $PARTS && ls | tr '\n' ' ')"
}

join_gguf() {
    [ -f $GGUF ] && { say "GGUF already joined"; return 0; }
    [ -f $PARTS/manifest.json ] || { say "no manifest.json: carry the last part (build/device-parts/pN)"; exit 1; }
    local n; n=$("$PY" -c "import json;print(json.load(open('$PARTS/manifest.json'))['parts'])")
    for i in $(seq -f %02g 1 "$n"); do
        [ -f $PARTS/part$i ] || { say "part $i of $n is missing: the machine went cold between calls; redo the stash calls"; exit 1; }
    done
    cat $PARTS/part* > $GGUF.tmp
    "$PY" - "$GGUF.tmp" "$PARTS/manifest.json" <<'EOF' || { rm -f $GGUF.tmp; exit 1; }
import hashlib, json, sys
want = json.load(open(sys.argv[2]))["sha256"]
got = hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest()
if got != want:
    sys.exit(f"joined GGUF sha256 {got} != {want}")
EOF
    mv $GGUF.tmp $GGUF; say "GGUF joined and checked ($(du -h $GGUF | cut -f1))"
}

train() {
    local device=$1 seconds=$2 gen=$3 batch=$4 seq=$5 vocab=$6 extra=$7 evals=$8 eval_tokens=$9
    say "chat corpus"
    "$PY" scripts/make_chat_corpus.py -m $GGUF --out $W/corpus $extra || exit 1
    say "train-drafter (${seconds}s of training)"
    "$PY" -m verispec train-drafter --method eagle3 -m $GGUF --device "$device" \
        --data $W/corpus/text --gen-prompts $W/corpus/train.jsonl --gen-sequences "$gen" --gen-fraction 0.75 \
        --out $W/run --restart --max-seconds "$seconds" --steps 100000 --batch-size "$batch" --seq-len "$seq" \
        --draft-vocab-size "$vocab" --lr 1e-3 --warmup-steps 50 --ttt-steps 3 --eval-every 0 \
        --eval-prompts "$evals" --eval-tokens "$eval_tokens" --save-every 1000 2>&1 | grep -v "^\[transformers\]"
    [ -f $W/run/model.safetensors ] || { say "training wrote no drafter"; exit 1; }
    # the shipped drafter: what train-drafter wrote, minus its resume state, with a portable verifier name
    rm -rf $W/eagle3 && mkdir -p $W/eagle3 $OUT/smollm2-eagle3
    cp $W/run/model.safetensors $W/run/training-eagle3.json $W/eagle3/
    "$PY" - $W/run/config.json $W/eagle3/config.json <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))
config["speculators_config"]["verifier"]["name_or_path"] = "smollm2"  # not this machine's path
open(sys.argv[2], "w").write(json.dumps(config, indent=2) + "\n")
EOF
    cp $W/eagle3/* $OUT/smollm2-eagle3/ && cp $W/corpus/stats.json $OUT/corpus-stats.json
    # files over 16 MiB do not come back whole from the device: split them (join with cat)
    for f in $OUT/smollm2-eagle3/*; do
        if [ "$(stat -c %s "$f")" -gt 16000000 ]; then split -b 15M -d "$f" "$f.part" && rm "$f"; fi
    done
    say "drafter: $(ls $OUT/smollm2-eagle3 | tr '\n' ' ')"
}

measure() {
    local device=$1 drafts=$2 prompts=$3 tokens=$4 bench=$5
    [ -f $W/eagle3/config.json ] || { say "no trained drafter in $W/eagle3: the machine went cold after train"; exit 1; }
    say "measure: plain vs EAGLE3 on held-out chat prompts"
    cp $W/eagle3/speculation.json $OUT/ 2>/dev/null
    "$PY" scripts/measure_speculation.py -m $GGUF --eagle3 $W/eagle3 --prompts $W/corpus/heldout.jsonl \
        --device "$device" --drafts "$drafts" --num-prompts "$prompts" --max-tokens "$tokens" \
        --record $W/eagle3/speculation.json --max-seconds 360 2>&1 | grep -v "^\[transformers\]"
    cp $W/eagle3/speculation.json $OUT/speculation.json
    if [ "$bench" = 1 ]; then
        say "verispec bench (words prompts; the standard table)"
        timeout 150 "$PY" -m verispec bench -m $GGUF --methods ar,eagle3 --eagle3 $W/eagle3 --draft-block 3 \
            --contexts 512 --gen-tokens 128 --repeats 2 --device "$device" --out $OUT/bench 2>&1 \
            | grep -E "^\||error" | head -20
    fi
}

case $stage in
    stash) stash ;;
    train) install_wheels; stash; join_gguf
           train cuda "${TRAIN_SECONDS:-330}" "${GEN_SEQUENCES:-4096}" "${BATCH:-64}" "${SEQ_LEN:-512}" \
                 "${DRAFT_VOCAB:-4096}" "" 16 96 ;;
    measure) install_wheels; measure cuda 1,2,3,4 16 192 1 ;;
    remeasure) # the machine went cold after train: the drafter came back in an earlier call's carry
               # (copied to $W/eagle3 by then), the GGUF comes again in parts, the corpus is rebuilt (seeded)
               install_wheels; stash; join_gguf
               "$PY" scripts/make_chat_corpus.py -m $GGUF --out $W/corpus > /dev/null || exit 1
               measure cuda 1,2,3,4 16 192 1 ;;
    dry) # on the CPU, the real GGUF from the installed wheel; tiny settings
         install_wheels
         [ -f $GGUF ] || cp "$("$PY" -c 'from verispec.loading.resolve import resolve_model; print(resolve_model("smollm2"))')" $GGUF
         train cpu 5 4 4 64 1024 "--max-requests 300" 1 8
         measure cpu 2 2 16 0 ;;
    *) echo "unknown stage $stage (stash|train|measure|dry)"; exit 2 ;;
esac
