#!/usr/bin/env bash
# Expert agents survive a re-plan (issue 11; docs/EXPERTS.md 2.6, docs/PLAN.md "Plan
# hash"). A qwen3moe ring of 3 stages + 2 expert agents (`kvasir plan --experts 2`) with
# `kvasir bridge --replan-after 2` in front answers four streamed completions (two greedy,
# two sampled with seeds and penalties); then the same four again while the middle stage is
# killed with SIGKILL mid-stream and never started again. The bridge re-plans the ring over
# the two stages left (epoch 1); the agents keep running with the plan they started with,
# and the re-planned stages must link them again (an expert link is bound to the placement,
# not the epoch) and have them compute pairs: without that the stages would compute every
# expert themselves and give the same tokens, so the test counts the agents' pairs on the
# new ring (the bridge's kvasir:expert_pairs_total) and wants no refused handshake. Every
# stream ends with exactly the undisturbed text, and four new requests do too.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/replan_lib.bash"

"$KVASIR" synth --shape custom --arch qwen3moe --experts 16 --experts-used 4 --expert-ff 128 \
    --layers 6 --dim 128 --ff 256 --heads 4 --kv-heads 2 --vocab-size 2048 --ctx 1024 \
    --type q8_0 --seed 5 -o "$TMP/m.gguf" >"$TMP/synth.log" 2>&1 ||
    { cat "$TMP/synth.log"; fail "synth"; }
start_ring "$TMP/m.gguf" 3 3 ring --max-seqs 8 --ctx 1024 --experts 2
start_agents 2
dir=$(dirname "$RING_PLAN")
for j in 0 1; do # start_agents waits for two links; this ring has three stages
    for i in $(seq 100); do
        [ "$(grep -c linked "$dir/agent$j.log")" -ge 3 ] && break
        sleep 0.1
    done
    [ "$(grep -c linked "$dir/agent$j.log")" -ge 3 ] || { cat "$dir/agent$j.log"; fail "agent $j did not link all three stages"; }
done
start_bridge
pairs() { # the pairs agent J computed, as the bridge counts them
    curl -s -m 2 "$URL/metrics" | awk -v n="kvasir:expert_pairs_total{agent=\"$1\"}" '{sub(/model_name="[^"]*",?/, ""); sub(/[{][}]/, "")} $1 == n {print $2}'
}

pass ref
for i in 0 1 2 3; do
    [ "$(wc -c <"$TMP/http.ref.$i")" -gt $((N_TOKENS / 2)) ] || fail "ref: stream $i carried almost no text"
done
echo "ok: undisturbed: 4 streams recorded; agent pairs $(pairs 0) / $(pairs 1)"
links0=$(grep -c linked "$dir/agent0.log")
links1=$(grep -c linked "$dir/agent1.log")

pass dis 1
same dis
held_and_replanned dis 2
for i in 0 2; do
    grep -q "re-planned by the bridge: epoch 1, 2 stages" "$dir/stage$i.log" ||
        fail "stage $i was not re-planned"
done
echo "ok: dis: 4/4 streams identical across the re-plan ($(grep -m1 "re-planned the ring" "$TMP/bridge.log" | sed 's/^\[[^]]*\] *//'))"

# Both re-planned stages link both agents again (the agents' plans are still epoch 0).
for j in 0 1; do
    before=$([ $j = 0 ] && echo "$links0" || echo "$links1")
    for i in $(seq 100); do
        [ "$(grep -c linked "$dir/agent$j.log")" -ge $((before + 2)) ] && break
        sleep 0.1
    done
    [ "$(grep -c linked "$dir/agent$j.log")" -ge $((before + 2)) ] ||
        { tail -20 "$dir/agent$j.log"; grep -h "expert agent" "$dir"/stage*.log | tail; fail "agent $j was not linked by both re-planned stages"; }
done
# (Ring links between a stage still at epoch 0 and one at epoch 1 are refused for their
# plan hash while the ring re-forms, as they must be; expert links never.)
! grep -h "plan hash" "$dir"/agent*.log || fail "an agent refused a handshake for its plan hash"
! grep -h "expert agent.*plan hash" "$dir"/stage0.log "$dir"/stage2.log ||
    fail "a stage's link to an agent was refused for its plan hash"

p0=$(pairs 0)
p1=$(pairs 1)
pass new
same new
q0=$(pairs 0)
q1=$(pairs 1)
awk -v a="$p0" -v b="$q0" -v c="$p1" -v d="$q1" 'BEGIN {
    printf "ok: new: 4/4 new requests identical on the re-planned ring; the agents computed %d and %d pairs in them\n", b - a, d - c
    exit !(b > a && d > c) }' || fail "new: the agents computed no pairs on the re-planned ring"
! grep -h "expert agent .* lost" "$dir"/stage0.log "$dir"/stage2.log || fail "a stage lost an agent"
echo PASS
