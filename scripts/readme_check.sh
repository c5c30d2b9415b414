#!/usr/bin/env bash
# Follow the README's quickstart literally on this checkout (CI runs it on a fresh clone, before
# `make test`): `make serve` in the background until /health answers, the README's curl request,
# then the README's `verispec generate` command in the activated venv. Each command is checked to
# appear in README.md word for word, so the page and this check cannot drift apart.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    cat <<'USAGE'
usage: scripts/readme_check.sh

Runs README.md's quickstart as written on this checkout: make serve (port 9999, or PORT=...), the
curl chat request, then `source .venv/bin/activate` and `verispec generate -m smollm2 ...`.
Fails on a missing README command, a server that is not healthy within READY_TIMEOUT_S (default
1800: the first make serve creates .venv), an empty answer, or a start-up warning in the log.
USAGE
    exit 0
fi

cd "$(dirname "$0")/.."
PORT="${PORT:-9999}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-1800}"
LOG="$(mktemp -t readme-serve.XXXXXX.log)"

in_readme() {  # the exact command text must be on the page
    grep -qF -- "$1" README.md || { echo "readme_check: README.md no longer says: $1" >&2; exit 1; }
}

in_readme "make serve"
in_readme "source .venv/bin/activate"
GENERATE='verispec generate -m smollm2 --prompt "Name three primary colors." --max-tokens 40'
in_readme "$GENERATE"
in_readme "curl http://127.0.0.1:9999/v1/chat/completions"

echo "readme_check: make serve (log: $LOG)"
setsid make serve PORT="$PORT" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -- -"$SERVER" 2>/dev/null || true' EXIT

waited=0
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    if ! kill -0 "$SERVER" 2>/dev/null; then
        echo "readme_check: make serve exited before it was healthy:" >&2; tail -30 "$LOG" >&2; exit 1
    fi
    if (( waited >= READY_TIMEOUT_S )); then
        echo "readme_check: no /health after ${READY_TIMEOUT_S}s:" >&2; tail -30 "$LOG" >&2; exit 1
    fi
    sleep 5; waited=$((waited + 5))
done
echo "readme_check: healthy after ${waited}s; start-up as logged:"
grep -E "start-up:|model:" "$LOG" || true

# the README's curl request (its port swapped only when PORT says so)
reply="$(curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "smollm2", "max_tokens": 40, "temperature": 0,
  "messages": [{"role": "user", "content": "What is the capital of France?"}]}')"
echo "$reply" | grep -q '"content":"[^"]' || { echo "readme_check: empty chat reply: $reply" >&2; exit 1; }
echo "readme_check: curl answered: $(echo "$reply" | head -c 300)"

kill -- -"$SERVER" 2>/dev/null || true
wait "$SERVER" 2>/dev/null || true
trap - EXIT

# shellcheck disable=SC1091
source .venv/bin/activate
answer="$(eval "$GENERATE" 2>/dev/null)"
[[ -n "${answer//[[:space:]]/}" ]] || { echo "readme_check: $GENERATE printed nothing" >&2; exit 1; }
echo "readme_check: verispec generate answered: $answer"
deactivate

# the server's own output: from make's `verispec serve` line on (pip's install output before it
# speaks of the machine's package mirrors, not of verispec)
if sed -n '/verispec serve /,$p' "$LOG" | grep -iE "warning|deprecat"; then
    echo "readme_check: the server's start printed the warnings above" >&2; exit 1
fi
echo "readme_check: ok"
