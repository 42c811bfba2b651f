#!/usr/bin/env bash
# Rejections against a live ring (issue 3, acceptance 2). A 3-stage ring on a synthesized
# model answers a set of prompts; then a rogue peer (tests/tools/kvr_rogue.c) attacks the
# middle stage, stage 1:
#   a. a peer with another plan (different hash)       -> refused, "plan hash" logged
#   b. a peer with the wrong cluster secret            -> refused, "wrong cluster secret?"
#   c. an authenticated peer posing as stage 0 sends a frame longer than the plan allows
#      (more rows than row_width)                      -> link closed, the limit named
#   d. the same with a truncated frame                 -> link closed, the cut named
# After each: every stage process is alive, stage 0's real link is (again) up, and the
# same prompts give exactly the tokens they gave before the attacks. In (c) and (d) the
# rogue authenticated, so stage 1 took it as its new upstream and dropped stage 0's link:
# stage 0 notices and reconnects by itself, and the time that takes is printed.
# Finally, bad plans: one stage, a gap, an overlap are refused by `kvasir plan` and
# `kvasir stage` with a clear message and a non-zero exit (not a crash).
set -euo pipefail
source "$(dirname "$0")/lib.bash"

ROGUE=${KVR_ROGUE:-${KVR_BUILD:-$(dirname "$KVASIR")}/kvr_rogue}
[ -x "$ROGUE" ] || fail "rogue peer not built: $ROGUE"

"$KVASIR" synth --shape tiny --type q8_0 --seed 5 -o "$TMP/tiny.gguf" >/dev/null 2>&1 ||
    fail "synth tiny"
for i in $(seq 0 5); do
    if [ $((i % 2)) = 0 ]; then
        echo "{\"prompt\": \"Once upon a time $i\", \"temperature\": 0, \"max_tokens\": 24}"
    else
        echo "{\"prompt\": \"Once upon a time $i\", \"temperature\": 0.8, \"seed\": $i, \"max_tokens\": 24}"
    fi
done >"$TMP/prompts.jsonl"

start_ring "$TMP/tiny.gguf" 3 3 ring
S0=$TMP/ring/stage0.log S1=$TMP/ring/stage1.log

run_ring() { # run_ring TAG: the prompts through the ring, tokens to $TMP/TAG.jsonl
    timeout 60 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
        --ignore-eos >"$TMP/$1.jsonl" 2>"$TMP/$1.log" || { cat "$TMP/$1.log"; fail "$1: ring run"; }
}
all_alive() {
    local p
    for p in "${RING_PIDS[@]}"; do kill -0 "$p" 2>/dev/null || fail "$1: a stage process died"; done
}
same_tokens() {
    run_ring "$1"
    cmp -s "$TMP/before.jsonl" "$TMP/$1.jsonl" ||
        { diff "$TMP/before.jsonl" "$TMP/$1.jsonl" | head; fail "$1: tokens differ from before"; }
}
# wait_for PATTERN FILE N TIMEOUT_S: until FILE has more than N lines matching; prints ms.
wait_for() {
    local t0 now
    t0=$(date +%s%N)
    while [ "$(count "$1" "$2")" -le "$3" ]; do
        now=$(date +%s%N)
        [ $(( (now - t0) / 1000000 )) -lt $(( $4 * 1000 )) ] || return 1
        sleep 0.05
    done
    echo $(( ($(date +%s%N) - t0) / 1000000 ))
}

run_ring before
[ "$(wc -l <"$TMP/before.jsonl")" = 6 ] || fail "expected 6 answers"
echo "ok: ring answers; reference tokens recorded"

python3 - "$RING_PLAN" "$TMP" <<'EOF'
import json, sys
import os
plan, tmp = json.load(open(sys.argv[1])), sys.argv[2]
# The plans below live in another folder: their secret file by its absolute path.
plan["secret_file"] = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])),
                                   plan["secret_file"])
other = dict(plan, max_seqs=plan["max_seqs"] // 2)            # same stages, other hash
json.dump(other, open(tmp + "/other_plan.json", "w"))
wrong = {k: v for k, v in plan.items() if k != "secret_file"}
wrong["secret"] = "5a" * 32                                     # same hash, other secret
json.dump(wrong, open(tmp + "/wrong_secret.json", "w"))
EOF

# a. another plan hash
n=$(count "plan hash" "$S1")
set +e; out=$("$ROGUE" --plan "$TMP/other_plan.json" --as 0 2>&1); rc=$?; set -e
[ $rc = 3 ] || { echo "$out"; fail "a: the rogue with another plan was not refused (exit $rc)"; }
wait_for "plan hash" "$S1" "$n" 5 >/dev/null || fail "a: stage 1 did not log the plan hash"
grep "plan hash" "$S1" | tail -1
all_alive a
same_tokens a
echo "ok: a. other plan hash refused; ring intact"

# b. wrong secret
n=$(count "wrong cluster secret?" "$S1")
set +e; out=$("$ROGUE" --plan "$TMP/wrong_secret.json" --as 0 2>&1); rc=$?; set -e
[ $rc = 3 ] || { echo "$out"; fail "b: the rogue with the wrong secret was not refused (exit $rc)"; }
wait_for "wrong cluster secret?" "$S1" "$n" 5 >/dev/null || fail "b: stage 1 did not log it"
grep "wrong cluster secret?" "$S1" | tail -1
all_alive b
same_tokens b
echo "ok: b. wrong secret refused; ring intact"

# attack TAG MODE PATTERN: an authenticated rogue as stage 0 sends a bad frame; stage 1
# must log PATTERN, and stage 0 must reconnect by itself.
attack() {
    local tag=$1 mode=$2 pattern=$3 n_bad n_up out rc ms
    n_bad=$(count "$pattern" "$S1")
    n_up=$(count "downstream .* connected" "$S0")
    # Stage 0 is paused while the rogue holds its place: it redials at once when stage 1
    # takes the rogue as its new upstream, and would replace the rogue before its frame is
    # read.
    kill -STOP "${RING_PIDS[0]}"
    set +e; out=$("$ROGUE" --plan "$RING_PLAN" --as 0 --send "$mode" 2>&1); rc=$?; set -e
    echo "$out" | grep -v '^\[' || true
    [ $rc = 0 ] || { kill -CONT "${RING_PIDS[0]}"; fail "$tag: rogue exit $rc"; }
    wait_for "$pattern" "$S1" "$n_bad" 5 >/dev/null ||
        { kill -CONT "${RING_PIDS[0]}"; fail "$tag: stage 1 did not log '$pattern'"; }
    kill -CONT "${RING_PIDS[0]}"
    grep -- "$pattern" "$S1" | tail -1
    ms=$(wait_for "downstream .* connected" "$S0" "$n_up" 10) ||
        fail "$tag: stage 0 did not reconnect to stage 1 within 10 s"
    echo "$tag: stage 0 reconnected to stage 1 $ms ms after the attack"
    all_alive "$tag"
    same_tokens "$tag"
}

# c. a frame longer than the plan allows
attack c oversized "the plan's row_width is"
echo "ok: c. oversized frame closed the link with the limit named; ring recovered"

# d. a truncated frame
attack d truncated "closed the connection inside a BATCH frame"
echo "ok: d. truncated frame closed the link; ring recovered"
stop_ring

# Bad plans: refused with the rule named, exit status 1 (a crash would be >= 128).
python3 - "$RING_PLAN" "$TMP" <<'EOF'
import json, os, sys
plan, tmp = json.load(open(sys.argv[1])), sys.argv[2]
plan["secret_file"] = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])),
                                   plan["secret_file"])
n_layer = plan["stages"][-1]["layers"][1] + 1
one = dict(plan, stages=[{"addr": plan["stages"][0]["addr"], "layers": [0, n_layer - 1]}])
json.dump(one, open(tmp + "/one_stage.json", "w"))
gap = json.loads(json.dumps(plan))
gap["stages"][1]["layers"][0] += 1
json.dump(gap, open(tmp + "/gap.json", "w"))
over = json.loads(json.dumps(plan))
over["stages"][1]["layers"][0] -= 1
json.dump(over, open(tmp + "/overlap.json", "w"))
EOF
# refuse TAG PATTERN CMD...: CMD exits 1 and prints PATTERN.
refuse() {
    local tag=$1 pattern=$2 rc
    shift 2
    set +e; timeout 30 "$@" >"$TMP/$tag.out" 2>&1; rc=$?; set -e
    [ $rc = 1 ] || { cat "$TMP/$tag.out"; fail "$tag: exit $rc, expected 1"; }
    grep -q -- "$pattern" "$TMP/$tag.out" || { cat "$TMP/$tag.out"; fail "$tag: no '$pattern'"; }
    echo "ok: $tag: $(grep -- "$pattern" "$TMP/$tag.out" | head -1)"
}
refuse "stage, one-stage plan" "at least two stages" \
    "$KVASIR" stage --plan "$TMP/one_stage.json" --index 0
refuse "stage, gap" "not assigned to any stage" "$KVASIR" stage --plan "$TMP/gap.json" --index 1
refuse "stage, overlap" "overlap on layers" "$KVASIR" stage --plan "$TMP/overlap.json" --index 1
refuse "run, one-stage plan" "at least two stages" \
    "$KVASIR" run --plan "$TMP/one_stage.json" -p hi -n 1
refuse "plan, one stage" "at least two stages" \
    "$KVASIR" plan -m "$TMP/tiny.gguf" --stages 1 -o "$TMP/p1.json"
refuse "plan, gap" "not assigned to any stage" \
    "$KVASIR" plan -m "$TMP/tiny.gguf" --stages 3 --layers 0-0,2-2,3-3 -o "$TMP/p2.json"
refuse "plan, overlap" "overlap on layers" \
    "$KVASIR" plan -m "$TMP/tiny.gguf" --stages 3 --layers 0-1,1-2,3-3 -o "$TMP/p3.json"
echo PASS
