#!/usr/bin/env bash
# Clients that go away free their KV at once: 10 streaming clients (and 2 waiting for a
# whole chat answer) start long generations through `kvasir serve` (a real 2-stage ring),
# are killed mid-answer, and within 1 s of the last one dying /metrics shows
# kvasir:kv_blocks_used 0 and no request running. The server then still answers a normal
# request.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

N_CLIENTS=10 # streaming
N_WHOLE=2    # non-streaming chat
N_ALL=$((N_CLIENTS + N_WHOLE))
LIMIT_MS=1000

# Big enough that 3000 tokens take many seconds, small enough to write in well under one.
timeout 60 "$KVASIR" synth --shape custom --layers 8 --dim 256 --ff 768 --heads 8 --kv-heads 4 \
    --ctx 4096 --seed 3 -o "$TMP/m.gguf" >/dev/null 2>&1 || fail "synth"
start_serve cancel "$TMP/m.gguf" --stages 2 --ctx 4096 --max-seqs 16

[ "$(metric kv_blocks_used)" = 0 ] || fail "kv_blocks_used is not 0 before any request"

body='{"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": true, "stream": true,
       "temperature": 0.8, "seed": 1}'
clients=()
for i in $(seq 1 $N_CLIENTS); do
    # curl's own -m bounds it; no timeout wrapper, whose death would leave curl running.
    curl -sN -m 120 -o "$TMP/client$i.sse" -H 'Content-Type: application/json' \
        -d "$body" "$SERVE_URL/v1/completions" &
    clients+=($!)
    PIDS+=($!)
done
chat='{"messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 3000,
       "ignore_eos": true, "seed": 2}'
for i in $(seq 1 $N_WHOLE); do
    curl -s -m 120 -o "$TMP/whole$i.json" -H 'Content-Type: application/json' \
        -d "$chat" "$SERVE_URL/v1/chat/completions" &
    clients+=($!)
    PIDS+=($!)
done

# Wait until every client is receiving tokens (so each is killed mid-answer), at most 30 s.
deadline=$(($(now_ms) + 30000))
for i in $(seq 1 $N_CLIENTS); do
    while [ "$(cat "$TMP/client$i.sse" 2>/dev/null | grep -c '^data: {' || true)" -lt 5 ]; do
        [ "$(now_ms)" -lt "$deadline" ] || fail "client $i got no tokens within 30 s"
        sleep 0.05
    done
done
while running=$(metric num_requests_running); [ "$running" != "$N_ALL" ]; do
    [ "$(now_ms)" -lt "$deadline" ] || break
    sleep 0.05
done
used=$(metric kv_blocks_used)
echo "all $N_CLIENTS clients streaming: $running requests running, $used KV blocks used"
[ "$running" = "$N_ALL" ] || fail "expected $N_ALL running requests, got $running"
[ "$used" -gt 0 ] || fail "expected KV blocks in use, got $used"

# The KV's release is timed by one process reading /metrics every 10 ms (poll_freed.py),
# started before the kill: a shell loop forking date, curl and awk took hundreds of ms a
# round under a loaded ctest, so one slow round could have put the release past the limit.
python3 "$(dirname "$0")/poll_freed.py" "$SERVE_URL" "$TMP/t0" "$TMP/poll.ready" >"$TMP/freed" &
poller=$!
PIDS+=($poller)
wait_ready "$TMP/poll.ready" "$poller" "the /metrics poller"

# Kill every client; the clock starts when the last one is gone.
exec 3>&2 2>/dev/null # bash's "Killed" job notices are expected noise
for p in "${clients[@]}"; do kill -KILL "$p" || true; done
for p in "${clients[@]}"; do wait "$p" || true; done
mono_now t0
echo "$t0" >"$TMP/t0"
exec 2>&3 3>&-
for i in $(seq 1 $N_CLIENTS); do
    ! grep -q '^data: \[DONE\]' "$TMP/client$i.sse" || fail "client $i finished before it was killed"
done
for i in $(seq 1 $N_WHOLE); do
    [ ! -s "$TMP/whole$i.json" ] || fail "chat client $i got an answer before it was killed"
done

wait "$poller" || fail "the /metrics poller failed"
read -r freed rest <"$TMP/freed" || fail "no answer from the /metrics poller"
[ "$freed" != never ] || fail "KV not freed 10 s after the clients died (used, running: $rest)"
echo "KV freed ${freed} ms after the last of $N_ALL clients died (limit ${LIMIT_MS} ms)"
[ "$freed" -le "$LIMIT_MS" ] || fail "KV freed after ${freed} ms, more than ${LIMIT_MS} ms"

gone=$(curl -s -m 5 "$SERVE_URL/metrics" |
    awk '{sub(/model_name="[^"]*",?/, ""); sub(/[{][}]/, "")} $1 == "kvasir:request_failure_total{reason=\"client_gone\"}" {print $2}')
[ "$gone" = "$N_ALL" ] || fail "expected $N_ALL client_gone failures in /metrics, got '$gone'"

# The server still serves.
out=$(curl -s -m 30 -w '\n%{http_code}' -H 'Content-Type: application/json' \
    -d '{"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}' \
    "$SERVE_URL/v1/completions")
[ "$(tail -1 <<<"$out")" = 200 ] || fail "a request after the cancellations failed: $out"
head -1 <<<"$out" | grep -q '"completion_tokens":8' || fail "unexpected answer: $out"
echo "PASS"
