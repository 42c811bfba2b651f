#!/usr/bin/env bash
# Constrained decoding through a real ring (issue 36, acceptances 1 and 5): `kvasir serve`
# (2 stages, a random-weight model) answers 111 JSON schemas three times each, sampled;
# every finished answer parses and validates (json_schema_suite.py, python3-jsonschema),
# and 40 unsupported keywords are refused naming their JSON pointer. Then greedy tokens are
# the same with and without a grammar that allows the greedy answer at every step, alone
# and in a batch beside free sequences.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

python3 -c 'import jsonschema' 2>/dev/null || {
    [ "${CI:-}" = true ] && fail "python3-jsonschema missing under CI (scripts/deps.sh test)"
    echo "SKIP: python3-jsonschema not installed"
    exit 77
}
timeout 60 "$KVASIR" synth --shape custom --layers 2 --dim 64 --ff 128 --heads 4 --ctx 2048 \
    --seed 3 -o "$TMP/m.gguf" >/dev/null 2>&1 || fail "synth"
start_serve schema "$TMP/m.gguf" --stages 2 --ctx 2048 --max-seqs 8

timeout 600 python3 "$(dirname "$0")/json_schema_suite.py" "$SERVE_URL" \
    "$(dirname "$0")/json_schema" || fail "schema suite"
timeout 120 python3 "$(dirname "$0")/grammar_identical.py" "$SERVE_URL" ||
    fail "grammar changed greedy tokens"
echo "PASS"
