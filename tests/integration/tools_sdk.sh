#!/usr/bin/env bash
# Tool calls and the Responses API through the official OpenAI Node SDK and the OpenAI
# Agents SDK (pinned in agents/package-lock.json) against `kvasir serve` on a 2-stage ring
# of a random-weight model with a Hermes-style tool template (tools/hermes.jinja):
# tools with every tool_choice (required and named forced by the grammar at the tail, their
# arguments validated against the schema by ajv), streamed and not; responses.create plain,
# streamed and with a tool, previous_response_id; an agent run that calls a tool and sends
# its result back through the template. Needs Node.js >= 18 and npm (the pinned openai 7
# declares Node >= 22, yet these tests pass on Debian 12's Node 18.19 and on Node 20);
# without them it is skipped, except under CI=true where it fails.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

DIR=$(cd "$(dirname "$0")" && pwd)
NODE_DIR=$DIR/agents

npm_pinned "$NODE_DIR" openai
npm_pinned "$NODE_DIR" @openai/agents
npm_pinned "$NODE_DIR" ajv

timeout 60 "$KVASIR" synth --shape tiny --ctx 4096 --type q8_0 --seed 11 -o "$TMP/tiny.gguf" >/dev/null 2>&1 ||
    fail "synth"
start_serve tools "$TMP/tiny.gguf" --stages 2 --name kvasir-tiny \
    --chat-template "$DIR/tools/hermes.jinja"

KVASIR_BASE_URL="$SERVE_URL/v1" KVASIR_MODEL=kvasir-tiny \
    timeout 300 node --test "$NODE_DIR/tools_test.mjs" || {
    tail -30 "$SERVE_LOG"
    fail "the tool and Responses SDK tests failed"
}
echo "PASS"
