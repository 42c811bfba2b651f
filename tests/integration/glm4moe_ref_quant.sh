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
    if [[ ${spec%%|*} == glm4moe* ]]; then quant_forced "$spec" Q4_K_M 256 512 100 0.1; fi
done
echo "PASS"
