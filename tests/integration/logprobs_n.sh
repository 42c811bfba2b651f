#!/usr/bin/env bash
# logprobs and n > 1 through `kvasir serve` (a real 3-stage ring), checked against the
# single process (docs/API.md, issue 36):
#  1. the logprob of every sampled token and its 20 alternatives equal log_softmax of the
#     logits `kvasir run --force-ids` prints for the same tokens (to 1e-5), and the tokens
#     are the single process's for the same seed;
#  2. asking for logprobs changes no token of any sequence (batch invariance): the same
#     seeded requests sent at once, half with logprobs, give the texts they give alone;
#  3. chat logprobs have the OpenAI shape (bytes, top_logprobs sorted), streamed chunks
#     carry the same values as the whole answer;
#  4. n = 4 gives 4 different answers, choice i the answer of n = 1 with seed + i; the
#     prompt's whole blocks are computed once (prefix-cache counters); streamed, each index
#     comes with one usage chunk and one [DONE];
#  5. a client of n = 4 that goes away ends all four; n = 17 and top_logprobs = 21 are 400s.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

stories=$(need_shared models/stories260K.gguf)
start_serve lp "$stories" --stages 3 -t 1 --no-standby
post() { curl -s -m 60 -H 'Content-Type: application/json' -d "$2" "$SERVE_URL$1"; }

# 1. logprobs against --force-ids.
prompt="Lily went to the park and saw a big red ball"
N=12
samp='"temperature": 0.9, "seed": 5, "top_k": 0, "top_p": 1, "min_p": 0'
echo "{\"prompt\": \"$prompt\", \"max_tokens\": $N, $samp}" >"$TMP/p.jsonl"
"$KVASIR" run -m "$stories" --prompts "$TMP/p.jsonl" --json -t 1 >"$TMP/ref.json" 2>/dev/null ||
    fail "run -m"
python3 -c 'import json,sys; print(" ".join(map(str, json.load(open(sys.argv[1]))["ids"])))' \
    "$TMP/ref.json" >"$TMP/ids.txt"
"$KVASIR" run -m "$stories" --force-ids "$TMP/ids.txt" -p "$prompt" --json --logits $N --top 1 \
    -t 1 >"$TMP/forced.jsonl" 2>/dev/null || fail "run --force-ids"
post /v1/completions "{\"prompt\": \"$prompt\", \"max_tokens\": $N, $samp, \"logprobs\": 20}" \
    >"$TMP/c.json"
post /tokenize "{\"content\": \"$prompt\", \"add_special\": true}" >"$TMP/tok.json"
python3 - "$TMP/ref.json" "$TMP/forced.jsonl" "$TMP/c.json" "$TMP/tok.json" <<'PY' || fail "logprobs differ from log_softmax of the forced logits"
import json, math, sys
ref = json.load(open(sys.argv[1]))
steps = [json.loads(l) for l in open(sys.argv[2])]
c = json.load(open(sys.argv[3]))
n_prompt = len(json.load(open(sys.argv[4]))["tokens"])
assert c["usage"]["prompt_tokens"] == ref["n_prompt"] == n_prompt, (c["usage"], ref["n_prompt"])
lp = c["choices"][0]["logprobs"]
assert len(lp["token_logprobs"]) == len(steps) == len(ref["ids"])
for k, st in enumerate(steps):
    lg = st["logits"]
    m = max(lg)
    lse = m + math.log(sum(math.exp(x - m) for x in lg))
    want = sorted((x - lse for x in lg), reverse=True)[:20]
    got = lp["token_logprobs"][k]
    assert abs(got - (lg[st["forced"]] - lse)) < 1e-5, (k, got, lg[st["forced"]] - lse)
    alts = sorted(lp["top_logprobs"][k].values(), reverse=True)
    # a dict keeps one entry per text: the values it has are among the true top 20 (or the
    # sampled token's, added when it is not among them), in order
    assert 1 <= len(alts) <= 21 and abs(alts[0] - want[0]) < 1e-5, (k, alts[:3], want[:3])
    for v in alts:
        assert min(abs(v - w) for w in want + [got]) < 1e-5, (k, v)
print("ok: %d tokens, logprobs and top-20 equal log_softmax of the forced logits" % len(steps))
PY
# the tokens are the single process's: their text, token by token
python3 - "$TMP/c.json" <<'PY' || fail "no 20 alternatives"
import json, sys
lp = json.load(open(sys.argv[1]))["choices"][0]["logprobs"]
assert all(len(d) >= 15 for d in lp["top_logprobs"]), [len(d) for d in lp["top_logprobs"]]
assert lp["text_offset"][0] == 0
PY

# 2. batch invariance: 6 seeded requests at once, every other one with logprobs.
jobs_=()
body() { echo "{\"prompt\": \"Tom had a dog $1\", \"max_tokens\": 24, \"temperature\": 1, \"seed\": $1 $2}"; }
for i in 1 2 3 4 5 6; do post /v1/completions "$(body $i '')" >"$TMP/alone$i.json"; done
for i in 1 2 3 4 5 6; do
    extra=""
    [ $((i % 2)) = 0 ] && extra=', "logprobs": 5'
    post /v1/completions "$(body $i "$extra")" >"$TMP/mixed$i.json" &
    jobs_+=($!)
done
for p in "${jobs_[@]}"; do wait "$p" || fail "a request with others at once failed"; done
for i in 1 2 3 4 5 6; do
    a=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"])' "$TMP/alone$i.json")
    b=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"])' "$TMP/mixed$i.json")
    [ "$a" = "$b" ] || fail "request $i: '$a' alone, '$b' beside requests with logprobs"
done
echo "ok: 6 requests at once, 3 with logprobs: every text as alone"

# 3. chat logprobs: shape, and the stream carries the whole answer's values.
chat='{"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 10,
       "temperature": 1, "seed": 3, "logprobs": true, "top_logprobs": 4'
post /v1/chat/completions "$chat}" >"$TMP/chat.json"
curl -sN -m 60 -H 'Content-Type: application/json' -d "$chat, \"stream\": true}" \
    "$SERVE_URL/v1/chat/completions" >"$TMP/chat.sse"
python3 - "$TMP/chat.json" "$TMP/chat.sse" <<'PY' || fail "chat logprobs"
import json, sys
whole = json.load(open(sys.argv[1]))["choices"][0]["logprobs"]["content"]
assert len(whole) >= 1
for e in whole:
    assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}, e.keys()
    assert len(e["top_logprobs"]) == 4
    vals = [t["logprob"] for t in e["top_logprobs"]]
    assert vals == sorted(vals, reverse=True) and vals[0] >= e["logprob"] - 1e-6
    assert all(set(t) == {"token", "logprob", "bytes"} for t in e["top_logprobs"])
streamed = []
for line in open(sys.argv[2]):
    if line.startswith("data: {"):
        ch = json.loads(line[6:])["choices"][0]
        if ch.get("logprobs"):
            streamed += ch["logprobs"]["content"]
assert streamed == whole, (len(streamed), len(whole))
print("ok: chat logprobs, %d tokens x 4 alternatives, the same streamed" % len(whole))
PY

# 4. n = 4: different answers, each the n = 1 answer of seed + i; the prompt computed once.
long="Once upon a time there was a little girl named Lily. She loved to play in the park with"
long="$long her dog and her cat. Every day she went to the park and played with her friends"
nreq() { echo "{\"prompt\": \"$long\", \"max_tokens\": 16, \"temperature\": 1, \"seed\": $1, \"n\": $2 $3}"; }
for i in 0 1 2 3; do post /v1/completions "$(nreq $((40 + i)) 1 '')" >"$TMP/one$i.json"; done
curl -s -m 5 -X POST "$SERVE_URL/reset_prefix_cache" >/dev/null
c0=$(metric prompt_tokens_computed_total)
h0=$(metric prefix_cache_hits_total)
post /v1/completions "$(nreq 40 4 '')" >"$TMP/four.json"
c1=$(metric prompt_tokens_computed_total)
h1=$(metric prefix_cache_hits_total)
python3 - "$TMP" $((c1 - c0)) $((h1 - h0)) <<'PY' || fail "n = 4"
import json, sys
d = sys.argv[1]
four = json.load(open(d + "/four.json"))
texts = [c["text"] for c in sorted(four["choices"], key=lambda c: c["index"])]
assert [c["index"] for c in four["choices"]] == [0, 1, 2, 3]
assert len(set(texts)) == 4, texts
for i in range(4):
    one = json.load(open("%s/one%d.json" % (d, i)))["choices"][0]["text"]
    assert texts[i] == one, (i, texts[i], one)
u = four["usage"]
n_prompt = u["prompt_tokens"]
one_usage = json.load(open(d + "/one0.json"))["usage"]
assert n_prompt == one_usage["prompt_tokens"] and u["completion_tokens"] == 64, u
whole = (n_prompt - 1) // 16 * 16  # the blocks a choice can map (16 tokens a block)
computed, hits = int(sys.argv[2]), int(sys.argv[3])
assert whole >= 32 and hits == 3 * whole, (hits, whole)
assert computed == n_prompt + 3 * (n_prompt - whole), (computed, n_prompt, whole)
print("ok: n = 4: 4 different answers, each seed + i's; a prompt of %d tokens: its %d tokens "
      "of whole blocks computed once (%d computed in all, %d reused)" % (n_prompt, whole, computed,
                                                                       hits))
PY
curl -sN -m 60 -H 'Content-Type: application/json' \
    -d "$(nreq 40 4 ', "stream": true, "stream_options": {"include_usage": true}')" \
    "$SERVE_URL/v1/completions" >"$TMP/four.sse"
python3 - "$TMP" <<'PY' || fail "n = 4 streamed"
import json, sys
d = sys.argv[1]
texts, usage, done, finish = {}, [], 0, {}
for line in open(d + "/four.sse"):
    if line.startswith("data: [DONE]"):
        done += 1
    elif line.startswith("data: {"):
        j = json.loads(line[6:])
        assert done == 0, "a chunk after [DONE]"
        if j.get("usage"):
            usage.append(j["usage"])
        for c in j["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
whole = json.load(open(d + "/four.json"))["choices"]
assert done == 1 and len(usage) == 1 and usage[0]["completion_tokens"] == 64, (done, usage)
assert sorted(finish) == [0, 1, 2, 3], finish
for c in whole:
    assert texts[c["index"]] == c["text"], (c["index"], texts[c["index"]], c["text"])
print("ok: n = 4 streamed: every index, the same texts, one usage chunk, one [DONE]")
PY

# 5. bounds; a client of n = 4 that goes away ends all four (a model slow enough to leave
# mid-answer: stories260K's context is 128 tokens).
code=$(curl -s -o /dev/null -w '%{http_code}' -d '{"prompt": "hi", "n": 17}' "$SERVE_URL/v1/completions")
[ "$code" = 400 ] || fail "n = 17: HTTP $code"
code=$(curl -s -o /dev/null -w '%{http_code}' \
    -d '{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}' \
    "$SERVE_URL/v1/chat/completions")
[ "$code" = 400 ] || fail "top_logprobs = 21: HTTP $code"
stop_serve
timeout 60 "$KVASIR" synth --shape custom --layers 8 --dim 256 --ff 768 --heads 8 --kv-heads 4 \
    --ctx 4096 --seed 3 -o "$TMP/m.gguf" >/dev/null 2>&1 || fail "synth"
start_serve gone "$TMP/m.gguf" --stages 2 --ctx 4096 --max-seqs 8 --no-standby
curl -sN -m 120 -o "$TMP/gone.sse" -H 'Content-Type: application/json' \
    -d '{"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": true, "n": 4,
         "temperature": 1, "stream": true}' "$SERVE_URL/v1/completions" &
client=$!
PIDS+=($client)
for _ in $(seq 600); do
    [ "$(cat "$TMP/gone.sse" 2>/dev/null | grep -c '"index":3' || true)" -ge 3 ] && break
    sleep 0.05
done
[ "$(metric num_requests_running)" = 4 ] || fail "n = 4: $(metric num_requests_running) running"
kill "$client"
for _ in $(seq 100); do
    [ "$(metric num_requests_running)" = 0 ] && break
    sleep 0.05
done
[ "$(metric num_requests_running)" = 0 ] || fail "choices still running 5 s after their client left"
grep -q 'outcome=client_gone' "$SERVE_LOG" || fail "no client_gone access line"
echo "ok: n = 17 and top_logprobs = 21 refused; a client of n = 4 gone ends all four"
echo "PASS"
