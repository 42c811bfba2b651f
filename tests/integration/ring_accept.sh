#!/usr/bin/env bash
# A would-be upstream that connects and never finishes its handshake does not stall a stage
# (issue 12: the accept side of the handshake runs in steps inside the stage's event loop).
# A 3-stage ring on a synthesized model answers a set of prompts; then, while the same
# prompts run again, silent peers keep connecting to stage 1 (a new one every 200 ms, each
# holding its socket open for 5 s without sending a byte). Before, stage 1's loop waited up
# to 3 s in each such handshake, frames from stage 0 waited behind it, and the run could not
# finish; now the run gives exactly the tokens it gave undisturbed, stage 0's link is never
# replaced, and stage 1 refuses every silent peer (at the handshake deadline, or as the
# oldest of its handshakes under way when more arrive).
set -euo pipefail
source "$(dirname "$0")/lib.bash"

"$KVASIR" synth --shape tiny --type q8_0 --seed 5 -o "$TMP/tiny.gguf" >/dev/null 2>&1 ||
    fail "synth tiny"
for i in $(seq 0 5); do
    echo "{\"prompt\": \"Once upon a time $i\", \"temperature\": 0.8, \"seed\": $i, \"max_tokens\": 48}"
done >"$TMP/prompts.jsonl"
start_ring "$TMP/tiny.gguf" 3 3 ring
S1=$TMP/ring/stage1.log

run_prompts before
[ -s "$TMP/before.jsonl" ] || fail "no answers"
addr=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['stages'][1]['addr'])" "$RING_PLAN")
ups=$(count "upstream connected from" "$S1")

run_with_silent_peers "$addr"
for p in "${RING_PIDS[@]}"; do kill -0 "$p" 2>/dev/null || fail "a stage process died"; done
[ "$(count "upstream connected from" "$S1")" = "$ups" ] ||
    fail "stage 1 took another upstream (a silent peer cannot authenticate)"
refused=$(count "refused connection from" "$S1")
[ "$refused" -ge 5 ] || { tail "$S1"; fail "stage 1 refused $refused silent peers, expected every one"; }
echo "stage 1 refused $refused silent peers; ok"
