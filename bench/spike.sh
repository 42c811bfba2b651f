#!/usr/bin/env bash
# bench/spike.sh - latency budgets under a spike (issue: serving, DESIGN.md 6).
#
#   bench/spike.sh [-m MODEL] [--stages 2] [--factor 3] [--duration 60] [--out DIR]
#
# 1. Start `kvasir serve` (admission on) and measure capacity: closed loop with as many
#    clients as sequence slots for 15 s; capacity = completed requests/s.
# 2. Offer FACTOR x capacity (Poisson) for DURATION s with a latency budget per request;
#    report how many admitted requests met it, how fast refusals came, goodput.
# 3. The same load against `kvasir serve --no-admission`.
# 4. A sweep of rates around capacity with admission on, plotted to DIR/spike-sweep.svg.
# Requests: 64-token prompts, 32 output tokens, budget 2000 ms first token / 5000 ms total.
# Everything on 127.0.0.1; the servers are stopped at the end.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
KVASIR=${KVASIR:-$here/../build/kvasir}
model="" stages=2 factor=3 duration=60 out=$here/results
prompt=64 output=32 ttft=2000 total=5000 seqs=32
while [ $# -gt 0 ]; do
    case $1 in
    -m) model=$2; shift ;;
    --stages) stages=$2; shift ;;
    --factor) factor=$2; shift ;;
    --duration) duration=$2; shift ;;
    --out) out=$2; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "spike.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"
TMP=$(mktemp -d /tmp/kvr-spike.XXXXXX)
SERVER=""
cleanup() {
    [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null
    rm -rf "$TMP"
}
trap cleanup EXIT
if [ -z "$model" ]; then
    model=$TMP/ring45.gguf
    "$KVASIR" synth --shape ring-45 --type q8_0 -o "$model" >/dev/null 2>&1
fi

start_server() { # extra args...
    rm -f "$TMP/serve.log" # an old server's ready line must not be read
    "$KVASIR" serve -m "$model" --stages "$stages" --port 0 --max-seqs "$seqs" \
        --ctx 512 "$@" >"$TMP/serve.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 150); do
        URL=$(sed -n 's/^kvasir: ready on \(http:[^ ]*\)$/\1/p' "$TMP/serve.log" 2>/dev/null)
        [ -n "$URL" ] && return 0
        kill -0 "$SERVER" 2>/dev/null || break
        sleep 0.2
    done
    cat "$TMP/serve.log"
    echo "spike.sh: server did not start" >&2
    exit 1
}
stop_server() { kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=""; }
load=(-m "$model" --prompt-len "$prompt" --output-len "$output" --quiet)
budget=(--ttft-budget-ms "$ttft" --total-budget-ms "$total")

start_server
"$KVASIR" bench --url "$URL" "${load[@]}" --concurrency "$seqs" --duration 15 \
    --json "$out/spike-capacity.json" >"$out/spike-capacity.txt"
capacity=$(python3 -c "import json;print(json.load(open('$out/spike-capacity.json'))['runs'][0]['summary']['throughput']['requests_per_s'])" 2>/dev/null ||
    sed -n 's/^  throughput *\([0-9.]*\) req\/s.*/\1/p' "$out/spike-capacity.txt")
rate=$(awk -v c="$capacity" -v f="$factor" 'BEGIN { printf "%.2f", c * f }')
echo "capacity: $capacity req/s (closed loop, $seqs clients); spike: $rate req/s for $duration s"

"$KVASIR" bench --url "$URL" "${load[@]}" "${budget[@]}" --rate "$rate" --duration "$duration" \
    --json "$out/spike-admission.json" | tee "$out/spike-admission.txt"
"$KVASIR" bench --url "$URL" "${load[@]}" "${budget[@]}" --duration 20 \
    --sweep "$(awk -v c="$capacity" 'BEGIN { printf "%.2f,%.2f,%.2f,%.2f,%.2f", c/2, c, 2*c, 3*c, 4*c }')" \
    --svg "$out/spike-sweep.svg" | tee "$out/spike-sweep.txt"
stop_server

start_server --no-admission
"$KVASIR" bench --url "$URL" "${load[@]}" "${budget[@]}" --rate "$rate" --duration "$duration" \
    --json "$out/spike-no-admission.json" | tee "$out/spike-no-admission.txt"
stop_server
