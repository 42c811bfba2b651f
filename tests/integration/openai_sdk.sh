#!/usr/bin/env bash
# The official OpenAI Node SDK (pinned in node/package-lock.json) against `kvasir serve` on a
# real 2-stage ring with an API key: completions and chat, streaming and not, usage,
# logprobs and top_logprobs, n > 1, stop strings, and the SDK's AuthenticationError /
# BadRequestError.
# Needs Node.js >= 18 (Debian 12's own nodejs is 18.20: the pinned SDK passes every check
# here on it) and npm (Debian's npm 9 will do) to install the SDK once into
# node/node_modules: without them the test is skipped, except under CI=true where it fails.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

NODE_DIR=$(cd "$(dirname "$0")/node" && pwd)

npm_pinned "$NODE_DIR" openai

timeout 60 "$KVASIR" synth --shape tiny --type q8_0 --seed 11 -o "$TMP/tiny.gguf" >/dev/null 2>&1 ||
    fail "synth"
key="sk-kvasir-test-$RANDOM$RANDOM"
start_serve sdk "$TMP/tiny.gguf" --stages 2 --api-key "$key" --name kvasir-tiny

KVASIR_BASE_URL="$SERVE_URL/v1" KVASIR_API_KEY="$key" KVASIR_MODEL=kvasir-tiny \
    timeout 300 node --test "$NODE_DIR/sdk_test.mjs" "$NODE_DIR/sdk_choices_test.mjs" || {
    tail -30 "$SERVE_LOG"
    fail "the OpenAI SDK tests failed"
}
echo "PASS"
