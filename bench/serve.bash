# bench/serve.bash - sourced by the serving benchmarks that start a `kvasir serve` of their
# own ($KVASIR): the default model and the server's start and stop.
#
#   serve_tmp NAME [KEEP]       a temporary directory, TMP, removed when the script exits,
#                               after the server is stopped and its log (TMP/serve.log)
#                               copied to KEEP if that is not empty
#   ring45 FILE                 synthesize the default model (ring-45, Q8_0) into FILE
#   serve_start LOG [ARG...]    `kvasir serve --port 0 ARG...` in the background, its output in
#                               LOG; waits up to 30 s for "ready on" and sets URL and SERVER
#                               (prints LOG and fails if it never comes)
#   serve_stop                  stops it, if it runs (for the script's EXIT trap)
#   estimate_outcomes           from a debug serve log on stdin, a line per answer that
#                               ended: first token ms, its estimate, whole ms, its estimate
#   P90_AWK                     awk functions for a script's program (n: the count of
#                               values): sort(v) sorts v[1..n], p90(v) sorts and returns
#                               its 90th percentile
# Environment set on the call (KVR_LOG=debug serve_start ...) reaches the server.

serve_tmp() {
    TMP=$(mktemp -d "/tmp/$1.XXXXXX")
    SERVE_KEEP=${2:-}
    trap serve_exit EXIT
}

serve_exit() {
    serve_stop
    if [ -n "$SERVE_KEEP" ] && [ -f "$TMP/serve.log" ]; then
        cp "$TMP/serve.log" "$SERVE_KEEP"
    fi
    rm -rf "$TMP"
}

ring45() {
    "$KVASIR" synth --shape ring-45 --type q8_0 -o "$1" >/dev/null 2>&1
}

serve_start() {
    local log=$1
    shift
    "$KVASIR" serve --port 0 "$@" >"$log" 2>&1 &
    SERVER=$!
    URL=""
    for _ in $(seq 150); do
        URL=$(sed -n 's/^kvasir: ready on \(http:[^ ]*\)$/\1/p' "$log" 2>/dev/null)
        [ -n "$URL" ] && return 0
        sleep 0.2
    done
    cat "$log"
    return 1
}

serve_stop() {
    if [ -n "${SERVER:-}" ]; then
        kill "$SERVER" 2>/dev/null || true
        wait "$SERVER" 2>/dev/null || true
    fi
    SERVER=""
}

estimate_outcomes() {
    sed -n 's/.*estimate [0-9]* done: [0-9]* tokens, first token \([0-9]*\) ms (estimated \([0-9]*\)), whole \([0-9]*\) ms (estimated \([0-9]*\)).*/\1 \2 \3 \4/p'
}

# shellcheck disable=SC2034 # used by the scripts that source this file
P90_AWK='
function sort(v,   i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t } }
function p90(v,   k) { sort(v); k = int(0.9 * n + 0.999); return v[k < 1 ? 1 : k] }
'
