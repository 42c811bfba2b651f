#!/usr/bin/env bash
# Bit-identical tokens on mixture-of-experts models (DESIGN.md 7, 11; issue 11 acceptance 2
# without expert agents): 12 concurrent sequences with mixed prompt lengths, 6 greedy and 6
# sampled with seeds, give exactly the same tokens through the single-process engine (each
# sequence alone, 1 thread), the single process running all 12 at once (continuous
# batching, 2 threads), and a 2-stage ring, drained (1 micro-batch) and in flight (2), on
# synthesized Mixtral-style (8 experts, top-2), Qwen3-MoE (16 experts, top-4) and Qwen2-MoE
# (8 experts, top-2, a shared expert) models in Q8_0.
set -euo pipefail
source "$(dirname "$0")/lib.bash"

words=(Once upon a time there was a little girl who loved to play in the park with her dog)
for i in $(seq 0 11); do
    n=$(( (i * 5) % 17 + 1 ))
    text="${words[*]:0:$n}"
    if [ $((i % 2)) = 0 ]; then
        echo "{\"prompt\": \"$text\", \"temperature\": 0, \"max_tokens\": $((12 + i))}"
    else
        echo "{\"prompt\": \"$text\", \"temperature\": 0.9, \"top_k\": 40, \"top_p\": 0.95, \"seed\": $((1000 + i)), \"max_tokens\": $((12 + i))}"
    fi
done >"$TMP/prompts.jsonl"

same() { # same REF OTHER WHAT
    if ! cmp -s "$1" "$2"; then
        diff "$1" "$2" | head -20
        fail "$3 differs from the single process"
    fi
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
    done
}

shape=(--shape custom --layers 6 --dim 128 --ff 256 --heads 4 --kv-heads 2 --vocab-size 2048
       --ctx 512 --type q8_0 --seed 5)
for spec in "mixtral|--experts 8 --experts-used 2" \
    "qwen3moe|--experts 16 --experts-used 4 --expert-ff 128" "qwen2moe|--shared-ff 192"; do
    arch=${spec%%|*}
    # shellcheck disable=SC2086 # the spec's options
    "$KVASIR" synth "${shape[@]}" --arch "$arch" ${spec#*|} -o "$TMP/$arch.gguf" \
        >"$TMP/synth.log" 2>&1 || { cat "$TMP/synth.log"; fail "synth $arch"; }
    check_model "$TMP/$arch.gguf" "$arch"
done
echo "PASS"
