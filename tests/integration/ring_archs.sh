#!/usr/bin/env bash
# Bit-identical tokens for every architecture (issue 16, acceptance 3; DESIGN.md 7): one
# small Q8_0 model per architecture of the table (biases, q/k norms, post-norms, fused
# tensors, a sliding window of 8 positions for gemma, deepseek2's latent attention), 12 concurrent sequences of mixed
# prompt lengths (6 greedy, 6 sampled with seeds) give exactly the same tokens through the
# single-process engine (each sequence alone) and through a 3-stage ring in flight. The
# plan balancer splits each model (its layer weights come from the table's tensor names).
set -euo pipefail
source "$(dirname "$0")/lib.bash"

mixed_prompts "$TMP/prompts.jsonl"

for spec in "llama|" "qwen2|--tied" "qwen3|--head-dim 32" "gemma2|--swa 8" \
    "gemma3|--swa 8 --layers 6" "phi3|" "deepseek2|--q-lora 32" "gpt-oss|--swa 8"; do
    arch=${spec%%|*}
    extra=${spec#*|}
    model=$TMP/$arch.gguf
    # shellcheck disable=SC2086 # extra holds several options
    "$KVASIR" synth --arch "$arch" --shape tiny --layers 4 --type q8_0 --seed 5 \
        --logit-scale 4 $extra -o "$model" >/dev/null 2>&1 || fail "synth $arch"
    timeout 120 "$KVASIR" run -m "$model" --prompts "$TMP/prompts.jsonl" --json --ignore-eos \
        -t 1 >"$TMP/$arch.ref.jsonl" 2>"$TMP/$arch.ref.log" ||
        { cat "$TMP/$arch.ref.log"; fail "$arch: single-process run"; }
    [ "$(wc -l <"$TMP/$arch.ref.jsonl")" = 12 ] || fail "$arch: expected 12 reference lines"
    start_ring "$model" 3 3 "$arch"
    split=$(python3 -c 'import json, sys
print(" ".join("%d-%d" % tuple(s["layers"]) for s in json.load(open(sys.argv[1]))["stages"]))' \
        "$RING_PLAN")
    timeout 120 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
        --ignore-eos >"$TMP/$arch.ring.jsonl" 2>"$TMP/$arch.ring.log" ||
        { cat "$TMP/$arch.ring.log"; fail "$arch: ring of 3 stages"; }
    stop_ring
    if ! cmp -s "$TMP/$arch.ref.jsonl" "$TMP/$arch.ring.jsonl"; then
        diff "$TMP/$arch.ref.jsonl" "$TMP/$arch.ring.jsonl" | head -20
        fail "$arch: the 3-stage ring differs from the single process"
    fi
    # The balancer weighs a layer by its tensors' bytes, named by the architecture table: a
    # model of as many layers is split like the llama one (fused or extra tensors included).
    case $arch in
    llama) llama_split=$split ;;
    gemma3 | deepseek2) ;; # more layers; latent attention's own tensors
    *) [ "$split" = "$llama_split" ] || fail "$arch: plan splits $split, llama $llama_split" ;;
    esac
    echo "ok: $arch, 3 stages (layers $split), 3 micro-batches: 12/12 sequences identical"
done
echo "PASS"
