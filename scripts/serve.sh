#!/usr/bin/env bash
# The one-command demo: set up, build, synthesise a model (unless MODEL names one), and
# serve it from a ring of STAGES stage processes on this machine with the OpenAI API on
# http://127.0.0.1:${PORT:-8080}. Ctrl-C stops everything.
#
#   scripts/serve.sh                      tinyllama-1.1b shape, Q4_0, random weights, 2 stages
#   MODEL=path/to/model.gguf scripts/serve.sh
#   STAGES=3 SHAPE=ring-45 TYPE=q8_0 THREADS=4 scripts/serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
model=${MODEL:-}
if [ -z "$model" ]; then
    shape=${SHAPE:-tinyllama-1.1b} type=${TYPE:-q4_0}
    model=models/$shape-$type.gguf
    if [ ! -f "$model" ]; then
        mkdir -p models
        echo "serve: synthesising $model (random weights; a real GGUF works too: MODEL=...)"
        build/kvasir synth --shape "$shape" --type "$type" -o "$model"
    fi
fi
# THREADS (per stage) overrides serve's default: this machine's cores over its stages.
threads=()
[ -z "${THREADS:-}" ] || threads=(--threads "$THREADS")
exec build/kvasir serve -m "$model" --stages "${STAGES:-2}" --port "${PORT:-8080}" \
    "${threads[@]}" "$@"
