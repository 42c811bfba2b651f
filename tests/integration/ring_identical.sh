#!/usr/bin/env bash
# Bit-identical tokens (DESIGN.md 7): 12 concurrent sequences with mixed prompt lengths, 6
# greedy and 6 sampled with seeds, give exactly the same tokens through the single-process
# engine (each sequence alone) and through rings of 2, 3 and 5 stages, drained
# (1 micro-batch) and in flight (one per stage), on stories260K and a synthesized ring-45
# with the default f16 KV cache; and on ring-45 with f32 and q8_0 KV caches (3 stages).
set -euo pipefail
source "$(dirname "$0")/lib.bash"

stories=$(need_shared models/stories260K.gguf)
"$KVASIR" synth --shape ring-45 --type q8_0 --seed 7 -o "$TMP/ring45.gguf" >/dev/null 2>&1 ||
    fail "synth ring-45"

mixed_prompts "$TMP/prompts.jsonl"

# check_model MODEL TAG KV_TYPE STAGES...
check_model() {
    local model=$1 tag=$2 kv=$3
    shift 3
    timeout 120 "$KVASIR" run -m "$model" --kv-type "$kv" --prompts "$TMP/prompts.jsonl" --json \
        --ignore-eos -t 1 >"$TMP/$tag.ref.jsonl" 2>"$TMP/$tag.ref.log" || { cat "$TMP/$tag.ref.log"; fail "$tag: single-process run"; }
    [ "$(wc -l <"$TMP/$tag.ref.jsonl")" = 12 ] || fail "$tag: expected 12 reference lines"
    for stages in "$@"; do
        for mb in 1 "$stages"; do
            start_ring "$model" "$stages" "$mb" "$tag-$stages-$mb" --kv-type "$kv"
            grep -q "\"kv_type\": \"$kv\"" "$RING_PLAN" || fail "$tag: the plan does not say kv_type $kv"
            timeout 120 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
                --ignore-eos >"$TMP/$tag.$stages.$mb.jsonl" 2>"$TMP/$tag.$stages.$mb.log" ||
                { cat "$TMP/$tag.$stages.$mb.log"; fail "$tag: ring of $stages stages, $mb micro-batches"; }
            stop_ring
            if ! cmp -s "$TMP/$tag.ref.jsonl" "$TMP/$tag.$stages.$mb.jsonl"; then
                diff "$TMP/$tag.ref.jsonl" "$TMP/$tag.$stages.$mb.jsonl" | head -20
                fail "$tag: ring of $stages stages with $mb micro-batches differs from the single process"
            fi
            echo "ok: $tag, KV $kv, $stages stages, $mb micro-batches in flight: 12/12 sequences identical"
        done
    done
}

check_model "$stories" stories260K f16 2 3 5
check_model "$TMP/ring45.gguf" ring45 f16 2 3 5
check_model "$TMP/ring45.gguf" ring45-f32 f32 3
check_model "$TMP/ring45.gguf" ring45-q8_0 q8_0 3
cmp -s "$TMP/ring45.ref.jsonl" "$TMP/ring45-q8_0.ref.jsonl" &&
    fail "ring45: q8_0 and f16 KV caches gave the same 12 answers (is the type applied?)"
echo "PASS"
