#!/usr/bin/env bash
# Resident memory of a stage (issue 14): a 2-stage ring of a synthesized Q8_0 model (about
# 220 MB) serves a few sequences; each stage logs its resident bytes (Rss of
# /proc/self/smaps_rollup) at start and at stop beside the bytes its slice should hold
# (kvr_engine_expected_bytes: weights as the kernels read them, KV cache, scratch). Each
# must be at most 1.1x the expected bytes (one copy of the slice, not the mapped file
# beside a packed copy, nor the other stage's layers read by the fingerprint check) and at
# least 0.8x the weights (the measurement is real; the head's embedding rows are resident
# only once looked up); `kvasir info --plan` prints the same expected bytes. The same for a
# deepseek2 model (latent attention).
set -euo pipefail
source "$(dirname "$0")/lib.bash"

if [ -n "${KVR_SANITIZE:-}" ]; then # its shadow memory and allocator are resident too
    echo "skipped: resident memory means nothing in a $KVR_SANITIZE build"
    exit 77
fi

"$KVASIR" synth --shape custom --layers 8 --dim 1536 --ff 4096 --heads 16 --kv-heads 4 \
    --vocab-size 4096 --type q8_0 --seed 3 -o "$TMP/m.gguf" >/dev/null 2>&1 || fail "synth"
# deepseek2: latent attention (a keys-only cache of 576 values per token).
"$KVASIR" synth --arch deepseek2 --shape custom --layers 8 --dim 1536 --ff 4096 --heads 16 \
    --q-lora 768 --kv-lora 512 --qk-rope 64 --qk-nope 128 --v-head 128 \
    --vocab-size 4096 --type q8_0 --seed 3 -o "$TMP/ds.gguf" >/dev/null 2>&1 || fail "synth ds"
for i in 0 1 2 3; do
    echo "{\"prompt\": \"Once upon a time $i\", \"temperature\": 0, \"max_tokens\": 16}"
done >"$TMP/prompts.jsonl"

check_model() { # check_model MODEL TAG
    start_ring "$1" 2 2 "$2" --max-seqs 4 --ctx 256
    timeout 60 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
        --ignore-eos >"$TMP/out.jsonl" 2>"$TMP/run.log" || { cat "$TMP/run.log"; fail "ring run"; }
    [ "$(wc -l <"$TMP/out.jsonl")" = 4 ] || fail "expected 4 answers"
    stop_ring
    "$KVASIR" info --plan "$RING_PLAN" >"$TMP/info.txt" || fail "kvasir info --plan"
    local i when log line rss exp w
    for i in 0 1; do
        log=$TMP/$2/stage$i.log
        for when in start stop; do
            line=$(grep "stage $i: resident .* at $when; expected" "$log") ||
                { cat "$log"; fail "$2 stage $i logged no resident bytes at $when"; }
            read -r rss exp w <<<"$(sed -E 's/.*resident ([0-9]+) bytes .*expected ([0-9]+) \(weights ([0-9]+),.*/\1 \2 \3/' <<<"$line")"
            echo "$2 stage $i at $when: resident $rss bytes, expected $exp (weights $w): $(awk -v a="$rss" -v b="$exp" 'BEGIN { printf "%.3f", a / b }')x"
            [ "$rss" -gt 0 ] || fail "stage $i: could not read /proc/self/smaps_rollup"
            [ $((rss * 10)) -le $((exp * 11)) ] || fail "$2 stage $i at $when: resident $rss > 1.1 x $exp"
            [ $((rss * 10)) -ge $((w * 8)) ] || fail "$2 stage $i at $when: resident $rss below 0.8 x its weights $w"
            grep -q "stage $i: layers [0-9]*-[0-9]*: $exp bytes" "$TMP/info.txt" ||
                { cat "$TMP/info.txt"; fail "kvasir info --plan does not give stage $i $exp bytes"; }
        done
    done
}
check_model "$TMP/m.gguf" mem
check_model "$TMP/ds.gguf" ds
echo "PASS"
