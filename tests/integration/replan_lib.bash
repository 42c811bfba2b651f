# replan_lib.bash - the four-stream harness that ring_replan.sh and ring_spare.sh share:
# four streamed completions (greedy and sampled with penalties) at once, optionally with a
# stage SIGKILLed mid-stream, and the check that every text equals the undisturbed one.
# The caller sets RING_PLAN and RING_PIDS (lib.bash start_ring); start_bridge sets URL; the
# bridge logs to $TMP/bridge.log. Sourced after lib.bash (it needs KVASIR).

# The re-plan grace, the streams' length and the kill's mark: every stream has delivered
# KILL_AT of its N_TOKENS tokens when the stage is killed. ThreadSanitizer slows the kernels
# 10-50x (a pass of 4 x 80 tokens took 1-2 minutes at load 10): shorter streams (TSAN=1).
GRACE_S=2
N_TOKENS=300
KILL_AT=20
TSAN=0
if grep -q "__tsan_init" "$KVASIR" 2>/dev/null; then
    TSAN=1
    N_TOKENS=40
    KILL_AT=5
fi

# held_and_replanned TAG N: the bridge held sequences at the kill (the streams were in
# flight) and re-planned the ring onto N stages at epoch 1.
held_and_replanned() {
    grep -q "holding [1-9][0-9]* sequences" "$TMP/bridge.log" ||
        fail "$1: the bridge never held a sequence (was the kill after the streams?)"
    grep -q "re-planned the ring: epoch 1, $2 stages" "$TMP/bridge.log" ||
        { tail -30 "$TMP/bridge.log"; fail "$1: the bridge did not re-plan the ring onto $2 stages"; }
}

# start_bridge: `kvasir bridge --replan-after $GRACE_S` for $RING_PLAN, ready within 60 s.
start_bridge() {
    : >"$TMP/bridge.out" # before the bridge opens it: a sed of a missing file fails the test
    "$KVASIR" bridge --plan "$RING_PLAN" --port 0 --replan-after "$GRACE_S" --no-admission \
        >"$TMP/bridge.out" 2>"$TMP/bridge.log" &
    BRIDGE=$!
    PIDS+=("$BRIDGE")
    URL=""
    local i
    for i in $(seq 1 600); do
        URL=$(sed -n 's/^kvasir: ready on //p' "$TMP/bridge.out" | head -1)
        [ -n "$URL" ] && break
        kill -0 "$BRIDGE" 2>/dev/null || { tail "$TMP/bridge.log"; fail "the bridge exited"; }
        sleep 0.1
    done
    [ -n "$URL" ] || { tail "$TMP/bridge.log"; fail "the bridge was not ready within 60 s"; }
}

# body I: a streamed completion's request (start_streams, lib.bash); odd ones sampled.
body() {
    local sampling='"temperature": 0'
    [ $(($1 % 2)) = 1 ] &&
        sampling="\"temperature\": 0.9, \"seed\": $1, \"repetition_penalty\": 1.2, \"frequency_penalty\": 0.5"
    printf '%s' "{\"model\": \"m\", \"prompt\": \"Once upon a time $1\", \"max_tokens\": $N_TOKENS,
             \"ignore_eos\": true, \"stream\": true, $sampling}"
}
# pass TAG [I]: the four completions at once; with I, SIGKILL stage I mid-stream: on an
# observed event, not after a guessed time or batch count (either can outlast the streams
# on a fast machine or come before any on a slow one): once every stream has delivered
# KILL_AT of its N_TOKENS tokens to its client (kill_mid_stream.py; it fails if a stream
# had ended by then). Sets T_KILL (the kill's time on the bridge log's clock).
pass() {
    local pids=() i p out
    # The watcher first, watching before any stream starts (lib.bash).
    [ -z "${2:-}" ] || watch_and_kill "$KILL_AT" "${RING_PIDS[$2]}" "$TMP/sse.$1".{0,1,2,3}
    start_streams "$1" "$URL" 300 body 0 1 2 3
    pids=("${STREAM_PIDS[@]}")
    if [ -n "${2:-}" ]; then
        wait "$WATCHER" || fail "$1: no kill mid-stream"
        out=$(cat "$TMP/kill.out")
        T_KILL=${out%% *}
        wait "${RING_PIDS[$2]}" 2>/dev/null || true
        echo "  $1: stage $2 SIGKILLed with the streams at ${out#* } of $N_TOKENS tokens"
    fi
    for p in "${pids[@]}"; do wait "$p" || { tail -20 "$TMP/bridge.log"; fail "$1: a stream failed"; }; done
}
same() { # same TAG: every text equal to the undisturbed one
    local i
    for i in 0 1 2 3; do
        cmp -s "$TMP/http.ref.$i" "$TMP/http.$1.$i" ||
            { cat "$TMP/http.ref.$i" "$TMP/http.$1.$i"; fail "$1: stream $i differs from the undisturbed run"; }
    done
}

