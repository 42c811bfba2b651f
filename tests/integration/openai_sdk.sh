#!/usr/bin/env bash
# The official OpenAI Node SDK (pinned in node/package-lock.json) against `kvasir serve` on a
# real 2-stage ring with an API key: completions and chat, streaming and not, usage,
# logprobs, stop strings, and the SDK's AuthenticationError / BadRequestError.
# Needs Node.js >= 18 (Debian 12's own nodejs is 18.20: the pinned SDK passes every check
# here on it) and npm (Debian's npm 9 will do) to install the SDK once into
# node/node_modules: without them the test is skipped, except under CI=true where it fails.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

NODE_DIR=$(cd "$(dirname "$0")/node" && pwd)

skip_or_fail() {
    [ "${CI:-}" = true ] && fail "$* (required under CI)"
    echo "SKIP: $*"
    exit 77
}

command -v node >/dev/null || skip_or_fail "node is not installed"
node_major=$(node -p 'process.versions.node.split(".")[0]')
[ "$node_major" -ge 18 ] || skip_or_fail "Node.js $(node --version) is older than 18"

pinned=$(node -p 'require(process.argv[1]).packages["node_modules/openai"].version' \
    "$NODE_DIR/package-lock.json")
installed=$(node -p 'try { require(process.argv[1]).version } catch { "" }' \
    "$NODE_DIR/node_modules/openai/package.json" 2>/dev/null || true)
if [ "$installed" != "$pinned" ]; then
    command -v npm >/dev/null || skip_or_fail "npm is not installed (needed for the openai SDK)"
    echo "installing openai $pinned with npm ci"
    (cd "$NODE_DIR" && timeout 300 npm ci --no-audit --no-fund >"$TMP/npm.log" 2>&1) || {
        tail -20 "$TMP/npm.log"
        skip_or_fail "npm ci failed (no registry?)"
    }
fi

timeout 60 "$KVASIR" synth --shape tiny --type q8_0 --seed 11 -o "$TMP/tiny.gguf" >/dev/null 2>&1 ||
    fail "synth"
key="sk-kvasir-test-$RANDOM$RANDOM"
start_serve sdk "$TMP/tiny.gguf" --stages 2 --api-key "$key" --name kvasir-tiny

KVASIR_BASE_URL="$SERVE_URL/v1" KVASIR_API_KEY="$key" KVASIR_MODEL=kvasir-tiny \
    timeout 300 node --test "$NODE_DIR/sdk_test.mjs" || {
    tail -30 "$SERVE_LOG"
    fail "the OpenAI SDK tests failed"
}
echo "PASS"
