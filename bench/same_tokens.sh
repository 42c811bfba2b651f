#!/usr/bin/env bash
# bench/same_tokens.sh - two builds give the same tokens (a refactor's check, DESIGN.md 7).
#
#   bench/same_tokens.sh -a KVASIR_A -b KVASIR_B [MODEL...]
#
# For each model (default: ../shared/models/stories260K.gguf and synthesized ring-45 Q8_0,
# qwen3moe and gemma3 tiny models), 12 mixed prompts (greedy and seeded sampling) through
# the single-process engine and through a 3-stage ring with 3 micro-batches in flight, with
# each build; every answer file must be byte-identical between the builds (and the ring's
# to the single process's). Prints one line per model and check; exits 1 on a difference.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
A="" B=""
while [ $# -gt 0 ]; do
    case $1 in
    -a) A=$(realpath "$2"); shift 2 ;;
    -b) B=$(realpath "$2"); shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) break ;;
    esac
done
[ -n "$A" ] && [ -n "$B" ] || { echo "same_tokens.sh: -a and -b are required" >&2; exit 2; }
export KVASIR=$A
# shellcheck source=../tests/integration/lib.bash
source "$here/../tests/integration/lib.bash"
models=("$@")
if [ ${#models[@]} -eq 0 ]; then
    models=("$SHARED/models/stories260K.gguf")
    "$A" synth --shape ring-45 --type q8_0 --seed 7 -o "$TMP/ring45.gguf" >/dev/null 2>&1
    "$A" synth --arch qwen3moe --shape tiny --type q8_0 --seed 3 -o "$TMP/qwen3moe.gguf" >/dev/null 2>&1
    "$A" synth --arch gemma3 --shape tiny --type f16 --seed 4 -o "$TMP/gemma3.gguf" >/dev/null 2>&1
    models+=("$TMP/ring45.gguf" "$TMP/qwen3moe.gguf" "$TMP/gemma3.gguf")
fi
mixed_prompts "$TMP/prompts.jsonl"
bad=0
for model in "${models[@]}"; do
    tag=$(basename "$model" .gguf)
    for w in A B; do
        bin=$A
        [ $w = B ] && bin=$B
        KVASIR=$bin
        "$bin" run -m "$model" --prompts "$TMP/prompts.jsonl" --json --ignore-eos -t 2 \
            >"$TMP/$tag.$w.single" 2>/dev/null
        start_ring "$model" 3 3 "$tag-$w"
        "$bin" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json --ignore-eos \
            >"$TMP/$tag.$w.ring" 2>/dev/null
        stop_ring
    done
    for kind in single ring; do
        if cmp -s "$TMP/$tag.A.$kind" "$TMP/$tag.B.$kind" && [ -s "$TMP/$tag.A.$kind" ]; then
            echo "same: $tag, $kind, $(wc -l <"$TMP/$tag.A.$kind") answers"
        else
            echo "DIFFERENT: $tag, $kind"
            bad=1
        fi
    done
    cmp -s "$TMP/$tag.B.single" "$TMP/$tag.B.ring" || { echo "DIFFERENT: $tag, B's ring vs its single process"; bad=1; }
done
exit $bad
