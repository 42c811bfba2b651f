#!/usr/bin/env bash
# Failure recovery (DESIGN.md 8): a stage that dies mid-generation costs a pause, never a
# lost or altered answer. A 3-stage ring on a synthesized ring-45 answers prompts (greedy
# and sampled with seeds, then all with a repetition penalty) undisturbed; then the same
# prompts again while:
#   1. the middle stage is killed with SIGKILL mid-generation and started again;
#   2. the same, every sequence with a repetition penalty (the tail's penalty window is
#      restored from REPLAY records, its generator from their draw counts);
#   3. the tail is killed and started again (penalties on);
#   4. an authenticated rogue posing as stage 0 takes the middle stage's upstream link
#      and sends a frame longer than the plan allows (stage 1 drops its sequences; the
#      real stage 0 reconnects by itself);
# every answer must be exactly the undisturbed one. The bridge's own measure of each
# outage (failure detected -> ring whole again) and the time from the kill to the ring
# being whole are printed. Then the middle stage is killed and not restarted: every
# request ends with an explicit error once the bridge stops holding it (30 s), and after
# a restart the ring answers identically again. Last, under `kvasir serve` (whose warm
# standby of the stage takes its place), three streaming HTTP completions with sampling
# and all three penalties survive a SIGKILL of the middle stage with exactly the
# undisturbed text.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

ROGUE=${KVR_ROGUE:-${KVR_BUILD:-$(dirname "$KVASIR")}/kvr_rogue}
[ -x "$ROGUE" ] || fail "rogue peer not built: $ROGUE"

"$KVASIR" synth --shape ring-45 --type q8_0 --seed 11 -o "$TMP/ring45.gguf" >/dev/null 2>&1 ||
    fail "synth ring-45"
for i in $(seq 0 7); do
    n=$((64 + 8 * i))
    case $((i % 4)) in
    0) echo "{\"prompt\": \"Once upon a time $i\", \"temperature\": 0, \"max_tokens\": $n}" ;;
    1) echo "{\"prompt\": \"The little robot $i\", \"temperature\": 0.9, \"seed\": $i, \"max_tokens\": $n}" ;;
    2) echo "{\"prompt\": \"In a land far away $i\", \"temperature\": 0.7, \"top_k\": 20, \"seed\": $((100 + i)), \"max_tokens\": $n}" ;;
    3) echo "{\"prompt\": \"$i\", \"temperature\": 1.1, \"top_p\": 0.9, \"min_p\": 0.02, \"seed\": $((7 * i)), \"max_tokens\": $n}" ;;
    esac
done >"$TMP/prompts.jsonl"

start_ring "$TMP/ring45.gguf" 3 3 ring --max-seqs 8 --ctx 256


# run_ring TAG [run options...]: the prompts through the ring in the background; sets RUN_PID.
run_ring() {
    local tag=$1
    shift
    # KVR_LOG=debug: the bridge logs every batch that comes back, which mid_run counts.
    KVR_LOG=debug timeout 150 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" \
        --json --ignore-eos "$@" >"$TMP/$tag.jsonl" 2>"$TMP/$tag.log" &
    RUN_PID=$!
}
wait_run() { # wait_run TAG: the run must succeed
    wait "$RUN_PID" || { grep -v "handshake done" "$TMP/$1.log" | tail -20; fail "$1: run failed"; }
}
restart_stage() { # restart_stage I: start stage I again (its old process is gone)
    "$KVASIR" stage --plan "$RING_PLAN" --index "$1" >>"$TMP/ring/stage$1.log" 2>&1 &
    RING_PIDS[$1]=$!
    PIDS+=($!)
}
kill_stage() { # kill_stage I: SIGKILL, and wait until it is gone
    kill -9 "${RING_PIDS[$1]}"
    wait "${RING_PIDS[$1]}" 2>/dev/null || true
}
# check TAG REF T_KILL: identical answers, an outage really happened mid-run; report times.
check() {
    local tag=$1 ref=$2 t_kill=$3 held whole
    cmp -s "$TMP/$ref.jsonl" "$TMP/$tag.jsonl" ||
        { diff "$TMP/$ref.jsonl" "$TMP/$tag.jsonl" | head; fail "$tag: answers differ from the undisturbed run"; }
    held=$(grep -m1 "holding [1-9][0-9]* sequences" "$TMP/$tag.log") ||
        fail "$tag: the bridge never held a sequence (was the failure after the run?)"
    whole=$(grep -m1 "ring whole again" "$TMP/$tag.log") || fail "$tag: no recovery logged"
    echo "  $held"
    echo "  $whole"
    awk -v a="$t_kill" -v b="$(log_ts "$whole")" -v t="$tag" \
        'BEGIN { printf "ok: %s: %d/8 answers identical; ring whole %.0f ms after the failure was caused\n", t, 8, (b - a) * 1000 }'
}

# Undisturbed references, and how long a run takes (to aim the failures mid-run).
mono_now t0
run_ring ref
wait_run ref
mono_now t1
N_BATCHES=$(grep -c "bridge: batch" "$TMP/ref.log")
[ "$N_BATCHES" -ge $((4 * ${MID_BATCHES:-60})) ] ||
    fail "the undisturbed run took $N_BATCHES batches: too few to fail one in the middle"
run_ring refpen --repeat-penalty 1.3
wait_run refpen
[ "$(wc -l <"$TMP/ref.jsonl")" = 8 ] || fail "expected 8 answers"
cmp -s "$TMP/ref.jsonl" "$TMP/refpen.jsonl" && fail "the penalty changed nothing: the test would not see it"
echo "ok: undisturbed runs recorded ($(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s each, $N_BATCHES batches)"

# 1. SIGKILL the middle stage mid-generation, restart it.
run_ring kill1
mid_run kill1
log_now t_kill
kill_stage 1
restart_stage 1
wait_run kill1
check kill1 ref "$t_kill"

# 2. The same with a repetition penalty on every sequence.
run_ring kill1pen --repeat-penalty 1.3
mid_run kill1pen
log_now t_kill
kill_stage 1
restart_stage 1
wait_run kill1pen
check kill1pen refpen "$t_kill"

# 3. SIGKILL the tail (the bridge's own link drops).
run_ring kill2pen --repeat-penalty 1.3
mid_run kill2pen
log_now t_kill
kill_stage 2
restart_stage 2
wait_run kill2pen
check kill2pen refpen "$t_kill"

# 4. A rogue takes stage 1's upstream and sends an oversized frame.
run_ring rogue --repeat-penalty 1.3
mid_run rogue
log_now t_kill
set +e; "$ROGUE" --plan "$RING_PLAN" --as 0 --send oversized >"$TMP/rogue.out" 2>&1; rc=$?; set -e
[ $rc = 0 ] || { cat "$TMP/rogue.out"; fail "rogue: exit $rc"; }
wait_run rogue
check rogue refpen "$t_kill"
for p in "${RING_PIDS[@]}"; do kill -0 "$p" 2>/dev/null || fail "a stage process died"; done

# 5. The middle stage dies for good: every request ends with an explicit error.
run_ring lost
mid_run lost
kill_stage 1
set +e; wait "$RUN_PID"; rc=$?; set -e
[ $rc = 1 ] || { tail -20 "$TMP/lost.log"; fail "lost: run exit $rc, expected 1 (requests failed)"; }
n_err=$(grep -c "failed: the ring failed and did not recover within 30 s" "$TMP/lost.log" || true)
[ "$n_err" = 8 ] || { tail -20 "$TMP/lost.log"; fail "lost: $n_err of 8 requests got the explicit error"; }
echo "ok: lost: with the stage gone for good, 8/8 requests ended with: the ring failed and did not recover within 30 s"
restart_stage 1
run_ring after
wait_run after
cmp -s "$TMP/ref.jsonl" "$TMP/after.jsonl" || fail "after: answers differ once the stage is back"
echo "ok: after: the restarted ring answers identically"
stop_ring

# 6. Under kvasir serve: the killed stage's standby takes its place; the streams only pause.
start_serve serve "$TMP/ring45.gguf" --stages 3 --max-seqs 8 --ctx 256 --no-admission
body() { # body I: a streamed completion's request (start_streams)
    printf '%s' "{\"model\": \"ring45\", \"prompt\": \"Once upon a time $1\", \"max_tokens\": 150,
             \"temperature\": 0.9, \"seed\": $1, \"ignore_eos\": true, \"stream\": true,
             \"repetition_penalty\": 1.2, \"frequency_penalty\": 0.5, \"presence_penalty\": 0.3}"
}
for tag in ref dis; do
    pids=()
    if [ $tag = dis ]; then
        # Mid-stream, on an observed event: SIGKILL once every stream has delivered 40 of
        # its 150 tokens to its client (kill_mid_stream.py fails if one had ended by then).
        # A count of the ring's batches read from /metrics was not one: under a loaded
        # ctest -j4 a read timed out, the count started from nothing, and the kill came
        # before the streams were admitted (no sequence held, no recovery to see).
        # The stage, not its standby (whose command line ends in --standby).
        s1=$(pgrep -f "stage --plan $TMP/serve-plan/plan.json --index 1$") || fail "serve: no stage 1"
        watch_and_kill 40 "$s1" "$TMP"/sse.dis.{1,2,3}
    fi
    start_streams "$tag" "$SERVE_URL" 120 body 1 2 3
    pids=("${STREAM_PIDS[@]}")
    if [ $tag = dis ]; then
        wait "$WATCHER" || fail "serve: no kill mid-stream"
        echo "  serve: stage 1 SIGKILLed with the streams at $(cut -d' ' -f2- "$TMP/kill.out") of 150 tokens"
    fi
    for p in "${pids[@]}"; do wait "$p" || fail "serve: a $tag stream failed"; done
done
for i in 1 2 3; do
    [ "$(wc -c <"$TMP/http.ref.$i")" -gt 100 ] || fail "serve: stream $i carried almost no text"
    cmp -s "$TMP/http.ref.$i" "$TMP/http.dis.$i" ||
        { cat "$TMP/http.ref.$i" "$TMP/http.dis.$i"; fail "serve: stream $i differs after the kill"; }
done
grep -q "stage 1 died (status 9): its standby takes over" "$SERVE_LOG" ||
    fail "serve: stage 1's standby did not take its place"
grep -q "stage 1: standby takes over" "$SERVE_LOG" || fail "serve: the standby did not say so"
whole=$(grep -m1 "ring whole again" "$SERVE_LOG") || fail "serve: no recovery logged"
echo "  $whole"
echo "ok: serve: 3/3 streams identical after stage 1 was killed and its standby took over"
echo PASS
