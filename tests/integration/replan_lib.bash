# replan_lib.bash - the four-stream harness that ring_replan.sh and ring_spare.sh share:
# four streamed completions (greedy and sampled with penalties) at once, optionally with a
# stage SIGKILLed mid-stream, and the check that every text equals the undisturbed one.
# The caller sets URL (the bridge), N_TOKENS (per stream), KILL_AT (tokens every stream has
# delivered before the kill; far fewer than N_TOKENS), RING_PIDS (lib.bash start_ring) and
# TMP; the bridge logs to $TMP/bridge.log.

ts() { sed -n 's/^\[ *\([0-9.]*\) .*/\1/p' <<<"$1"; }
# complete I TAG: a streamed completion; its events to a file, its text to another.
complete() {
    local sampling='"temperature": 0'
    [ $(($1 % 2)) = 1 ] &&
        sampling="\"temperature\": 0.9, \"seed\": $1, \"repetition_penalty\": 1.2, \"frequency_penalty\": 0.5"
    curl -s -N -m 300 "$URL/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"m\", \"prompt\": \"Once upon a time $1\", \"max_tokens\": $N_TOKENS,
             \"ignore_eos\": true, \"stream\": true, $sampling}" | tee "$TMP/sse.$2.$1" | sse_text >"$TMP/http.$2.$1"
}
# pass TAG [I]: the four completions at once; with I, SIGKILL stage I mid-stream: on an
# observed event, not after a guessed time or batch count (either can outlast the streams
# on a fast machine or come before any on a slow one): once every stream has delivered
# KILL_AT of its N_TOKENS tokens to its client (kill_mid_stream.py; it fails if a stream
# had ended by then). Sets T_KILL (the kill's time on the bridge log's clock).
pass() {
    local pids=() i p out
    for i in 0 1 2 3; do complete "$i" "$1" & pids+=($!); done
    if [ -n "${2:-}" ]; then
        out=$(python3 "$(dirname "${BASH_SOURCE[0]}")/kill_mid_stream.py" "$KILL_AT" \
            "${RING_PIDS[$2]}" "$TMP/sse.$1".{0,1,2,3}) || fail "$1: no kill mid-stream"
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

