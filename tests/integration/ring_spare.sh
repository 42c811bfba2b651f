#!/usr/bin/env bash
# A spare stage takes the slice of a stage that never comes back (issue 13; docs/PLAN.md
# "Spare stages"). A 3-stage ring whose plan names two spares, with `kvasir bridge
# --replan-after 2` in front, answers four streamed completions (two greedy, two sampled
# with seeds and penalties) undisturbed; then the same four again while the middle stage is
# killed with SIGKILL mid-stream and never started again. Within the grace period plus 10 s
# the ring runs on 3 stages again: the spare in the lost stage's place with exactly its
# layers (loaded from its own copy of the model), the survivors with the layers they had;
# every stream completes with exactly the undisturbed text, and new requests are answered
# identically too. The second spare, not needed, follows the new plan as its spare 0 (so a
# later loss could take it).
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/replan_lib.bash"

"$KVASIR" synth --shape custom --layers 12 --dim 256 --ff 768 --heads 8 --kv-heads 4 \
    --type q8_0 --seed 7 -o "$TMP/m.gguf" >/dev/null 2>&1 || fail "synth"

# The ring: a plan of 3 stages plus two spares on the ports after them; every process started.
D=$TMP/ring
mkdir -p "$D"
for attempt in 1 2 3 4 5; do
    base=$(reserve_base_port)
    "$KVASIR" plan -m "$TMP/m.gguf" --stages 3 --microbatches 3 --base-port "$base" \
        --max-seqs 8 --ctx 512 -o "$D/plan.json" 2>/dev/null || fail "kvasir plan failed"
    python3 - "$D/plan.json" "127.0.0.1:$((base + 3))" "127.0.0.1:$((base + 4))" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p["spares"] = [{"addr": a} for a in sys.argv[2:]]
json.dump(p, open(sys.argv[1], "w"), indent=2)
PY
    RING_PIDS=()
    for i in 0 1 2; do
        "$KVASIR" stage --plan "$D/plan.json" --index "$i" >"$D/stage$i.log" 2>&1 &
        PIDS+=($!)
        RING_PIDS+=($!)
    done
    SPARES=()
    for j in 0 1; do
        "$KVASIR" stage --plan "$D/plan.json" --spare $j >"$D/spare$j.log" 2>&1 &
        PIDS+=($!)
        SPARES+=($!)
    done
    sleep 0.3
    ok=1
    for p in "${RING_PIDS[@]}" "${SPARES[@]}"; do kill -0 "$p" 2>/dev/null || ok=0; done
    [ $ok = 1 ] && break
    for p in "${RING_PIDS[@]}" "${SPARES[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${RING_PIDS[@]}" "${SPARES[@]}"; do wait "$p" 2>/dev/null || true; done
    [ $attempt = 5 ] && fail "could not start the ring and its spare"
done
for j in 0 1; do
    for i in $(seq 1 100); do
        grep -q "spare $j: listening on 127.0.0.1:$((base + 3 + j))" "$D/spare$j.log" && break
        sleep 0.1
    done
    grep -q "spare $j: listening on" "$D/spare$j.log" || { cat "$D/spare$j.log"; fail "spare $j is not listening"; }
done
layers() { python3 -c "import json; s = json.load(open('$D/plan.json'))['stages'][$1]['layers']; print('%d-%d' % tuple(s))"; }
L0=$(layers 0) L1=$(layers 1) L2=$(layers 2)

RING_PLAN=$D/plan.json
start_bridge

pass ref
for i in 0 1 2 3; do
    [ "$(wc -c <"$TMP/http.ref.$i")" -gt $((N_TOKENS / 2)) ] || fail "ref: stream $i carried almost no text"
done
cmp -s "$TMP/http.ref.0" "$TMP/http.ref.2" && fail "ref: two prompts gave the same text"
echo "ok: undisturbed: 4 streams recorded (layers $L0, $L1, $L2; two spares waiting)"

pass dis 1
same dis
held_and_replanned dis 3
grep -q "2 of 3 stages kept, 1 spare taken, 4 acknowledged" "$TMP/bridge.log" ||
    { tail -30 "$TMP/bridge.log"; fail "dis: the bridge did not take the spare"; }
whole=$(grep "ring whole again" "$TMP/bridge.log" | tail -1) || fail "dis: no recovery logged"
echo "  $(grep -m1 "spare taken" "$TMP/bridge.log")"
echo "  $whole"
awk -v a="$T_KILL" -v b="$(log_ts "$whole")" -v g="$GRACE_S" 'BEGIN {
    d = b - a; printf "ok: dis: 4/4 streams identical; the ring ran on 3 stages with the spare %.1f s after the kill (grace %d s + 10 s allowed)\n", d, g
    exit !(d > 0 && d <= g + 10) }' || fail "dis: the ring was not whole within the grace period + 10 s"
grep -q "taken into the ring by the bridge: epoch 1, 3 stages, this one is stage 1 with layers $L1\$" "$D/spare0.log" ||
    { cat "$D/spare0.log"; fail "the spare did not take stage 1's layers $L1"; }
grep -q "re-planned by the bridge: epoch 1, 3 stages, this one is stage 0 with layers $L0;" "$D/stage0.log" ||
    fail "stage 0 did not keep its layers $L0"
grep -q "re-planned by the bridge: epoch 1, 3 stages, this one is stage 2 with layers $L2;" "$D/stage2.log" ||
    fail "stage 2 did not keep its layers $L2"
grep -q "spare 1: follows the re-plan to epoch 1 (3 stages) as spare 0" "$D/spare1.log" ||
    { cat "$D/spare1.log"; fail "the spare not taken did not follow the new plan"; }
grep -q "taken into the ring" "$D/spare1.log" && fail "the second spare was taken too"
echo "ok: the spare not needed follows epoch 1 as its spare 0"
curl -s -m 5 "$URL/health" | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["ring"] == "up", d
st = d["stages"]
want = ["'"$L0"'", "'"$L1"'", "'"$L2"'"]
assert len(st) == 3 and all(s["up"] for s in st), st
assert ["%d-%d" % tuple(s["layers"]) for s in st] == want, st
print("ok: /health: 3 stages up with the layers of the first plan")' || fail "/health after the spare stepped in"

pass new
same new
echo "ok: new: 4/4 new requests on the ring with the spare identical to the undisturbed run"
echo PASS
