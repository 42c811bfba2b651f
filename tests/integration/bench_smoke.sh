#!/usr/bin/env bash
# `kvasir bench` and `kvasir top` against a real `kvasir serve` (2-stage ring, tiny model):
# an open-loop run with exact prompt lengths writes JSON with completed requests and sane
# percentiles; a closed-loop chat run; a budget no request can meet is refused with 429
# over_budget, quickly; a two-rate sweep writes well-formed SVG; `kvasir top --once` shows
# the ring and both stages. Also: both tools fail fast against a port nobody listens on,
# and bad options are usage errors (exit 2). Every command is bounded by `timeout`.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

timeout 60 "$KVASIR" synth --shape tiny --type q8_0 --seed 3 -o "$TMP/m.gguf" >/dev/null 2>&1 ||
    fail "synth"
start_serve bench "$TMP/m.gguf" --stages 2
for i in $(seq 100); do
    curl -sf -m 2 "$SERVE_URL/health" >/dev/null && break
    [ "$i" = 100 ] && fail "/health never answered 200"
    sleep 0.1
done
# A clean start logs no warning either: the stages come up in any order, and a probe the
# bridge sends before the ring is whole is dropped and sent again, as designed.
if grep -E ' (warn|error)\]' "$SERVE_LOG"; then
    fail "kvasir serve logged warnings while starting"
fi

# 1. Open loop, Poisson 5 req/s for 5 s, prompts of exactly 16 tokens (-m), 8 output tokens.
timeout 120 "$KVASIR" bench --url "$SERVE_URL" -m "$TMP/m.gguf" --rate 5 --duration 5 \
    --prompt-len 16 --output-len 8 --ttft-budget-ms 5000 --total-budget-ms 20000 \
    --json "$TMP/open.json" >"$TMP/open.txt" 2>"$TMP/open.err" ||
    { cat "$TMP/open.err"; fail "bench (open loop) failed"; }
cat "$TMP/open.txt"
grep -q "TTFT" "$TMP/open.txt" || fail "no TTFT row in the table"
python3 - "$TMP/open.json" <<'EOF' || fail "open-loop JSON"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["config"]["exact_prompt_tokens"] is True
(run,) = d["runs"]
s, reqs = run["summary"], run["requests"]
n = s["requests"]["total"]
assert 5 <= n <= 60, f"{n} requests for 5 req/s over 5 s"
assert s["requests"]["ok"] == n, f"not all ok: {s['requests']} {s['errors_by']}"
assert len(reqs) == n
for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
    m = s[key]
    assert m["n"] > 0, key
    assert 0 <= m["min"] <= m["p50"] <= m["p90"] <= m["p99"] <= m["max"], (key, m)
    assert m["max"] < 20000, (key, m)
assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
assert s["throughput"]["requests_per_s"] > 0 and s["throughput"]["output_tokens_per_s"] > 0
assert s["requests"]["met_budget"] == n
sched = [r["scheduled_s"] for r in reqs]
assert sched == sorted(sched) and sched[0] == 0 and sched[-1] < 5
for r in reqs:
    assert r["outcome"] == "ok" and r["status"] == 200, r
    assert r["prompt_tokens"] == 16, r          # exact, from the model's tokenizer
    assert r["output_tokens"] == 8, r           # ignore_eos: always max_tokens
    assert r["ttft_ms"] <= r["e2e_ms"], r
    assert len(r["itl_ms"]) <= 7, r
    assert r["start_s"] >= r["scheduled_s"] - 1e-3, r
print(f"open loop: {n} requests ok, TTFT p50 {s['ttft_ms']['p50']} ms")
EOF

# 2. Closed loop on the chat endpoint, prompt lengths from a range, no tokenizer.
timeout 120 "$KVASIR" bench --url "$SERVE_URL" --endpoint chat --concurrency 2 \
    --num-requests 6 --prompt-len 4:12 --output-len 6 --json "$TMP/closed.json" \
    >"$TMP/closed.txt" 2>&1 || { cat "$TMP/closed.txt"; fail "bench (closed loop) failed"; }
python3 - "$TMP/closed.json" <<'EOF' || fail "closed-loop JSON"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["config"]["mode"] == "closed" and d["config"]["concurrency"] == 2
s = d["runs"][0]["summary"]
assert s["requests"]["total"] == 6 and s["requests"]["ok"] == 6, s["requests"]
assert all(r["output_tokens"] == 6 for r in d["runs"][0]["requests"])
EOF

# 3. A budget nobody can meet (1 ms for 200 tokens) is refused at admission: 429
#    over_budget, each refusal measured, and counted in the summary.
timeout 120 "$KVASIR" bench --url "$SERVE_URL" --rate 20 --num-requests 10 --prompt-len 8 \
    --output-len 200 --ttft-budget-ms 1 --total-budget-ms 1 --json "$TMP/refused.json" \
    >"$TMP/refused.txt" 2>&1 || { cat "$TMP/refused.txt"; fail "bench (refusals) failed"; }
grep -q "429 over_budget" "$TMP/refused.txt" || { cat "$TMP/refused.txt"; fail "no refusal line"; }
python3 - "$TMP/refused.json" <<'EOF' || fail "refusal JSON"
import json, sys
s = json.load(open(sys.argv[1]))["runs"][0]["summary"]
assert s["requests"]["refused"] >= 5, s["requests"]
assert s["requests"]["met_budget"] == 0
(by,) = [b for b in s["refused_by"] if b["reason"] == "over_budget"]
assert by["status"] == 429 and by["n"] == s["requests"]["refused"], s["refused_by"]
r = s["refusal_ms"]
assert r["n"] == s["requests"]["refused"] and 0 < r["p50"] <= r["max"], r
# The spec wants every refusal within 50 ms; on a shared CI machine allow slack, but a
# refusal that takes a second means admission is waiting on something.
assert r["max"] < 1000, r
print(f"refusals: {by['n']}, p50 {r['p50']} ms, max {r['max']} ms")
EOF

# 3b. Such a budget can never be met (the idle ring misses it too): the 429 says so and has
#     no Retry-After, and /metrics counts it as a "never" refusal.
curl -s -m 10 -D "$TMP/never.hdr" -o "$TMP/never.json" "$SERVE_URL/v1/completions" \
    -H 'Content-Type: application/json' \
    -d '{"prompt": "hello there", "max_tokens": 200, "latency_budget": {"total_ms": 1}}' ||
    fail "the never-refused request got no answer"
grep -q "^HTTP/1.1 429" "$TMP/never.hdr" || { cat "$TMP/never.hdr"; fail "expected a 429"; }
grep -qi "^Retry-After" "$TMP/never.hdr" && { cat "$TMP/never.hdr"; fail "a never-refusal sent Retry-After"; }
grep -q "can never meet the total budget" "$TMP/never.json" ||
    { cat "$TMP/never.json"; fail "the refusal does not say the budget can never be met"; }
never=$(curl -s -m 5 "$SERVE_URL/metrics" |
    sed -n 's/^kvasir:admission_refused_total{model_name="[^"]*",reason="total_budget",when="never"} //p')
[ "${never:-0}" -ge 1 ] || fail "no never-refusal counted in /metrics (got '$never')"

# 4. A sweep over two rates with an SVG plot.
timeout 120 "$KVASIR" bench --url "$SERVE_URL" --sweep 2,4 --num-requests 4 --prompt-len 8 \
    --output-len 4 --ttft-budget-ms 5000 --json "$TMP/sweep.json" --svg "$TMP/sweep.svg" \
    --quiet >"$TMP/sweep.txt" 2>&1 || { cat "$TMP/sweep.txt"; fail "bench (sweep) failed"; }
cat "$TMP/sweep.txt"
python3 - "$TMP/sweep.json" "$TMP/sweep.svg" <<'EOF' || fail "sweep JSON/SVG"
import json, sys
import xml.etree.ElementTree as ET
d = json.load(open(sys.argv[1]))
assert [r["offered_rate"] for r in d["runs"]] == [2.0, 4.0]
assert all(r["summary"]["requests"]["ok"] == 4 for r in d["runs"])
root = ET.parse(sys.argv[2]).getroot()
assert root.tag == "{http://www.w3.org/2000/svg}svg"
names = {g.get("data-name") for g in root.iter("{http://www.w3.org/2000/svg}g")}
for want in ("TTFT p50", "TTFT p99", "E2E p50", "E2E p99", "goodput", "TTFT budget"):
    assert want in names, (want, names)
EOF

# 5. kvasir top --once: the ring is up and both stages have a row of bars.
timeout 30 "$KVASIR" top --url "$SERVE_URL" --once >"$TMP/top.txt" || fail "top --once failed"
cat "$TMP/top.txt"
grep -q "ring UP" "$TMP/top.txt" || fail "top: ring not shown up"
grep -q "2 stages" "$TMP/top.txt" || fail "top: stage count"
grep -Eq '^ +0  \[[#.]+\] +[0-9.]+%' "$TMP/top.txt" || fail "top: no bars for stage 0"
grep -Eq '^ +1  \[[#.]+\] +[0-9.]+%' "$TMP/top.txt" || fail "top: no bars for stage 1"
grep -q $'\033' "$TMP/top.txt" && fail "top --once printed escape codes"
# --count with a short interval: two plain snapshots, the second with rates.
timeout 30 "$KVASIR" top --url "$SERVE_URL" --count 2 --interval 0.2 >"$TMP/top2.txt" ||
    fail "top --count failed"
[ "$(grep -c '^kvasir top' "$TMP/top2.txt")" = 2 ] || fail "top --count 2: $(cat "$TMP/top2.txt")"
grep -q "admitted [0-9]* ([0-9.]*/s)" "$TMP/top2.txt" || fail "top: no admission rate"

# 6. Nobody listening: both fail quickly with exit 1; bad options exit 2.
dead=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
rc=0
timeout 20 "$KVASIR" bench --url "http://127.0.0.1:$dead" --rate 1 --num-requests 1 \
    >/dev/null 2>"$TMP/dead.err" || rc=$?
[ "$rc" = 1 ] || fail "bench against a dead port exited $rc: $(cat "$TMP/dead.err")"
grep -q "cannot reach" "$TMP/dead.err" || fail "bench: $(cat "$TMP/dead.err")"
rc=0
timeout 20 "$KVASIR" top --url "http://127.0.0.1:$dead" --once >"$TMP/dead.out" || rc=$?
[ "$rc" = 1 ] || fail "top against a dead port exited $rc"
grep -q UNREACHABLE "$TMP/dead.out" || fail "top: $(cat "$TMP/dead.out")"
for bad in "--rate 1 --concurrency 2" "--rate 0" "--rate 1 --prompt-len 9:3" \
    "--rate 1 --svg x.svg" "--sweep 1,,2" "--concurrency 1 --bogus"; do
    rc=0
    # shellcheck disable=SC2086
    timeout 10 "$KVASIR" bench $bad >/dev/null 2>&1 || rc=$?
    [ "$rc" = 2 ] || fail "bench $bad exited $rc, want 2"
done
rc=0
timeout 10 "$KVASIR" top --interval 0 >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "top --interval 0 exited $rc, want 2"
# A clean stop (SIGTERM to the server and its stages at once, as timeout sends it) logs no
# warning: the bridge stops first, then the stages from the head on.
n_before=$(wc -l <"$SERVE_LOG")
stop_serve
if tail -n +"$((n_before + 1))" "$SERVE_LOG" | grep -E ' (warn|error)\]'; then
    fail "kvasir serve logged warnings while stopping"
fi
tail -n +"$((n_before + 1))" "$SERVE_LOG" | grep -q ' stopping$' ||
    fail "kvasir serve did not log its stop"
echo "bench_smoke: ok"
