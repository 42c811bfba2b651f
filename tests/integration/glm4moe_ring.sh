#!/usr/bin/env bash
# Bit-identical tokens on glm4moe (issue 35, acceptance 3; DESIGN.md 7, 11): 12 concurrent
# sequences of mixed prompt lengths (6 greedy, 6 sampled with seeds) give exactly the same
# tokens through the single-process engine (each sequence alone, 1 thread), the single
# process running all 12 at once (2 threads), a 3-stage ring in flight, and 2 stages whose
# routed experts live on 2 expert agents (`kvasir plan --experts 2`), drained and in flight.
# The model (Q8_0, 6 layers + 1 NextN block, the first layer dense, 16 experts top-4 in 4
# groups of which 2 are used, sigmoid routing with the selection bias, an ungated shared
# expert, q/k norms, RoPE on half of each head) exercises every routing piece; the agents
# hold the dense layer's range too and must skip it. The plan covers the 6 layers that run
# and not the NextN block.
set -euo pipefail
source "$(dirname "$0")/lib.bash"

mixed_prompts "$TMP/prompts.jsonl"
model=$TMP/glm4moe.gguf
"$KVASIR" synth --arch glm4moe --shape custom --layers 6 --dim 128 --ff 256 --heads 4 \
    --kv-heads 2 --vocab-size 2048 --ctx 512 --type q8_0 --seed 5 --experts 16 \
    --experts-used 4 --expert-ff 128 --expert-groups 4 --groups-used 2 --qk-norm \
    --expert-scale 2.5 -o "$model" >"$TMP/synth.log" 2>&1 ||
    { cat "$TMP/synth.log"; fail "synth glm4moe"; }

same() { # same OTHER WHAT
    if ! cmp -s "$TMP/ref.jsonl" "$1"; then
        diff "$TMP/ref.jsonl" "$1" | head -20
        fail "$2 differs from the single process"
    fi
}

timeout 120 "$KVASIR" run -m "$model" --prompts "$TMP/prompts.jsonl" --json --ignore-eos \
    -t 1 >"$TMP/ref.jsonl" 2>"$TMP/ref.log" || { cat "$TMP/ref.log"; fail "single-process run"; }
[ "$(wc -l <"$TMP/ref.jsonl")" = 12 ] || fail "expected 12 reference lines"
timeout 120 "$KVASIR" run -m "$model" --prompts "$TMP/prompts.jsonl" --json --ignore-eos \
    -t 2 --batched --row-width 32 >"$TMP/batched.jsonl" 2>"$TMP/batched.log" ||
    { cat "$TMP/batched.log"; fail "batched single-process run"; }
same "$TMP/batched.jsonl" "all 12 batched, 2 threads"
echo "ok: glm4moe, single process, 12 at once on 2 threads: 12/12 sequences identical"

start_ring "$model" 3 3 ring3
last=$(python3 -c 'import json, sys
print(json.load(open(sys.argv[1]))["stages"][-1]["layers"][1])' "$RING_PLAN")
[ "$last" = 5 ] || fail "the plan's last layer is $last; the model runs layers 0-5 (6 is NextN)"
timeout 120 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
    --ignore-eos >"$TMP/ring3.jsonl" 2>"$TMP/ring3.log" ||
    { cat "$TMP/ring3.log"; fail "3-stage ring"; }
stop_ring
same "$TMP/ring3.jsonl" "3 stages, 3 micro-batches"
echo "ok: glm4moe, 3 stages (the plan ends at layer 5), 3 micro-batches: 12/12 sequences identical"

for mb in 1 2; do
    start_ring "$model" 2 "$mb" "agents-$mb" --experts 2
    start_agents 2
    timeout 120 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
        --ignore-eos >"$TMP/agents.$mb.jsonl" 2>"$TMP/agents.$mb.log" ||
        { cat "$TMP/agents.$mb.log"; fail "2 stages + 2 agents, $mb micro-batches"; }
    stop_agents 2 "2 stages + 2 agents, $mb micro-batches"
    same "$TMP/agents.$mb.jsonl" "2 stages + 2 agents, $mb micro-batches"
    echo "ok: glm4moe, 2 stages + 2 expert agents, $mb micro-batches in flight: 12/12 sequences identical"
done
echo "PASS"
