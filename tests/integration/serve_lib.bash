# serve_lib.bash - start and stop `kvasir serve` for the HTTP tests (sourced after lib.bash;
# not a test itself). The server and its stage processes run in their own process group, so
# that the exit trap can stop all of them even if the server itself is stuck.

SERVE_PGID=""
SERVE_URL=""
SERVE_KEY=""

stop_serve() {
    [ -n "$SERVE_PGID" ] || return 0
    # The server stops its stages on SIGTERM; give it a few seconds, then kill the group.
    kill -TERM "$SERVE_PGID" 2>/dev/null || true
    local i
    for i in $(seq 100); do
        kill -0 -- "-$SERVE_PGID" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL -- "-$SERVE_PGID" 2>/dev/null || true
    wait "$SERVE_PGID" 2>/dev/null || true
    SERVE_PGID=""
}
trap 'stop_serve; cleanup' EXIT

# start_serve NAME MODEL [extra kvasir serve args...]: start `kvasir serve` on a port the
# kernel picks (--port 0) and wait (at most 60 s) until it prints its ready line. Sets
# SERVE_URL (http://127.0.0.1:PORT) and SERVE_LOG. An --api-key in the extra arguments is
# remembered in SERVE_KEY for metric().
start_serve() {
    local name=$1 model=$2
    shift 2
    local out=$TMP/$name.out
    SERVE_LOG=$TMP/$name.log
    SERVE_KEY=""
    local prev=""
    for a in "$@"; do
        [ "$prev" = --api-key ] && SERVE_KEY=$a
        prev=$a
    done
    # setsid: a new process group whose id is the server's pid (the server's stages
    # inherit it). The outer timeout bounds the server's whole life.
    # Its stages (and expert agents) listen in a block of ports this test holds (lib.bash).
    local base
    base=$(reserve_base_port)
    setsid timeout -k 5 600 "$KVASIR" serve -m "$model" --port 0 --plan-dir "$TMP/$name-plan" \
        --base-port "$base" "$@" >"$out" 2>"$SERVE_LOG" &
    SERVE_PGID=$!
    local i
    for i in $(seq 600); do
        if grep -q '^kvasir: ready on ' "$out"; then
            SERVE_URL=$(sed -n 's/^kvasir: ready on //p' "$out" | head -1)
            echo "kvasir serve ($name) ready on $SERVE_URL"
            return 0
        fi
        if ! kill -0 "$SERVE_PGID" 2>/dev/null; then
            tail -20 "$SERVE_LOG"
            fail "kvasir serve ($name) exited before it was ready"
        fi
        sleep 0.1
    done
    tail -20 "$SERVE_LOG"
    fail "kvasir serve ($name) was not ready within 60 s"
}

# metric NAME: the value of a sample in /metrics with no label but model_name (empty if
# absent).
metric() {
    local auth=()
    [ -n "$SERVE_KEY" ] && auth=(-H "Authorization: Bearer $SERVE_KEY")
    curl -s -m 2 "${auth[@]}" "$SERVE_URL/metrics" | awk -v n="kvasir:$1" '{sub(/model_name="[^"]*",?/, ""); sub(/[{][}]/, "")} $1 == n {print $2}'
}

# now_ms: a monotonic-enough wall clock in milliseconds.
now_ms() { echo $(($(date +%s%N) / 1000000)); }
