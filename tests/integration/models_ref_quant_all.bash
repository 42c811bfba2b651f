#!/usr/bin/env bash
# Quantised models against llama.cpp (issue 16, acceptance 2): each architecture's model
# (2 layers, dim 256 so every matrix row fits the K-quants' 256-element blocks) is written
# in F16 and quantised by llama-quantize to every preset of QUANT_PRESETS, then run
# teacher-forced on llama.cpp's own greedy ids (`kvasir run --force-ids`): the argmax equals
# llama.cpp's at >= 98% of the steps where llama.cpp's top-2 margin is >= 0.05, and the
# first 4 steps' logits are within 0.05 max-abs. Quantised arithmetic differs between
# implementations by a few thousandths, so the rule is on near-ties excluded, not exact ids.
#
# Run by hand (CTest runs models_ref_quant.sh: each type alone, and four presets on llama):
#   KVASIR=build/kvasir bash tests/integration/models_ref_quant_all.bash
# On 2026-12-01, after the f16 cache's attention was made to sum as llama.cpp's does, the
# llama model passed every preset (first 4 steps' max-abs 0.0001-0.047; before, 0.034-0.053);
# later that day, with GeGLU's GELU at half precision as the peer's, every architecture but
# gemma3 (3 of 11 presets over) and two llama-family cells were within 0.05. What is left is
# one rounding the other way, which moves logits by 0.02-0.05 and is likelier with more
# layers (docs/QUANT.md has the table and the measurements), so it may still fail.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/models_ref_lib.bash"
need_peer

# The presets whose every tensor type the engine reads (a preset writes a mix of types);
# QUANT_PRESETS="Q5_0 Q2_K" (space-separated) runs only those, QUANT_ARCHS="llama qwen3"
# only those models.
if [ -n "${QUANT_PRESETS:-}" ]; then
    read -r -a QUANT_PRESETS <<< "$QUANT_PRESETS"
else
    QUANT_PRESETS=(Q8_0 Q6_K Q5_K_M Q4_K_M Q4_1 Q5_0 Q5_1 Q3_K_M Q2_K IQ4_NL IQ4_XS)
fi
STEPS=64
LOGIT_SCALE=${LOGIT_SCALE:-1}

n=0
bad=0
for spec in "${ARCH_MODELS[@]}"; do
    name=${spec%%|*}
    [ -z "${QUANT_ARCHS:-}" ] || [[ " $QUANT_ARCHS " == *" $name "* ]] || continue
    synth_arch_model "$spec" f16 256 512 "$TMP/$name-f16.gguf" "$LOGIT_SCALE"
    for preset in "${QUANT_PRESETS[@]}"; do
        model=$TMP/$name-$preset.gguf
        llama_quantize "$TMP/$name-f16.gguf" "$model" "$preset" 2 >"$TMP/quantize.log" 2>&1 ||
            { tail -5 "$TMP/quantize.log"; fail "$name: llama-quantize $preset"; }
        p=${PROMPTS[$((n++ % ${#PROMPTS[@]}))]}
        ref=$TMP/$name-$preset.ref.json
        refgen "$model" "$p" "$STEPS" >"$ref" || fail "$name $preset: refgen"
        refgen "$model" "$p" 4 1 >"$ref.logits" || fail "$name $preset: refgen logits"
        timeout 60 "$KVASIR" run -m "$model" --force-ids "$ref" --json --logits 4 -t 2 \
            >"$TMP/forced.jsonl" 2>"$TMP/run.log" ||
            { cat "$TMP/run.log"; fail "$name $preset: run"; }
        res=$(compare_forced quant "$ref" "$ref.logits" "$TMP/forced.jsonl" 0.05 98 0.05) ||
            { echo "FAIL: $name $preset: $res"; bad=1; continue; }
        echo "ok: $name $preset: $res"
        rm -f "$model"
    done
    rm -f "$TMP/$name-f16.gguf"
done
[ "$bad" = 0 ] || fail "some presets break the rule (above)"
echo "PASS"
