#!/usr/bin/env bash
# glm4moe at Q4_K_M against llama.cpp (issue 35, acceptance 2): both glm4moe models of
# models_ref_lib.bash's MOE_MODELS (without q/k norms; with them and expert groups), written
# in F16 at dim 256 (every matrix row a whole number of K-quant blocks), quantised to Q4_K_M
# by the peer's llama-quantize and run teacher-forced on llama.cpp's own 64 greedy ids for
# 3 prompts (`kvasir run --force-ids`): the argmax equals llama.cpp's at every step where
# llama.cpp's top-2 margin is >= 0.05, and the first 4 steps' logits are within 0.1 max-abs
# (models_ref_quant.sh says why 0.1 and not 0.05). The router and the selection bias stay
# F32 in the quantised file, and synth keeps routing decided by wide margins
# (model/synth.h), so the engines never route a token differently.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/models_ref_lib.bash"
need_peer

for spec in "${MOE_MODELS[@]}"; do
    name=${spec%%|*}
    [[ $name == glm4moe* ]] || continue
    synth_arch_model "$spec" f16 256 512 "$TMP/$name-f16.gguf" 1
    model=$TMP/$name-q4_k_m.gguf
    llama_quantize "$TMP/$name-f16.gguf" "$model" Q4_K_M 2 >"$TMP/quantize.log" 2>&1 ||
        { tail -5 "$TMP/quantize.log"; fail "$name: llama-quantize Q4_K_M"; }
    rm -f "$TMP/$name-f16.gguf"
    for i in "${!PROMPTS[@]}"; do
        p=${PROMPTS[$i]}
        ref=$TMP/$name.$i.ref.json
        refgen "$model" "$p" 64 >"$ref" || fail "$name: refgen"
        refgen "$model" "$p" 4 1 >"$ref.logits" || fail "$name: refgen logits"
        timeout 60 "$KVASIR" run -m "$model" --force-ids "$ref" --json --logits 4 -t 2 \
            >"$TMP/forced.jsonl" 2>"$TMP/run.log" || { cat "$TMP/run.log"; fail "$name: run"; }
        res=$(compare_forced quant "$ref" "$ref.logits" "$TMP/forced.jsonl" 0.05 100 0.1) ||
            fail "$name Q4_K_M, prompt $i: $res"
        echo "ok: $name Q4_K_M, prompt $i: $res"
    done
    rm -f "$model"
done
echo "PASS"
