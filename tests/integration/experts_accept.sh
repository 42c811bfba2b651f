#!/usr/bin/env bash
# A would-be stage that connects to an expert agent and never finishes its handshake does
# not stall the agent (issue 11; the accept side of the handshake runs in steps inside the
# agent's event loop, as ring_accept.sh shows for a stage). A 2-stage ring with 2 expert
# agents on a synthesized Qwen3-MoE (16 experts, top-4, Q8_0) answers 12 prompts; then,
# while the same prompts run again, silent peers keep connecting to agent 0 (a new one every
# 200 ms, each holding its socket open for 5 s without sending a byte). Before, the agent's
# loop waited up to 2 s in each such handshake, so each layer's answer waited behind one and
# the run could not finish in its 60 s; now the run gives exactly the undisturbed tokens,
# no stage loses an agent (which would have the stages compute its experts), agent 0 links
# no other stage and refuses every silent peer (at the handshake deadline, or as the oldest
# of its handshakes under way when more arrive).
set -euo pipefail
source "$(dirname "$0")/lib.bash"

"$KVASIR" synth --shape custom --layers 6 --dim 128 --ff 256 --heads 4 --kv-heads 2 \
    --vocab-size 2048 --ctx 512 --type q8_0 --seed 5 --arch qwen3moe --experts 16 \
    --experts-used 4 --expert-ff 128 -o "$TMP/moe.gguf" >"$TMP/synth.log" 2>&1 ||
    { cat "$TMP/synth.log"; fail "synth qwen3moe"; }
mixed_prompts "$TMP/prompts.jsonl"
start_ring "$TMP/moe.gguf" 2 2 ring --experts 2
start_agents 2
A0=$TMP/ring/agent0.log

run_prompts before
[ "$(wc -l <"$TMP/before.jsonl")" = 12 ] || fail "expected 12 answers"
addr=$(python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['experts'][0]['addr'])" "$RING_PLAN")
links=$(count " linked" "$A0")

run_with_silent_peers "$addr"
for p in "${RING_PIDS[@]}" "${AGENT_PIDS[@]}"; do
    kill -0 "$p" 2>/dev/null || fail "a stage or agent process died"
done
[ "$(count " linked" "$A0")" = "$links" ] ||
    fail "agent 0 linked another peer (a silent peer cannot authenticate)"
refused=$(count "refused connection from" "$A0")
[ "$refused" -ge 5 ] || { tail "$A0"; fail "agent 0 refused $refused silent peers, expected every one"; }
echo "agent 0 refused $refused silent peers"
stop_agents 2 "with silent peers" # both computed pairs; no stage lost an agent
echo PASS
