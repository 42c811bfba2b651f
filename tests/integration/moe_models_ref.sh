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
    quant_forced "$spec" Q8_0 128 256 98 0.05
done

# gpt-oss with its experts in MXFP4 (llama-quantize MXFP4_MOE: experts MXFP4, the other
# matrices Q8_0; issue 35, acceptance 2): the argmax equals llama.cpp's at every step where
# its margin is >= 0.05.
for spec in "${MOE_MODELS[@]}"; do
    if [ "${spec%%|*}" = gpt-oss ]; then quant_forced "$spec" MXFP4_MOE 128 256 100 0.05; fi
done
echo "PASS"
