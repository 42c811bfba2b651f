#!/usr/bin/env bash
# Sealed links (issue 13, acceptance 1). A 2-stage ring with the default plan ("encrypt":
# true) answers a set of prompts; a rogue peer (tests/tools/kvr_rogue.c) that has the plan
# and the secret, and so passes the handshake, sends stage 1 a sealed frame with one byte of
# its body flipped, as an attacker on the path would: stage 1 must close the link and log
# that the frame failed authentication. The ring then heals (stage 0 reconnects) and gives
# the same tokens. Finally the same prompts through a ring with "encrypt": false give
# exactly the same tokens.
set -euo pipefail
source "$(dirname "$0")/lib.bash"

ROGUE=${KVR_ROGUE:-${KVR_BUILD:-$(dirname "$KVASIR")}/kvr_rogue}
[ -x "$ROGUE" ] || fail "rogue peer not built: $ROGUE"

"$KVASIR" synth --shape tiny --type q8_0 --seed 13 -o "$TMP/tiny.gguf" >/dev/null 2>&1 ||
    fail "synth tiny"
for i in $(seq 0 5); do
    if [ $((i % 2)) = 0 ]; then
        echo "{\"prompt\": \"The ring $i\", \"temperature\": 0, \"max_tokens\": 20}"
    else
        echo "{\"prompt\": \"The ring $i\", \"temperature\": 0.9, \"seed\": $i, \"max_tokens\": 20}"
    fi
done >"$TMP/prompts.jsonl"

run_ring() { # run_ring TAG: the prompts through the ring, tokens to $TMP/TAG.jsonl
    timeout 60 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
        --ignore-eos >"$TMP/$1.jsonl" 2>"$TMP/$1.log" || { cat "$TMP/$1.log"; fail "$1: ring run"; }
    [ "$(wc -l <"$TMP/$1.jsonl")" = 6 ] || fail "$1: expected 6 answers"
}

start_ring "$TMP/tiny.gguf" 2 2 sealed
grep -q '"encrypt": true' "$RING_PLAN" || fail "kvasir plan did not write \"encrypt\": true"
S1=$TMP/sealed/stage1.log
run_ring sealed
echo "ok: sealed ring answers"

n=$(count "failed authentication" "$S1")
set +e; out=$("$ROGUE" --plan "$RING_PLAN" --as 0 --send flipped --wait-ms 5000 2>&1); rc=$?; set -e
echo "$out" | sed 's/^/  rogue: /'
[ $rc = 0 ] || fail "the receiver did not close the link on a flipped byte (rogue exit $rc)"
for _ in $(seq 50); do [ "$(count "failed authentication" "$S1")" -gt "$n" ] && break; sleep 0.1; done
[ "$(count "failed authentication" "$S1")" -gt "$n" ] || { cat "$S1"; fail "stage 1 logged no reason"; }
echo "ok: refused: $(grep "failed authentication" "$S1" | tail -1)"
for p in "${RING_PIDS[@]}"; do kill -0 "$p" 2>/dev/null || fail "a stage process died"; done
run_ring sealed_again
cmp -s "$TMP/sealed.jsonl" "$TMP/sealed_again.jsonl" || fail "tokens changed after the attack"
echo "ok: the ring healed and gives the same tokens"
stop_ring

start_ring "$TMP/tiny.gguf" 2 2 plain --no-encrypt
grep -q '"encrypt": false' "$RING_PLAN" || fail "--no-encrypt did not write \"encrypt\": false"
run_ring plain
cmp -s "$TMP/sealed.jsonl" "$TMP/plain.jsonl" ||
    { diff "$TMP/sealed.jsonl" "$TMP/plain.jsonl" | head; fail "tokens differ with and without encryption"; }
echo "ok: tokens identical with and without encryption"
echo PASS
