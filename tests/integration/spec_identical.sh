#!/usr/bin/env bash
# Speculation changes no token (issue 37, acceptance 1): the same answers with `--spec off`
# and `--spec auto` through rings of 2 and 3 stages (stories260K, whose stories repeat
# themselves, so prompt lookup and the suffix source draft) and a 2-stage MoE ring with 2
# expert agents (a synthesized Qwen3-MoE), each prompt alone and the 12 mixed prompts at
# once, 6 greedy and 6 sampled with seeds; drafts must have gone out and some been kept.
# Then over HTTP (`kvasir serve`, 2 stages): a greedy completion with no prediction, with
# the true answer as its prediction (most drafts kept: the prediction counters say so),
# and with a prediction whose second half is wrong: the same text each time, and the same
# as the server with --spec off; a seeded sampled completion is the same across runs.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

stories=$(need_shared models/stories260K.gguf)
"$KVASIR" synth --arch qwen3moe --shape tiny --type q8_0 --seed 5 -o "$TMP/moe.gguf" \
    >/dev/null 2>&1 || fail "synth qwen3moe"
mixed_prompts "$TMP/mixed.jsonl"
head -1 "$TMP/mixed.jsonl" >"$TMP/alone-greedy.jsonl"
sed -n 2p "$TMP/mixed.jsonl" >"$TMP/alone-sampled.jsonl"

# run_set TAG PROMPTS: the prompts with speculation off and on, through $RING_PLAN.
run_set() {
    local tag=$1 prompts=$2 mode
    for mode in off auto; do
        timeout 120 "$KVASIR" run --plan "$RING_PLAN" --prompts "$prompts" --json --ignore-eos \
            --spec "$mode" >"$TMP/$tag.$mode.jsonl" 2>"$TMP/$tag.$mode.log" ||
            { cat "$TMP/$tag.$mode.log"; fail "$tag: run with --spec $mode"; }
    done
    grep -q "speculation" "$TMP/$tag.off.log" && fail "$tag: drafts went out with --spec off"
    if ! cmp -s "$TMP/$tag.off.jsonl" "$TMP/$tag.auto.jsonl"; then
        diff "$TMP/$tag.off.jsonl" "$TMP/$tag.auto.jsonl" | head -20
        fail "$tag: answers differ with speculation"
    fi
    echo "ok: $tag: $(wc -l <"$TMP/$tag.off.jsonl") answers identical with --spec off and auto"
    grep "speculation" "$TMP/$tag.auto.log" || true
}

# kept LOGS...: drafted tokens the tail kept, summed over the runs' logs.
kept() { cat "$@" | sed -n 's/.*speculation.* \([0-9]*\) kept$/\1/p' | awk '{s += $1} END {print s + 0}'; }

for stages in 2 3; do
    start_ring "$stories" "$stages" "$stages" "stories-$stages"
    for set in alone-greedy alone-sampled mixed; do
        run_set "stories-$stages-$set" "$TMP/$set.jsonl"
    done
    stop_ring
done
[ "$(kept "$TMP"/stories-*.auto.log)" -gt 0 ] || fail "stories260K: no drafted token was kept"

start_ring "$TMP/moe.gguf" 2 2 moe --experts 2
start_agents 2
for set in alone-greedy mixed; do
    run_set "moe-$set" "$TMP/$set.jsonl"
done
stop_agents 2 "moe ring"

# Over HTTP, with predictions.
complete() { # complete BODY: the completion's text as JSON
    curl -s -m 60 "$SERVE_URL/v1/completions" -H 'Content-Type: application/json' -d "$1" |
        python3 -c 'import json, sys; d = json.load(sys.stdin); print(json.dumps(d["choices"][0]["text"]))'
}
body() { # body PREDICTION_JSON_OR_EMPTY [SAMPLING]
    local pred=""
    [ -n "$1" ] && pred=", \"prediction\": {\"type\": \"content\", \"content\": $1}"
    echo "{\"prompt\": \"Once upon a time, there was a little\", \"max_tokens\": 64${2:-, \"temperature\": 0}$pred}"
}
# Under a JSON schema the tail masks every drafted row with the grammar's state after the
# rows before it (ring/step_grammar.h): the same text as one token per lap.
schema=', "temperature": 0, "json_schema": {"type": "array", "minItems": 4, "items": {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}}'
start_serve off "$stories" --stages 2 --spec off
want=$(complete "$(body "")")
sampled_off=$(complete "$(body "" ', "temperature": 0.9, "seed": 7')")
json_off=$(complete "$(body "" "$schema")")
stop_serve
start_serve auto "$stories" --stages 2 --spec auto
[ "$(complete "$(body "")")" = "$want" ] || fail "HTTP: greedy text differs with --spec auto"
before=$(curl -s "$SERVE_URL/metrics" | sed -n 's/^kvasir:spec_decode_num_accepted_tokens_total{.*source="prediction"} //p')
got=$(complete "$(body "$want")")
[ "$got" = "$want" ] || fail "HTTP: the true prediction changed the text: $got vs $want"
after=$(curl -s "$SERVE_URL/metrics" | sed -n 's/^kvasir:spec_decode_num_accepted_tokens_total{.*source="prediction"} //p')
[ $((after - before)) -ge 20 ] || fail "HTTP: only $((after - before)) predicted tokens kept"
half=$(python3 -c 'import json, sys; t = json.loads(sys.argv[1]); n = len(t) // 2; print(json.dumps(t[:n] + t[n:].upper()))' "$want")
[ "$(complete "$(body "$half")")" = "$want" ] || fail "HTTP: a half-wrong prediction changed the text"
for i in 1 2; do
    [ "$(complete "$(body "" ', "temperature": 0.9, "seed": 7')")" = "$sampled_off" ] ||
        fail "HTTP: seeded sampled text differs with speculation (run $i)"
done
[ "$(complete "$(body "" "$schema")")" = "$json_off" ] || fail "HTTP: text under a schema differs with --spec auto"
before=$(curl -s "$SERVE_URL/metrics" | sed -n 's/^kvasir:spec_decode_num_accepted_tokens_total{.*source="prediction"} //p')
got=$(complete "$(body "$json_off" "$schema")")
[ "$got" = "$json_off" ] || fail "HTTP: under a schema, the true prediction changed the text: $got vs $json_off"
after=$(curl -s "$SERVE_URL/metrics" | sed -n 's/^kvasir:spec_decode_num_accepted_tokens_total{.*source="prediction"} //p')
[ $((after - before)) -ge 10 ] || fail "HTTP: under a schema, only $((after - before)) predicted tokens kept"
echo "ok: HTTP: under a JSON schema, drafts ($((after - before)) predicted tokens kept) leave the text as it was"
grep -q "spec_accepted_tokens=" "$SERVE_LOG" || fail "HTTP: no spec counts in the access log"
echo "ok: HTTP: predictions (true: $((after - before)) tokens kept; half wrong) leave the text as it was"
echo PASS
