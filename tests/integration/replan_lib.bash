# replan_lib.bash - the four-stream harness that ring_replan.sh and ring_spare.sh share:
# four streamed completions (greedy and sampled with penalties) at once, optionally with a
# stage SIGKILLed mid-stream, and the check that every text equals the undisturbed one.
# The caller sets URL (the bridge), N_TOKENS, KILL_AFTER (ring batches before the kill),
# RING_PIDS (lib.bash start_ring) and TMP; the bridge logs to $TMP/bridge.log.

mono() { python3 -c 'import time; print(time.monotonic())'; }
ts() { sed -n 's/^\[ *\([0-9.]*\) .*/\1/p' <<<"$1"; }
metric() { curl -s -m 2 "$URL/metrics" | awk -v n="kvasir:$1" '$1 == n {print $2}'; }
# complete I TAG: a streamed completion; its text (from the SSE events) to a file.
complete() {
    local sampling='"temperature": 0'
    [ $(($1 % 2)) = 1 ] &&
        sampling="\"temperature\": 0.9, \"seed\": $1, \"repetition_penalty\": 1.2, \"frequency_penalty\": 0.5"
    curl -s -N -m 300 "$URL/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"m\", \"prompt\": \"Once upon a time $1\", \"max_tokens\": $N_TOKENS,
             \"ignore_eos\": true, \"stream\": true, $sampling}" | sse_text >"$TMP/http.$2.$1"
}
# pass TAG [I]: the four completions at once; with I, SIGKILL stage I mid-stream.
pass() {
    local pids=() i p b0
    for i in 0 1 2 3; do complete "$i" "$1" & pids+=($!); done
    if [ -n "${2:-}" ]; then
        b0=$(metric ring_batches_total)
        for i in $(seq 1 600); do
            [ "$(metric ring_batches_total)" -ge $((b0 + KILL_AFTER)) ] && break
            sleep 0.05
        done
        T_KILL=$(mono)
        kill -9 "${RING_PIDS[$2]}"
        wait "${RING_PIDS[$2]}" 2>/dev/null || true
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

