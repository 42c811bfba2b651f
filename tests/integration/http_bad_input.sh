#!/usr/bin/env bash
# Bad requests against the real `kvasir serve` (a 2-stage ring, API key, context 64): each
# gets the right status and an OpenAI-shaped error body ({"error": {message, type, param,
# code}}), every one is counted once in /metrics, no generation or KV is left behind, and
# the server keeps serving. tests/unit/test_http.c covers the same table against a fake
# service; this proves the production path (serve.c, service_ring.c, the bridge).
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

KEY=sk-bad-input-test
CTX=64
timeout 60 "$KVASIR" synth --shape tiny --type q8_0 --seed 5 -o "$TMP/tiny.gguf" >/dev/null 2>&1 ||
    fail "synth"
start_serve bad "$TMP/tiny.gguf" --stages 2 --api-key "$KEY" --ctx "$CTX"
AUTH="Authorization: Bearer $KEY"
C="$SERVE_URL/v1/completions"
H="$SERVE_URL/v1/chat/completions"

n_bad=0 # 4xx answers the HTTP layer itself gave (each must be counted in /metrics)
: >"$TMP/cases"

# expect NAME STATUS CODE PARAM MESSAGE_PART -- CURL_ARGS...
# CODE and PARAM: the error's "code" and "param" ("null" for JSON null, "-" to skip). The
# status is checked at once, the bodies all together by check_bodies (one python3 run).
expect() {
    local name=$1 status=$2 code=$3 param=$4 part=$5
    shift 6
    n_bad=$((n_bad + 1))
    local body=$TMP/body.$n_bad got
    got=$(curl -s -m 20 -o "$body" -D "$TMP/headers" -w '%{http_code}' "$@") ||
        fail "$name: curl failed"
    [ "$got" = "$status" ] || fail "$name: status $got, expected $status: $(head -c 400 "$body")"
    printf '%s\t%s\t%s\t%s\t%s\n' "$body" "$code" "$param" "$part" "$name" >>"$TMP/cases"
    echo "ok: $name -> $status"
}

check_bodies() {
    python3 - "$TMP/cases" <<'EOF' || fail "bad error bodies"
import json, sys
bad = 0
for line in open(sys.argv[1], encoding="utf-8"):
    path, code, param, part, name = line.rstrip("\n").split("\t")
    try:
        body = json.load(open(path, encoding="utf-8"))
        err = body["error"]
        assert set(body) == {"error"}, f"extra keys {sorted(body)}"
        assert set(err) == {"message", "type", "param", "code"}, f"keys {sorted(err)}"
        assert isinstance(err["message"], str) and err["message"], "no message"
        assert isinstance(err["type"], str) and err["type"], "no type"
        if code != "-":
            assert err["code"] == (None if code == "null" else code), f"code {err['code']!r}"
        if param != "-":
            assert err["param"] == (None if param == "null" else param), \
                f"param {err['param']!r}"
        assert part in err["message"], f"message {err['message']!r} lacks {part!r}"
    except Exception as e:
        bad += 1
        print(f"{name}: {e}: {open(path, 'rb').read()[:400]!r}", file=sys.stderr)
n = sum(1 for _ in open(sys.argv[1]))
print(f"{n - bad}/{n} error bodies as expected")
sys.exit(1 if bad else 0)
EOF
}

header_has() { grep -qi "^$1: *$2" "$TMP/headers" || fail "response lacks '$1: $2'"; }

# ---- the body: JSON and UTF-8 ----
expect "malformed JSON" 400 invalid_json null "not valid JSON" -- -H "$AUTH" -d '{"prompt":' "$C"
expect "empty body" 400 invalid_json null "empty" -- -H "$AUTH" -d '' "$C"
expect "whitespace body" 400 invalid_json null "not valid JSON" -- -H "$AUTH" -d '   ' "$C"
expect "root is an array" 400 invalid_json null "must be a JSON object" -- \
    -H "$AUTH" -d '[1, 2]' "$C"
expect "root is null" 400 invalid_json null "not valid JSON" -- -H "$AUTH" -d 'null' "$C"
expect "duplicate key" 400 invalid_json null "duplicate" -- \
    -H "$AUTH" -d '{"prompt": "x", "prompt": "y"}' "$C"
expect "invalid UTF-8" 400 invalid_utf8 null "not valid UTF-8" -- \
    -H "$AUTH" --data-binary $'{"prompt": "\xff\xfe"}' "$C"
expect "truncated UTF-8" 400 invalid_utf8 null "not valid UTF-8" -- \
    -H "$AUTH" --data-binary $'{"prompt": "caf\xc3"}' "$C"
expect "lone surrogate escape" 400 invalid_json null "not valid JSON" -- \
    -H "$AUTH" -d '{"prompt": "\ud800"}' "$C"
expect "raw control character" 400 invalid_json null "control character" -- \
    -H "$AUTH" --data-binary $'{"prompt": "a\x01"}' "$C"

# ---- missing fields and wrong types ----
expect "missing prompt" 400 missing_required_parameter prompt "'prompt'" -- \
    -H "$AUTH" -d '{"max_tokens": 5}' "$C"
expect "missing messages" 400 missing_required_parameter messages "'messages'" -- \
    -H "$AUTH" -d '{"max_tokens": 5}' "$H"
expect "message without content" 400 missing_required_parameter "messages[0].content" \
    "is required" -- -H "$AUTH" -d '{"messages": [{"role": "user"}]}' "$H"
expect "prompt is a number" 400 invalid_type prompt "must be a string" -- \
    -H "$AUTH" -d '{"prompt": 42}' "$C"
expect "max_tokens is a string" 400 invalid_type max_tokens "must be an integer" -- \
    -H "$AUTH" -d '{"prompt": "x", "max_tokens": "5"}' "$C"
expect "messages is an object" 400 invalid_type messages "must be an array" -- \
    -H "$AUTH" -d '{"messages": {"role": "user"}}' "$H"
expect "stream is a string" 400 invalid_type stream "must be a boolean" -- \
    -H "$AUTH" -d '{"prompt": "x", "stream": "yes"}' "$C"
expect "ignore_eos is a number" 400 invalid_type ignore_eos "must be a boolean" -- \
    -H "$AUTH" -d '{"prompt": "x", "ignore_eos": 1}' "$C"
expect "empty messages" 400 invalid_value messages "must not be empty" -- \
    -H "$AUTH" -d '{"messages": []}' "$H"
expect "unknown role" 400 invalid_value "messages[0].role" "not supported" -- \
    -H "$AUTH" -d '{"messages": [{"role": "wizard", "content": "x"}]}' "$H"
expect "token id outside the vocabulary" 400 invalid_value "prompt[1]" "outside the vocabulary" -- \
    -H "$AUTH" -d '{"prompt": [1, 99999]}' "$C"
expect "n > 1" 400 unsupported_parameter n "not supported" -- \
    -H "$AUTH" -d '{"prompt": "x", "n": 2}' "$C"
expect "temperature out of range" 400 invalid_value temperature "at most 2" -- \
    -H "$AUTH" -d '{"prompt": "x", "temperature": 5}' "$C"
expect "stream_options without stream" 400 invalid_value stream_options "only allowed" -- \
    -H "$AUTH" -d '{"prompt": "x", "stream_options": {"include_usage": true}}' "$C"
expect "bad latency header" 400 invalid_value X-Latency-Budget-Ms "whole number" -- \
    -H "$AUTH" -H 'X-Latency-Budget-Ms: soon' -d '{"prompt": "x"}' "$C"

# ---- fields Kvasir does not implement: refused, naming the field (docs/API.md) ----
refused_field() { # NAME URL BODY PART
    expect "refused field $1" 400 unsupported_parameter "$1" "$4" -- -H "$AUTH" -d "$3" "$2"
}
refused_field guided_json "$C" '{"prompt": "x", "guided_json": {"type": "object"}}' "not supported"
expect "grammar that does not compile" 400 invalid_value grammar "rule 'b' is not defined" -- \
    -H "$AUTH" -d '{"prompt": "x", "grammar": "root ::= \"a\" b"}' "$C"
expect "unsupported schema keyword" 400 unsupported_schema json_schema \
    "json_schema: /properties/a/not: unsupported keyword" -- -H "$AUTH" \
    -d '{"messages": [{"role": "user", "content": "x"}], "json_schema": {"properties": {"a": {"not": {}}}}}' "$H"
refused_field min_tokens "$C" '{"prompt": "x", "min_tokens": 4}' "minimum length"
refused_field modalities "$H" \
    '{"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]}' "only text"
refused_field prediction "$H" '{"messages": [{"role": "user", "content": "x"}],
    "prediction": {"type": "content", "content": "x"}}' "predicted outputs"
refused_field store "$H" '{"messages": [{"role": "user", "content": "x"}], "store": true}' \
    "stored completions"
expect "unknown field" 400 unknown_parameter temprature "not a field of /v1/completions" -- \
    -H "$AUTH" -d '{"prompt": "x", "temprature": 0}' "$C"
expect "chat field on completions" 400 unknown_parameter messages "not a field" -- \
    -H "$AUTH" -d '{"prompt": "x", "messages": []}' "$C"
expect "unknown stream option" 400 unknown_parameter stream_options.usage "not a known field" -- \
    -H "$AUTH" -d '{"prompt": "x", "stream": true, "stream_options": {"usage": true}}' "$C"
expect "n_predict beside max_tokens" 400 invalid_value n_predict "another name" -- \
    -H "$AUTH" -d '{"prompt": "x", "n_predict": 4, "max_tokens": 4}' "$C"
expect "seed -2" 400 invalid_value seed "-1 (random) or between 0 and 18446744073709551615" -- \
    -H "$AUTH" -d '{"prompt": "x", "seed": -2}' "$C"
expect "seed 2^64" 400 invalid_value seed "18446744073709551615" -- \
    -H "$AUTH" -d '{"prompt": "x", "seed": 18446744073709551616}' "$C"
expect "tokenize unknown field" 400 unknown_parameter parse_special "not a known field" -- \
    -H "$AUTH" -d '{"content": "x", "parse_special": true}' "$SERVE_URL/tokenize"

# ---- lengths: max_tokens and the context ----
expect "max_tokens 0" 400 invalid_value max_tokens "between 1 and $CTX" -- \
    -H "$AUTH" -d '{"prompt": "x", "max_tokens": 0}' "$C"
expect "max_tokens negative" 400 invalid_value max_tokens "between 1 and $CTX" -- \
    -H "$AUTH" -d '{"prompt": "x", "max_tokens": -1}' "$C"
expect "max_tokens over the context" 400 invalid_value max_tokens "between 1 and $CTX" -- \
    -H "$AUTH" -d "{\"prompt\": \"x\", \"max_tokens\": $((CTX + 1))}" "$C"
expect "max_tokens huge" 400 invalid_value max_tokens "between 1 and $CTX" -- \
    -H "$AUTH" -d '{"prompt": "x", "max_tokens": 9223372036854775807}' "$C"
expect "max_tokens beyond 64 bits" 400 invalid_json null "too big integer" -- \
    -H "$AUTH" -d '{"prompt": "x", "max_tokens": 18446744073709551616}' "$C"
expect "prompt + max_tokens over the context" 400 context_length_exceeded max_tokens \
    "maximum context length is $CTX" -- \
    -H "$AUTH" -d "{\"prompt\": \"Once upon a time\", \"max_tokens\": $CTX}" "$C"
long=$(printf 'Once upon a time %.0s' $(seq 8)) # ~66 tokens: tokenized, then refused
expect "prompt longer than the context" 400 context_length_exceeded prompt \
    "maximum context length is $CTX" -- -H "$AUTH" -d "{\"prompt\": \"$long\"}" "$C"
expect "chat longer than the context" 400 context_length_exceeded messages \
    "maximum context length is $CTX" -- \
    -H "$AUTH" -d "{\"messages\": [{\"role\": \"user\", \"content\": \"$long\"}]}" "$H"
head -c 200000 /dev/zero | tr '\0' a | sed 's/^/{"prompt": "/; s/$/"}/' >"$TMP/huge.json"
expect "prompt far longer than the context" 400 context_length_exceeded prompt "at least" -- \
    -H "$AUTH" --data-binary @"$TMP/huge.json" "$C"

# ---- the body limit (1 MiB) ----
head -c 1100000 /dev/zero | tr '\0' a >"$TMP/big"
expect "body over the limit" 413 body_too_large null "larger than the limit" -- \
    -H "$AUTH" --data-binary @"$TMP/big" "$C"
expect "chunked body over the limit" 413 body_too_large null "larger than the limit" -- \
    -H "$AUTH" -H 'Transfer-Encoding: chunked' --data-binary @"$TMP/big" "$C"

# ---- routes, methods, keys ----
expect "unknown route" 404 not_found null "no such endpoint" -- -H "$AUTH" "$SERVE_URL/v1/engines"
expect "unknown route, no key" 404 not_found null "no such endpoint" -- "$SERVE_URL/nope"
expect "GET on completions" 405 method_not_allowed null "use POST" -- -H "$AUTH" "$C"
header_has Allow POST
expect "POST on models" 405 method_not_allowed null "use GET" -- \
    -H "$AUTH" -d '{}' "$SERVE_URL/v1/models"
header_has Allow "GET, HEAD"
expect "DELETE on health" 405 method_not_allowed null "use GET" -- -X DELETE "$SERVE_URL/health"
expect "no key" 401 invalid_api_key null "API key" -- -d '{"prompt": "x"}' "$C"
header_has WWW-Authenticate Bearer
expect "wrong key" 401 invalid_api_key null "API key" -- \
    -H "Authorization: Bearer $KEY-nope" -d '{"prompt": "x"}' "$C"
expect "key as a prefix" 401 invalid_api_key null "API key" -- \
    -H "Authorization: Bearer ${KEY:0:5}" "$SERVE_URL/v1/models"
expect "Basic instead of Bearer" 401 invalid_api_key null "API key" -- \
    -H "Authorization: Basic $KEY" "$SERVE_URL/v1/models"
expect "no key for metrics" 401 invalid_api_key null "API key" -- "$SERVE_URL/metrics"
expect "no key for chat, streaming" 401 invalid_api_key null "API key" -- \
    -d '{"messages": [{"role": "user", "content": "hi"}], "stream": true}' "$H"

# ---- /tokenize, /detokenize, /apply-template ----
T="$SERVE_URL/tokenize"
expect "tokenize without content" 400 missing_required_parameter content "'content'" -- \
    -H "$AUTH" -d '{"add_special": true}' "$T"
expect "tokenize content is a list" 400 invalid_type content "must be a string" -- \
    -H "$AUTH" -d '{"content": ["x"]}' "$T"
expect "tokenize with_pieces is a string" 400 invalid_type with_pieces "must be a boolean" -- \
    -H "$AUTH" -d '{"content": "x", "with_pieces": "yes"}' "$T"
expect "tokenize bad JSON" 400 invalid_json null "not valid JSON" -- -H "$AUTH" -d '{"content"' "$T"
expect "GET tokenize" 405 method_not_allowed null "use POST" -- -H "$AUTH" "$T"
expect "tokenize without key" 401 invalid_api_key null "API key" -- -d '{"content": "x"}' "$T"
expect "detokenize without tokens" 400 missing_required_parameter tokens "'tokens'" -- \
    -H "$AUTH" -d '{}' "$SERVE_URL/detokenize"
expect "detokenize id out of range" 400 invalid_value "tokens[1]" "outside the vocabulary" -- \
    -H "$AUTH" -d '{"tokens": [1, 99999999]}' "$SERVE_URL/detokenize"
expect "detokenize id is a string" 400 invalid_type "tokens[0]" "must be an integer" -- \
    -H "$AUTH" -d '{"tokens": ["1"]}' "$SERVE_URL/detokenize"
expect "apply-template without messages" 400 missing_required_parameter messages "'messages'" -- \
    -H "$AUTH" -d '{}' "$SERVE_URL/apply-template"
expect "apply-template unknown role" 400 invalid_value "messages[0].role" "not supported" -- \
    -H "$AUTH" -d '{"messages": [{"role": "wizard", "content": "x"}]}' "$SERVE_URL/apply-template"

# ---- what the HTTP library answers itself: the server must survive it ----
got=$(curl -s -m 10 -o /dev/null -w '%{http_code}' -H "$AUTH" \
    -H "X-Big: $(head -c 100000 /dev/zero | tr '\0' a)" "$SERVE_URL/v1/models") || true
[ "$got" = 431 ] || [ "$got" = 413 ] || fail "oversized header: status $got"
echo "ok: oversized header -> $got"
# A body shorter than its Content-Length, then the client hangs up; a request line that is
# not HTTP.
python3 - "${SERVE_URL#http://}" "$KEY" <<'EOF' || fail "raw socket requests"
import socket, sys
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=5)
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
          b"Authorization: Bearer " + sys.argv[2].encode() + b"\r\n\r\n{\"prompt\"")
s.close()
s = socket.create_connection((host, int(port)), timeout=5)
s.sendall(b"HELLO THERE\r\n\r\n")
s.recv(4096)
s.close()
EOF
echo "ok: truncated body and garbage request line"

check_bodies

# ---- the server still serves, and counted every refusal once ----
out=$(curl -s -m 30 -w '\n%{http_code}' -H "$AUTH" \
    -d '{"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": true}' "$C")
[ "$(tail -1 <<<"$out")" = 200 ] || fail "a good request failed afterwards: $out"
head -1 <<<"$out" | grep -q '"completion_tokens":6' || fail "unexpected answer: $out"
sse=$(curl -sN -m 30 -H "$AUTH" -d '{"messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4, "stream": true, "ignore_eos": true}' "$H")
grep -q '^data: \[DONE\]' <<<"$sse" || fail "a streaming request failed afterwards: $sse"
[ "$(curl -s -m 5 -o /dev/null -w '%{http_code}' "$SERVE_URL/health")" = 200 ] ||
    fail "/health is not 200 afterwards"

# Aliases, seeds and the defaults SDKs send: accepted, and they mean what they say.
complete() { # BODY: prints "completion_tokens text"; fails on anything but a 200
    local out
    out=$(curl -s -m 30 -w '\n%{http_code}' -H "$AUTH" -d "$1" "$C")
    [ "$(tail -1 <<<"$out")" = 200 ] || fail "request $1 failed: $out"
    head -1 <<<"$out" | python3 -c 'import json,sys; a=json.load(sys.stdin)
print(a["usage"]["completion_tokens"], a["choices"][0]["text"])'
}
a=$(complete '{"prompt": "Once", "n_predict": 5, "ignore_eos": true, "seed": 18446744073709551615}')
b=$(complete '{"prompt": "Once", "max_tokens": 5, "ignore_eos": true, "seed": 18446744073709551615}')
[ "$a" = "$b" ] || fail "n_predict and max_tokens with seed 2^64-1 differ: '$a' vs '$b'"
[ "${a%% *}" = 5 ] || fail "n_predict 5 gave '$a'"
c=$(complete '{"prompt": "Once", "max_tokens": 5, "ignore_eos": true, "seed": 9223372036854775808}')
[ "${c%% *}" = 5 ] || fail "seed 2^63 gave '$c'"
complete '{"prompt": "Once", "max_tokens": 2, "seed": -1, "n": 1, "user": "u", "echo": false,
    "best_of": 1, "repeat_penalty": 1.1, "cache_prompt": true, "typical_p": 1}' >/dev/null
echo "ok: n_predict, seeds 2^63 and 2^64-1, seed -1 and default-valued fields"

# A budget no ring can meet, once admission has seen a few answers: refused, and logged so.
got=$(curl -s -m 30 -o "$TMP/refused" -w '%{http_code}' -H "$AUTH" -d '{"prompt": "Once",
    "max_tokens": 40, "ignore_eos": true, "latency_budget": {"total_ms": 1}}' "$C")
[ "$got" = 429 ] || fail "a 1 ms budget for 40 tokens got $got: $(cat "$TMP/refused")"
n_bad=$((n_bad + 1))

# One access-log line per generation request, at info level.
python3 - "$SERVE_LOG" <<'EOF' || fail "access log"
import re, sys
lines = [l for l in open(sys.argv[1], encoding="utf-8", errors="replace") if "access: id=" in l]
def find(*parts):
    for l in lines:
        if all(p in l for p in parts):
            return l
    sys.exit(f"no access line with {parts}; {len(lines)} access lines, last: {lines[-1:]}")
ok = find("endpoint=/v1/completions", "status=200", "outcome=length", "completion_tokens=5")
assert re.search(r" id=cmpl-[0-9a-f]+ ", ok), ok
assert re.search(r" prompt_tokens=[1-9][0-9]* ", ok), ok
assert re.search(r" first_token_ms=[0-9]+ total_ms=[0-9]+ ", ok), ok
assert re.search(r" est_first_token_ms=([0-9]+|-) est_total_ms=([0-9]+|-)", ok), ok
bad = find("status=400", "outcome=invalid", "code=unsupported_parameter", "param=guided_json")
assert "reason=\"'guided_json': guided decoding" in bad, bad
find("endpoint=/v1/chat/completions", "status=400", "param=messages")
no = find("status=429", "outcome=refused", "code=over_budget", "max_tokens=40")
assert re.search(r' est_first_token_ms=[0-9]+ est_total_ms=[0-9]+ .*reason="(would miss|can never meet)', no), no
print(f"ok: {len(lines)} access lines, e.g. {ok.strip()}")
EOF

curl -s -m 5 -H "$AUTH" "$SERVE_URL/metrics" >"$TMP/metrics"
counted=$(awk '/^kvasir:http_requests_total\{.*code="4[0-9][0-9]"\}/ {n += $2} END {print n + 0}' \
    "$TMP/metrics")
[ "$counted" = "$n_bad" ] || { grep "^kvasir:http_requests_total" "$TMP/metrics"; false; } || fail "/metrics counts $counted 4xx answers, the test got $n_bad"
[ "$(metric http_generations_in_progress)" = 0 ] || fail "generations left in progress"
[ "$(metric kv_blocks_used)" = 0 ] || fail "KV blocks left in use"
[ "$(metric num_requests_running)" = 0 ] || fail "requests left running"
echo "$n_bad bad requests answered and counted; the server still serves"
echo "PASS"
