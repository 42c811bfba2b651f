#!/usr/bin/env bash
# Telemetry tells the truth (DESIGN.md 5): with one stage holding twice the layers of the
# others, the slow stage shows the highest held fraction and the stage before it shows
# blocked time; with a single sequence every stage is mostly starved.
set -euo pipefail
source "$(dirname "$0")/lib.bash"

"$KVASIR" synth --shape ring-45 --type q8_0 --seed 3 -o "$TMP/ring45.gguf" >/dev/null 2>&1 ||
    fail "synth ring-45"

# frac LOG STAGE FIELD: the percentage kvasir run printed for that stage (held/starved/blocked).
frac() { sed -n "s/^  stage $2: .*$3 *\([0-9.]*\)%.*/\1/p" "$1"; }
gt() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a > b) }'; }

# 1. Uneven: 11 + 23 + 11 layers, six micro-batches in flight, 32 sequences.
for i in $(seq 0 31); do
    echo "{\"prompt\": \"The little robot number $i went to\", \"max_tokens\": 40, \"temperature\": 0}"
done >"$TMP/many.jsonl"
start_ring "$TMP/ring45.gguf" 3 6 uneven --layers 0-10,11-33,34-44 --max-seqs 32 --ctx 128
timeout 300 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/many.jsonl" --ignore-eos -q \
    --json >/dev/null 2>"$TMP/uneven.log" || { cat "$TMP/uneven.log"; fail "uneven ring run"; }
stop_ring
grep -E "^(ring|  stage)" "$TMP/uneven.log"
h0=$(frac "$TMP/uneven.log" 0 held) h1=$(frac "$TMP/uneven.log" 1 held) h2=$(frac "$TMP/uneven.log" 2 held)
b0=$(frac "$TMP/uneven.log" 0 blocked) b1=$(frac "$TMP/uneven.log" 1 blocked)
gt "$h1" "$h0" && gt "$h1" "$h2" || fail "the slow stage 1 (held $h1%) is not the most held (stage 0 $h0%, stage 2 $h2%)"
gt "$b0" 5 || fail "stage 0, before the slow stage, shows only $b0% blocked"
gt "$b0" "$b1" || fail "stage 0 blocked ($b0%) should exceed the slow stage's ($b1%)"
echo "ok: slow stage held $h1% (others $h0%, $h2%); stage before it blocked $b0%"

# 2. One sequence through four even stages: everyone waits for everyone.
echo '{"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0}' >"$TMP/one.jsonl"
start_ring "$TMP/ring45.gguf" 4 4 single --max-seqs 4 --ctx 128
timeout 300 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/one.jsonl" --ignore-eos -q \
    --json >/dev/null 2>"$TMP/single.log" || { cat "$TMP/single.log"; fail "single-sequence run"; }
stop_ring
grep -E "^(ring|  stage)" "$TMP/single.log"
for s in 0 1 2 3; do
    st=$(frac "$TMP/single.log" $s starved)
    gt "$st" 50 || fail "stage $s is starved only $st% with one sequence"
done
echo "ok: with one sequence every stage is mostly starved"
echo PASS
