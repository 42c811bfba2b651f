#!/usr/bin/env bash
# The console (GET /, docs/API.md) in Debian's chromium, driven headless by playwright-core
# (tests/browser/console_test.mjs), against `kvasir serve` on a real 3-stage ring with an API
# key: the page is served without the key and asks for it when the API answers 401; no
# request leaves the server and no console error; every stage's lane fills with batches
# under load; a chat answer streams in; stage 1, SIGKILLed under load, shows as lost and
# then recovered (serve restarts it). Screenshots (console-*.png) go to $KVR_BUILD, the
# build folder under CTest, so CI keeps them under build/.
# Needs Node.js >= 18, npm (to install the pinned playwright-core once into
# tests/browser/node_modules) and chromium: without them the test is skipped, except under
# CI=true where it fails.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

BROWSER_DIR=$(cd "$(dirname "$0")/../browser" && pwd)
CHROMIUM=${KVR_CHROMIUM:-/usr/bin/chromium}
SHOTS=${KVR_BUILD:-$TMP}

npm_pinned "$BROWSER_DIR" playwright-core
[ -x "$CHROMIUM" ] || skip_or_fail "no chromium at $CHROMIUM (apt-get install chromium)"

# First the page's own logic against the stub ring (stub_server.mjs): a refusal on demand,
# a lost stage, and at least 30 frames/s with 8 stages at 100 batches/s.
mkdir -p "$SHOTS/stub"
KVR_CONSOLE_SHOTS=$SHOTS/stub KVR_CHROMIUM=$CHROMIUM timeout 300 node "$BROWSER_DIR/console_test.mjs" ||
    fail "the browser test of the console against the stub ring failed"
echo "ok: the page against the stub ring"

timeout 60 "$KVASIR" synth --shape tiny --type q8_0 --seed 11 -o "$TMP/tiny.gguf" >/dev/null 2>&1 ||
    fail "synth"
key="sk-kvasir-test-$RANDOM$RANDOM"
start_serve console "$TMP/tiny.gguf" --stages 3 --api-key "$key" --name kvasir-tiny

# The page needs no key; the API it calls does.
code=$(curl -s -m 5 -o "$TMP/index.html" -w '%{http_code}' "$SERVE_URL/")
[ "$code" = 200 ] && grep -q console.js "$TMP/index.html" || fail "GET / without the key: $code"
code=$(curl -s -m 5 -o /dev/null -w '%{http_code}' "$SERVE_URL/v1/telemetry")
[ "$code" = 401 ] || fail "GET /v1/telemetry without the key answered $code, not 401"
echo "ok: GET / is served without the key, /v1/telemetry wants it"

# Stage 1 by its pid, from a script of its own: `sh -c "kill $(pgrep -f PATTERN)"` would
# find that shell too, whose command line holds the pattern.
plan=$TMP/console-plan/plan.json
pgrep -f "stage --plan $plan --index 1\$" >/dev/null || fail "serve: no stage 1"
printf '%s\n' "pid=\$(pgrep -f 'stage --plan $plan --index 1\$') || exit 1" \
    'echo "killing stage 1 (pid $pid)"' 'kill -9 $pid' >"$TMP/kill_stage1.sh"
KVR_CONSOLE_URL=$SERVE_URL KVR_API_KEY=$key KVR_CONSOLE_SHOTS=$SHOTS KVR_CHROMIUM=$CHROMIUM \
    KVR_CONSOLE_KILL="bash $TMP/kill_stage1.sh" \
    timeout 300 node "$BROWSER_DIR/console_test.mjs" || {
    tail -30 "$SERVE_LOG"
    fail "the browser test of the console failed"
}
grep -q "stage 1 died" "$SERVE_LOG" || fail "serve did not see stage 1 die"
echo "PASS"
