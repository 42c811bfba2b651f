#!/usr/bin/env bash
# The KV cache's precision against llama.cpp's (issue 15): the peer keeps an f16 cache by
# default. On stories260K (a real trained model, whose margins are small enough for the
# cache's rounding to matter), 5 prompts of 200 greedy tokens: Kvasir's f16 cache must
# reproduce the peer's ids for at least as many steps in all as its f32 cache (measured:
# f16 935, f32 791 of 1000), and every prompt for at least 10 steps. Also on a 2-stage
# ring: the plan's kv_type reaches the stages (tokens equal to the single process's).
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/models_ref_lib.bash"
need_peer
model=$(need_shared models/stories260K.gguf)

prompts=("Once upon a time" "The little dog" "Tom and Lily went to the park" "She was happy"
    "The sun was")
declare -A total=([f32]=0 [f16]=0)
for i in "${!prompts[@]}"; do
    p=${prompts[$i]}
    refgen "$model" "$p" 200 >"$TMP/ref.$i.json" || fail "refgen"
    line="prompt $i:"
    for t in f32 f16; do
        timeout 60 "$KVASIR" run -m "$model" --kv-type "$t" -p "$p" -n 200 --temp 0 \
            --ignore-eos --ids -q -t 1 2>"$TMP/run.log" | tail -1 >"$TMP/ids.$i.$t" ||
            { cat "$TMP/run.log"; fail "run --kv-type $t"; }
        n=$(python3 - "$TMP/ref.$i.json" "$TMP/ids.$i.$t" <<'PY'
import json, sys
ref = [s["id"] for s in json.load(open(sys.argv[1]))["steps"]]
ours = [int(t) for t in open(sys.argv[2]).read().split()]
n = 0
while n < len(ref) and n < len(ours) and ref[n] == ours[n]:
    n += 1
print(n)
PY
        )
        [ "$n" -ge 10 ] || fail "prompt $i, KV $t: only $n of 200 ids equal to llama.cpp's"
        total[$t]=$((total[$t] + n))
        line="$line $t $n/200"
    done
    echo "$line"
done
echo "steps equal to llama.cpp's (f16 cache): f16 ${total[f16]}, f32 ${total[f32]} of 1000"
[ "${total[f16]}" -ge "${total[f32]}" ] ||
    fail "the f16 KV cache keeps fewer of llama.cpp's tokens than f32"

echo "{\"prompt\": \"${prompts[2]}\", \"temperature\": 0, \"max_tokens\": 200}" >"$TMP/p.jsonl"
for t in f32 f16; do
    # stories260K was trained for 128 positions; the comparison runs past them, as the
    # single process and llama.cpp do.
    KVASIR_ALLOW_LONG_CONTEXT=1 start_ring "$model" 2 2 "ring-$t" --kv-type "$t" --ctx 256
    timeout 60 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/p.jsonl" --json --ignore-eos \
        >"$TMP/ring.$t.jsonl" 2>"$TMP/ring.log" || { cat "$TMP/ring.log"; fail "ring run $t"; }
    stop_ring
    timeout 60 "$KVASIR" run -m "$model" --kv-type "$t" --prompts "$TMP/p.jsonl" --json \
        --ignore-eos -t 1 >"$TMP/single.$t.jsonl" 2>"$TMP/run.log" || fail "run $t"
    cmp -s "$TMP/ring.$t.jsonl" "$TMP/single.$t.jsonl" ||
        fail "KV $t: the ring's tokens differ from the single process's"
done
cmp -s "$TMP/ring.f32.jsonl" "$TMP/ring.f16.jsonl" &&
    fail "the rings with f32 and f16 KV gave the same 200 tokens (prompt 2 differs at step 178)"
echo "ok: 2-stage rings with f32 and f16 KV equal the single process, and differ from each other"
echo "PASS"
