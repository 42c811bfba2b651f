#!/usr/bin/env bash
# A model whose GGUF carries a Llama 3 chat template (synthesized with the Llama 3 vocabulary
# of ../shared/vocab, random weights) on a real 2-stage ring: /v1/chat/completions sends
# exactly the tokens of the rendered template (usage.prompt_tokens equals the /tokenize
# count of /apply-template's prompt, one BOS), and generation stops at <|eot_id|>: with
# OpenAI's logit_bias pushing <|eot_id|> the answer ends at once with finish_reason "stop"
# and no <|eot_id|> text, while without it the same greedy request runs to its length.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

VOCAB="$KVR_SHARED/vocab/ggml-vocab-llama-bpe.gguf"
if [ ! -f "$VOCAB" ]; then
    [ "${CI:-}" = true ] && fail "missing $VOCAB (required under CI)"
    echo "SKIP: no $VOCAB"
    exit 77
fi
timeout 60 "$KVASIR" synth --shape tiny --type q8_0 --seed 3 --vocab "$VOCAB" \
    -o "$TMP/llama3.gguf" >/dev/null 2>&1 || fail "synth"
KEY=sk-chat-template-test
start_serve l3 "$TMP/llama3.gguf" --stages 2 --api-key "$KEY"
grep -q "chats are formatted with the Jinja template of the model" "$SERVE_LOG" ||
    fail "the server does not use the model's template: $(grep -i chat "$SERVE_LOG")"

post() { # PATH BODY -> response body on stdout; fails unless 200
    local out
    out=$(curl -s -m 60 -w '\n%{http_code}' -H "Authorization: Bearer $KEY" -d "$2" \
        "$SERVE_URL$1") || fail "curl $1"
    [ "$(tail -1 <<<"$out")" = 200 ] || fail "$1: $out"
    head -n -1 <<<"$out"
}

MSGS='[{"role": "system", "content": "You are terse."},
       {"role": "user", "content": "  Name a colour.\nOne word.  "}]'
post /apply-template "{\"messages\": $MSGS}" >"$TMP/tmpl.json"
prompt=$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["prompt"]))' \
    "$TMP/tmpl.json")
python3 - "$TMP/tmpl.json" <<'PY' || fail "unexpected rendered prompt"
import json, sys
p = json.load(open(sys.argv[1]))["prompt"]
want = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a colour.\nOne word.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
assert p == want, repr(p)
print("apply-template: %d bytes, as the template renders it" % len(p))
PY
post /tokenize "{\"content\": $prompt, \"add_special\": false}" >"$TMP/tok.json"
n_tok=$(python3 - "$TMP/tok.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))["tokens"]
assert t[0] == 128000 and t.count(128000) == 1, "one BOS first: %r" % t[:4]
assert t.count(128006) == 3 and t.count(128009) == 2, "header and eot tokens: %r" % t
print(len(t))
PY
) || fail "unexpected tokens"
echo "tokenize: $n_tok tokens"
# `kvasir tokenize --chat` renders and counts the same conversation the same way.
echo "{\"messages\": $MSGS}" >"$TMP/conv.json"
"$KVASIR" tokenize -m "$TMP/llama3.gguf" --chat "$TMP/conv.json" >"$TMP/cli_prompt.txt" ||
    fail "kvasir tokenize --chat"
"$KVASIR" tokenize -m "$TMP/llama3.gguf" --chat "$TMP/conv.json" --ids >"$TMP/cli_ids.txt" ||
    fail "kvasir tokenize --chat --ids"
python3 - "$TMP/tmpl.json" "$TMP/cli_prompt.txt" "$TMP/tok.json" "$TMP/cli_ids.txt" <<'PY' ||
import json, sys
assert open(sys.argv[2], encoding="utf-8").read() == json.load(open(sys.argv[1]))["prompt"]
assert json.load(open(sys.argv[4])) == json.load(open(sys.argv[3]))["tokens"]
print("kvasir tokenize --chat: the same prompt and ids")
PY
    fail "kvasir tokenize --chat differs from /apply-template + /tokenize"
# `kvasir run --chat` sends a prompt as one user message, as many tokens as the server.
echo '{"messages": [{"role": "user", "content": "Name a colour."}]}' >"$TMP/u.json"
want=$(post /tokenize "{\"content\": $(post /apply-template "$(cat "$TMP/u.json")" |
    python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["prompt"]))'),
    \"add_special\": false}" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["tokens"]))')
got=$("$KVASIR" run -m "$TMP/llama3.gguf" --chat -p "Name a colour." -n 1 --temp 0 --json \
    2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["n_prompt"])') ||
    fail "kvasir run --chat"
[ "$got" = "$want" ] || fail "kvasir run --chat: $got prompt tokens, the server $want"
echo "kvasir run --chat: $got prompt tokens, as the server"

# Greedy, without a bias: random weights do not pick <|eot_id|> (1 of 128256) here.
post /v1/chat/completions "{\"messages\": $MSGS, \"max_tokens\": 6, \"temperature\": 0}" \
    >"$TMP/plain.json"
# The same with <|eot_id|> pushed up by 100: it is the first token, and it ends the answer.
post /v1/chat/completions "{\"messages\": $MSGS, \"max_tokens\": 6, \"temperature\": 0,
    \"logit_bias\": {\"128009\": 100}}" >"$TMP/eot.json"
python3 - "$TMP/plain.json" "$TMP/eot.json" "$n_tok" <<'PY' || fail "chat completions"
import json, sys
plain, eot, n = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), int(sys.argv[3])
for r in (plain, eot):
    assert r["usage"]["prompt_tokens"] == n, "prompt_tokens %d, /tokenize %d" % (
        r["usage"]["prompt_tokens"], n)
c = plain["choices"][0]
assert c["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 6, plain
c = eot["choices"][0]
assert c["finish_reason"] == "stop", eot
assert "<|eot_id|>" not in c["message"]["content"] and c["message"]["content"] == "", eot
print("prompt_tokens = %d in both; unbiased: length after 6 tokens; biased: stop at <|eot_id|>"
      % n)
PY
# Streaming stops the same way.
sse=$(curl -sN -m 60 -H "Authorization: Bearer $KEY" -d "{\"messages\": $MSGS, \"max_tokens\": 6,
    \"temperature\": 0, \"stream\": true, \"logit_bias\": {\"128009\": 100}}" \
    "$SERVE_URL/v1/chat/completions")
grep -q '"finish_reason":"stop"' <<<"$sse" || fail "stream did not stop: $sse"
grep -q 'eot_id' <<<"$sse" && fail "stream shows <|eot_id|>: $sse"
echo "PASS"
