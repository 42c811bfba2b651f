#!/usr/bin/env bash
# Mixture-of-experts models against llama.cpp in Q8_0 (issue 11, acceptance 1; the F32 half
# is models_ref.sh, whose ARCH_MODELS hold the MoE rows too): each MoE model of MOE_MODELS
# (2 layers, dim 128; Mixtral-style 8 experts top-2, Qwen3-MoE 16 experts top-4, Qwen2-MoE
# 8 experts top-2 with its shared expert, gpt-oss 8 experts top-2 with its biases and sinks)
# is written in F16, quantised to Q8_0 by the peer's
# llama-quantize, and run teacher-forced on llama.cpp's own 64 greedy ids for 3 prompts
# (`kvasir run --force-ids`): the argmax equals llama.cpp's at >= 98% of the steps where
# llama.cpp's top-2 margin is >= 0.05, and the first 4 steps' logits are within 0.05
# max-abs (issue 16's rule). The rule is not loosened for routing: synth builds its routers
# so that no token is near a tie between its k-th and (k+1)-th expert (model/synth.h), so
# rounding differences between the engines never route a token differently.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/models_ref_lib.bash"
need_peer

for spec in "${MOE_MODELS[@]}"; do
    name=${spec%%|*}
    synth_arch_model "$spec" f16 128 256 "$TMP/$name-f16.gguf" 1
    model=$TMP/$name-q8_0.gguf
    llama_quantize "$TMP/$name-f16.gguf" "$model" Q8_0 2 >"$TMP/quantize.log" 2>&1 ||
        { tail -5 "$TMP/quantize.log"; fail "$name: llama-quantize Q8_0"; }
    rm -f "$TMP/$name-f16.gguf"
    for i in "${!PROMPTS[@]}"; do
        p=${PROMPTS[$i]}
        ref=$TMP/$name.$i.ref.json
        refgen "$model" "$p" 64 >"$ref" || fail "$name: refgen"
        refgen "$model" "$p" 4 1 >"$ref.logits" || fail "$name: refgen logits"
        timeout 60 "$KVASIR" run -m "$model" --force-ids "$ref" --json --logits 4 -t 2 \
            >"$TMP/forced.jsonl" 2>"$TMP/run.log" || { cat "$TMP/run.log"; fail "$name: run"; }
        res=$(compare_forced quant "$ref" "$ref.logits" "$TMP/forced.jsonl" 0.05 98 0.05) ||
            fail "$name Q8_0, prompt $i: $res"
        echo "ok: $name Q8_0, prompt $i: $res"
    done
    rm -f "$model"
done

# gpt-oss with its experts in MXFP4 (llama-quantize MXFP4_MOE: experts MXFP4, the other
# matrices Q8_0; issue 35, acceptance 2): the argmax equals llama.cpp's at every step where
# its margin is >= 0.05.
for spec in "${MOE_MODELS[@]}"; do
    name=${spec%%|*}
    [ "$name" = gpt-oss ] || continue
    synth_arch_model "$spec" f16 128 256 "$TMP/$name-f16.gguf" 1
    model=$TMP/$name-mxfp4.gguf
    llama_quantize "$TMP/$name-f16.gguf" "$model" MXFP4_MOE 2 >"$TMP/quantize.log" 2>&1 ||
        { tail -5 "$TMP/quantize.log"; fail "$name: llama-quantize MXFP4_MOE"; }
    rm -f "$TMP/$name-f16.gguf"
    "$KVASIR" info "$model" | grep -q "mxfp4 [0-9]* bytes" || fail "$name: no MXFP4 tensors"
    for i in "${!PROMPTS[@]}"; do
        p=${PROMPTS[$i]}
        ref=$TMP/$name.$i.mx.json
        refgen "$model" "$p" 64 >"$ref" || fail "$name: refgen"
        refgen "$model" "$p" 4 1 >"$ref.logits" || fail "$name: refgen logits"
        timeout 60 "$KVASIR" run -m "$model" --force-ids "$ref" --json --logits 4 -t 2 \
            >"$TMP/forced.jsonl" 2>"$TMP/run.log" || { cat "$TMP/run.log"; fail "$name: run"; }
        res=$(compare_forced quant "$ref" "$ref.logits" "$TMP/forced.jsonl" 0.05 100 0.05) ||
            fail "$name MXFP4_MOE, prompt $i: $res"
        echo "ok: $name MXFP4_MOE, prompt $i: $res"
    done
    rm -f "$model"
done
echo "PASS"
