#!/usr/bin/env bash
# Readiness: the bridge answers HTTP at once, before its ring exists. While the ring forms
# /health and /readyz answer 503 with each stage's state (connecting, with the last error
# for the head it cannot reach), /livez answers 200, the log says which stage it waits
# for; once the stages run, all three answer 200 and every stage is "up"; when the tail is
# killed, /health is 503 again with the tail "down" since then and why.
set -euo pipefail
source "$(dirname "$0")/lib.bash"

"$KVASIR" synth --shape tiny --seed 3 -o "$TMP/tiny.gguf" >/dev/null 2>&1 || fail "synth tiny"
dir=$TMP/ring
mkdir -p "$dir"
base=$(reserve_base_port)
"$KVASIR" plan -m "$TMP/tiny.gguf" --stages 3 --microbatches 3 --base-port "$base" \
    -o "$dir/plan.json" 2>/dev/null || fail "kvasir plan"

"$KVASIR" bridge --plan "$dir/plan.json" --port 0 >"$TMP/bridge.out" 2>"$TMP/bridge.log" &
PIDS+=($!)
url=""
for i in $(seq 1 100); do
    url=$(sed -n 's/.*listening on \(http:\/\/[0-9.:]*\);.*/\1/p' "$TMP/bridge.log" | head -1)
    [ -n "$url" ] && break
    sleep 0.1
done
[ -n "$url" ] || { cat "$TMP/bridge.log"; fail "the bridge did not listen for HTTP before its ring"; }
code() { curl -s -o "$TMP/body.json" -w '%{http_code}' -m 5 "$url$1"; }
field() { python3 -c "import json,sys; d=json.load(open('$TMP/body.json')); print(eval(sys.argv[1]))" "$1"; }

sleep 1.2 # a few dialling attempts
[ "$(code /livez)" = 200 ] || fail "/livez without a ring: expected 200"
[ "$(code /readyz)" = 503 ] || fail "/readyz without a ring: expected 503"
[ "$(code /health)" = 503 ] || fail "/health without a ring: expected 503"
[ "$(field 'd["ring"]')" = down ] || fail "/health: ring not down"
[ "$(field 'd["stages"][0]["state"]')" = connecting ] || fail "/health: stage 0 not connecting"
[ "$(field 'd["stages"][2]["state"]')" = connecting ] || fail "/health: stage 2 not connecting"
field 'd["stages"][0]["last_error"]' | grep -q "refused" || fail "/health: stage 0 has no error"
python3 -c "import json; d=json.load(open('$TMP/body.json')); assert all(s['since_s'] >= 1 for s in d['stages'])" ||
    fail "/health: since_s does not count from the start"
grep -q "waiting for the head (stage 0) at 127.0.0.1:$base" "$TMP/bridge.log" ||
    fail "the log does not say which stage it waits for"
echo "ok: before the ring: /livez 200, /readyz and /health 503, stage 0 connecting: $(field 'd["stages"][0]["last_error"]')"

pids=()
for i in 0 1 2; do
    "$KVASIR" stage --plan "$dir/plan.json" --index "$i" >"$dir/stage$i.log" 2>&1 &
    PIDS+=($!)
    pids+=($!)
done
for i in $(seq 1 100); do
    grep -q "^kvasir: ready on" "$TMP/bridge.out" && break
    sleep 0.1
done
grep -q "^kvasir: ready on" "$TMP/bridge.out" || { tail "$TMP/bridge.log"; fail "the ring did not come up"; }
[ "$(code /health)" = 200 ] || fail "/health with the ring up: expected 200"
[ "$(field 'd["status"]')" = ok ] || fail "/health: status not ok"
[ "$(field '",".join(s["state"] for s in d["stages"])')" = up,up,up ] || fail "/health: not every stage up"
# What the start-up waited for (stage 0 refused connections, every stage reset its link)
# was no failure: a ring that came up cleanly shows no error.
[ "$(field 'sum("last_error" in s for s in d["stages"])')" = 0 ] ||
    fail "/health: a stage of a clean start shows an error: $(curl -s "$url/health")"
[ "$(code /readyz)" = 200 ] || fail "/readyz with the ring up: expected 200"
echo "ok: the ring up: /health and /readyz 200, stages up,up,up"

kill -9 "${pids[2]}"
for i in $(seq 1 50); do
    [ "$(code /health)" = 503 ] && break
    sleep 0.1
done
[ "$(code /health)" = 503 ] || fail "/health after the tail died: expected 503"
[ "$(field 'd["stages"][2]["state"]')" = down ] || fail "/health: the tail not down"
echo "ok: the tail killed: /health 503, stage 2 down: $(field 'd["stages"][2]["last_error"]')"
[ "$(code /livez)" = 200 ] || fail "/livez with a broken ring: expected 200"
echo PASS
