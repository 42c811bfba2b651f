#!/usr/bin/env bash
# Bit-identical tokens on mixture-of-experts models (DESIGN.md 7, 11; issue 11 acceptance
# 2): 12 concurrent sequences with mixed prompt lengths, 6 greedy and 6 sampled with seeds,
# give exactly the same tokens through the single-process engine (each sequence alone, 1
# thread), the single process running all 12 at once (continuous batching, 2 threads), a
# 2-stage ring, and a 2-stage ring whose experts live on 2 expert agents (`kvasir plan
# --experts 2`: each agent half of every layer's experts), each ring drained (1
# micro-batch) and in flight (2), on synthesized Mixtral-style (8 experts, top-2),
# Qwen3-MoE (16 experts, top-4), Qwen2-MoE (8 experts, top-2, a shared expert) and
# deepseek2 (latent attention, 16 experts top-4 in 4 groups of which 2 are used, a shared
# expert, a leading dense layer) models in Q8_0, and gpt-oss (8 experts, top-2, biased
# experts an agent must add, a window of 8) with MXFP4 experts. On Qwen3-MoE also a partial
# placement: agent 0 holds experts 0-5 of layers 0-3, agent 1 experts 8-15 of layers 2-5, the
# stages compute the rest themselves. Every agent
# must have been linked to both stages before the run and have computed pairs in it, and
# no stage may have lost an agent (else the stages computed those pairs themselves).
set -euo pipefail
source "$(dirname "$0")/lib.bash"

mixed_prompts "$TMP/prompts.jsonl"

same() { # same REF OTHER WHAT
    if ! cmp -s "$1" "$2"; then
        diff "$1" "$2" | head -20
        fail "$3 differs from the single process"
    fi
}

# run_agents MODEL TAG MB PLACEMENT: the prompts through 2 stages + 2 agents.
run_agents() {
    local model=$1 tag=$2 mb=$3 placement=$4
    start_ring "$model" 2 "$mb" "$tag-a$placement-$mb" --experts 2
    if [ "$placement" = partial ]; then
        stop_ring
        python3 - "$RING_PLAN" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p["experts"][0]["holds"] = [{"layers": [0, 3], "experts": [0, 5]}]
p["experts"][1]["holds"] = [{"layers": [2, 5], "experts": [8, 15]}]
json.dump(p, open(sys.argv[1], "w"))
PY
        local i
        RING_PIDS=()
        for i in 0 1; do
            "$KVASIR" stage --plan "$RING_PLAN" --index "$i" \
                >"$(dirname "$RING_PLAN")/stage$i.log" 2>&1 &
            PIDS+=($!)
            RING_PIDS+=($!)
        done
    fi
    start_agents 2
    timeout 120 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
        --ignore-eos >"$TMP/$tag.a$placement.$mb.jsonl" 2>"$TMP/$tag.a$placement.$mb.log" ||
        { cat "$TMP/$tag.a$placement.$mb.log"; fail "$tag: 2 stages + 2 agents, $mb micro-batches"; }
    stop_agents 2 "$tag: 2 stages + 2 agents ($placement), $mb micro-batches"
    same "$TMP/$tag.ref.jsonl" "$TMP/$tag.a$placement.$mb.jsonl" \
        "$tag: 2 stages + 2 agents ($placement), $mb micro-batches"
    echo "ok: $tag, 2 stages + 2 expert agents ($placement), $mb micro-batches in flight: 12/12 sequences identical"
}

check_model() {
    local model=$1 tag=$2
    timeout 120 "$KVASIR" run -m "$model" --prompts "$TMP/prompts.jsonl" --json --ignore-eos \
        -t 1 >"$TMP/$tag.ref.jsonl" 2>"$TMP/$tag.ref.log" ||
        { cat "$TMP/$tag.ref.log"; fail "$tag: single-process run"; }
    [ "$(wc -l <"$TMP/$tag.ref.jsonl")" = 12 ] || fail "$tag: expected 12 reference lines"
    timeout 120 "$KVASIR" run -m "$model" --prompts "$TMP/prompts.jsonl" --json --ignore-eos \
        -t 2 --batched --row-width 32 >"$TMP/$tag.batched.jsonl" 2>"$TMP/$tag.batched.log" ||
        { cat "$TMP/$tag.batched.log"; fail "$tag: batched single-process run"; }
    same "$TMP/$tag.ref.jsonl" "$TMP/$tag.batched.jsonl" "$tag: all 12 batched, 2 threads"
    echo "ok: $tag, single process, 12 at once on 2 threads: 12/12 sequences identical"
    for mb in 1 2; do
        start_ring "$model" 2 "$mb" "$tag-2-$mb"
        timeout 120 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
            --ignore-eos >"$TMP/$tag.2.$mb.jsonl" 2>"$TMP/$tag.2.$mb.log" ||
            { cat "$TMP/$tag.2.$mb.log"; fail "$tag: 2-stage ring, $mb micro-batches"; }
        stop_ring
        same "$TMP/$tag.ref.jsonl" "$TMP/$tag.2.$mb.jsonl" "$tag: 2 stages, $mb micro-batches"
        echo "ok: $tag, 2 stages, $mb micro-batches in flight: 12/12 sequences identical"
        run_agents "$model" "$tag" "$mb" halves
        if [ "$tag" = qwen3moe ]; then run_agents "$model" "$tag" "$mb" partial; fi
    done
}

shape=(--shape custom --layers 6 --dim 128 --ff 256 --heads 4 --kv-heads 2 --vocab-size 2048
       --ctx 512 --type q8_0 --seed 5)
for spec in "mixtral|--experts 8 --experts-used 2" \
    "qwen3moe|--experts 16 --experts-used 4 --expert-ff 128" "qwen2moe|--shared-ff 192" \
    "deepseek2|--q-lora 64 --experts 16 --experts-used 4 --expert-ff 128 --shared-experts 1
        --dense-layers 1 --expert-groups 4 --groups-used 2" \
    "gpt-oss|--experts 8 --experts-used 2 --type mxfp4 --swa 8"; do
    arch=${spec%%|*}
    # shellcheck disable=SC2086 # the spec's options
    "$KVASIR" synth "${shape[@]}" --arch "$arch" ${spec#*|} -o "$TMP/$arch.gguf" \
        >"$TMP/synth.log" 2>&1 || { cat "$TMP/synth.log"; fail "synth $arch"; }
    check_model "$TMP/$arch.gguf" "$arch"
done
echo "PASS"
