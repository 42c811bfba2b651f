#!/usr/bin/env bash
# Multi-turn chat with and without the prefix cache (issue 15, acceptance 2): `kvasir serve`
# with 2 stages on a synthesized ring-45 Q8_0, `kvasir bench --multi-turn`: 32 conversations
# of 6 turns at once, a shared system prompt of 134 words and turns of 17-50 words (on this
# vocabulary about 400 and 50-150 tokens: the bench prints the server's token counts),
# OUTPUT_LEN (default 32) tokens per answer. Run under the bench lock:
#     flock /work/bench.lock bench/multiturn.sh [KVASIR] [both|cache|nocache] [DIR]
# Prints the runs and the ratios of later turns' TTFT p50 and of prompt tokens computed.
# With cache or nocache only that run is made and its report kept in DIR (default
# /tmp/kvr-multiturn-out), so the two can be separate benchmark calls; the ratios are
# printed once both reports are there. SERVE_FLAGS adds serve options to both runs.
set -euo pipefail
KVASIR=${1:-build/kvasir}
MODE=${2:-both}
OUT=${3:-/tmp/kvr-multiturn-out}
OUTPUT_LEN=${OUTPUT_LEN:-32}
mkdir -p "$OUT"
TMP=$(mktemp -d /tmp/kvr-multiturn.XXXXXX)
pgid=""
cleanup() { [ -n "$pgid" ] && kill -- "-$pgid" 2>/dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
"$KVASIR" synth --shape ring-45 --type q8_0 --seed 7 -o "$TMP/ring45.gguf" >/dev/null 2>&1
run() { # run TAG [serve options]
    local tag=$1
    shift
    setsid "$KVASIR" serve -m "$TMP/ring45.gguf" --stages 2 --port 0 --plan-dir "$TMP/$tag" \
        --no-admission --ttft-ms 600000 --total-ms 600000 ${SERVE_FLAGS:-} "$@" >"$TMP/$tag.out" 2>"$TMP/$tag.log" &
    pgid=$!
    for _ in $(seq 300); do grep -q '^kvasir: ready on ' "$TMP/$tag.out" && break; sleep 0.1; done
    local url
    url=$(sed -n 's/^kvasir: ready on //p' "$TMP/$tag.out")
    "$KVASIR" bench --url "$url" --multi-turn --conversations 32 --turns 6 --system-words 134 \
        --turn-words 17:50 --output-len "$OUTPUT_LEN" --seed 1 | tee "$OUT/$tag.txt" ||
        echo "($tag: some requests failed; see above)"
    kill -- "-$pgid"
    wait "$pgid" 2>/dev/null || true
    pgid=""
}
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "$MODE" != nocache ]; then
    echo "== with the prefix cache"
    run cache
fi
if [ "$MODE" != cache ]; then
    echo "== --no-prefix-cache"
    run nocache --no-prefix-cache
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
[ -s "$OUT/cache.txt" ] && [ -s "$OUT/nocache.txt" ] || exit 0
ttft() { sed -n 's/^later turns.*TTFT p50 \([0-9.]*\) ms.*/\1/p' "$OUT/$1.txt"; }
comp() { sed -n 's/.* sent, \([0-9]*\) computed.*/\1/p' "$OUT/$1.txt"; }
awk -v a="$(ttft cache)" -v b="$(ttft nocache)" -v c="$(comp cache)" -v d="$(comp nocache)" \
    'BEGIN { printf "later turns TTFT p50: %.0f ms vs %.0f ms = %.2fx; prompt tokens computed: %d vs %d = %.2fx\n", a, b, a / b, c, d, c / d }'
