#!/usr/bin/env bash
# The prefix cache under pressure, on a live ring (`kvasir serve`, 2 stages, stories260K):
# KV blocks for only 4 conversations at a time and 32 conversations of 2 turns each, all
# sharing a system prompt, the second turn repeating the first with its answer. Checked:
#  - no request fails (cached blocks are evicted for new ones; a request waits for blocks
#    only while running ones hold them), and the cache was used (hits) and evicted;
#  - nothing leaks: at rest no block is in use and KV use (/metrics, per stage) is the
#    cached blocks alone; POST /reset_prefix_cache frees exactly those, and KV use is 0;
#  - the gauges of recent activity (tokens/s, each stage's utilisation) are non-zero under
#    load and decay to 0 when the ring goes idle, instead of keeping their last value.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

stories=$(need_shared models/stories260K.gguf)
# A request: about 110 prompt tokens (turn 2: 170) + 24 generated = 9 to 13 blocks of 16.
# stories260K was trained for 128 positions; its prompts here run past them knowingly.
KVASIR_ALLOW_LONG_CONTEXT=1 start_serve pressure "$stories" --stages 2 --max-seqs 32 --ctx 256 --kv-blocks 52 \
    --no-admission
[ "$(metric kv_blocks_total)" = 52 ] || fail "kv_blocks_total is not 52"

# 32 conversations at once, from one client process (threads): turn 2 is turn 1's prompt,
# its answer and more. Every HTTP status goes to $TMP/codes.
python3 - "$SERVE_URL" "$TMP/codes" <<'PY' &
import json, sys, threading, urllib.request
url, out = sys.argv[1], sys.argv[2]
system = ("You are a storyteller. Once upon a time there was a little girl who loved to play"
          " in the park with her dog. Every day she went to the park and played in the sun.")
codes = []
def ask(prompt):
    req = urllib.request.Request(url + "/v1/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": prompt, "max_tokens": 24, "temperature": 0,
                         "ignore_eos": True}).encode())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)["choices"][0]["text"]
    except urllib.error.HTTPError as e:
        return e.code, ""
def conversation(i):
    prompt = "%s Story %d: one day she" % (system, i)
    code, text = ask(prompt)
    codes.append(code)
    codes.append(ask(prompt + text + " and then")[0])
threads = [threading.Thread(target=conversation, args=(i,)) for i in range(32)]
for t in threads: t.start()
for t in threads: t.join()
open(out, "w").write(" ".join(map(str, codes)))
PY
load=$!
busy_tps="" busy_util=""
for _ in $(seq 1 100); do # sample the gauges while the load runs
    t=$(metric ring_tokens_per_second)
    u=$(curl -s -m 2 "$SERVE_URL/metrics" | awk '{sub(/model_name="[^"]*",?/, ""); sub(/[{][}]/, "")} $1 == "kvasir:stage_utilization{stage=\"0\"}" {print $2}')
    if awk -v t="${t:-0}" 'BEGIN { exit !(t > 0) }'; then busy_tps=$t busy_util=$u; break; fi
    sleep 0.1
done
wait "$load" || fail "the load generator failed"
codes=$(cat "$TMP/codes")
[ "$(wc -w <<<"$codes")" = 64 ] || fail "expected 64 answers: $codes"
[ "$(tr ' ' '\n' <<<"$codes" | sort -u)" = 200 ] || fail "not every request succeeded: $codes"
echo "ok: 64/64 requests answered with KV blocks for 4 conversations"

hits=$(metric prefix_cache_hits_total)
evicted=$(metric prefix_cache_evictions_total)
[ "${hits:-0}" -gt 0 ] || fail "no prompt token was found in the prefix cache"
[ "${evicted:-0}" -gt 0 ] || fail "no cached block was evicted: the test applied no pressure"
used=$(metric kv_blocks_used)
cached=$(metric kv_blocks_cached)
stage1=$(curl -s -m 2 "$SERVE_URL/metrics" | awk '{sub(/model_name="[^"]*",?/, ""); sub(/[{][}]/, "")} $1 == "kvasir:stage_kv_blocks_used{stage=\"1\"}" {print $2}')
[ "$used" = 0 ] || fail "$used KV blocks still in use at rest"
[ "$cached" -gt 0 ] || fail "nothing cached at rest"
[ "$stage1" = "$cached" ] || fail "stage 1 KV use $stage1, cached $cached"
echo "ok: at rest 0 blocks in use, $cached cached (stage 1 holds $stage1); $hits prompt tokens reused, $evicted blocks evicted"
freed=$(curl -s -m 5 -X POST "$SERVE_URL/reset_prefix_cache" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["blocks_freed"])')
[ "$freed" = "$cached" ] || fail "the flush freed $freed blocks, $cached were cached"
[ "$(metric kv_blocks_cached)" = 0 ] || fail "blocks cached after the flush"
stage1=$(curl -s -m 2 "$SERVE_URL/metrics" | awk '{sub(/model_name="[^"]*",?/, ""); sub(/[{][}]/, "")} $1 == "kvasir:stage_kv_blocks_used{stage=\"1\"}" {print $2}')
[ "$stage1" = 0 ] || fail "stage 1 KV use $stage1 after the flush"
echo "ok: the flush freed $freed blocks; KV use 0"

[ -n "$busy_tps" ] || fail "ring_tokens_per_second never rose above 0 under load"
sleep 4.5 # two 2-second windows with nothing coming back
idle_tps=$(metric ring_tokens_per_second)
idle_util=$(curl -s -m 2 "$SERVE_URL/metrics" | awk '{sub(/model_name="[^"]*",?/, ""); sub(/[{][}]/, "")} $1 == "kvasir:stage_utilization{stage=\"0\"}" {print $2}')
[ "$idle_tps" = 0 ] || fail "ring_tokens_per_second is $idle_tps after 4.5 s idle (was $busy_tps)"
[ "$idle_util" = 0 ] || fail "stage 0 utilisation is $idle_util after 4.5 s idle (was $busy_util)"
echo "ok: tokens/s $busy_tps and stage 0 utilisation $busy_util under load, 0 and 0 when idle"
echo "PASS"
