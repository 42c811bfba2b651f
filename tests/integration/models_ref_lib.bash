# models_ref_lib.bash - helpers for the tests against llama.cpp (sourced, not run): the peer's
# refgen and llama-quantize, one small model per architecture, and the comparison script.
# Needs lib.bash first.

PEER=$SHARED/peers/llama.cpp

# need_peer: check the peer kit and set PEER_ENV (run the peer as `env "${PEER_ENV[@]}" ...`).
# A kit copied without its symlinks has lib/libllama.so.0 etc. as small text files that
# hold the link target; then a private lib dir of real links goes first on the search path.
need_peer() {
    need_shared peers/llama.cpp/bin/refgen >/dev/null
    local libdir=$TMP/peerlib f
    mkdir -p "$libdir"
    for f in "$PEER"/lib/*.so*; do
        if [ "$(stat -c %s "$f")" -lt 256 ] && head -c 4 "$f" | grep -q '^lib'; then
            ln -sf "$PEER/lib/$(cat "$f")" "$libdir/$(basename "$f")"
        fi
    done
    PEER_ENV=(LD_LIBRARY_PATH="$libdir:$PEER/lib")
    env "${PEER_ENV[@]}" "$PEER/bin/refgen" "$SHARED/models/stories260K.gguf" "Once" 1 \
        >/dev/null 2>"$TMP/peer-check.log" ||
        { tail -3 "$TMP/peer-check.log"; fail "the peer's refgen does not run"; }
}

refgen() { env "${PEER_ENV[@]}" "$PEER/bin/refgen" "$@" 2>>"$TMP/refgen.log"; }
llama_quantize() { env "${PEER_ENV[@]}" "$PEER/bin/llama-quantize" "$@"; }

# One model per architecture (and the llama variants real files come in):
#   name | arch | vocab (in ../shared/vocab) | extra synth options
# Each with the vocabulary its real files carry (Gemma's and Phi-3's are SentencePiece;
# the Llama one stands in).
ARCH_MODELS=(
    "llama|llama|llama-spm|"
    "llama3|llama|llama-bpe|--rope-freqs --rope-base 500000"
    "mistral|llama|llama-spm|--kv-heads 1 --head-dim HD --rope-base 1000000 --rope-scale 2"
    "qwen2|qwen2|qwen2|--tied --rope-base 1000000"
    "qwen3|qwen3|qwen2|--head-dim HD --rope-base 1000000"
    "gemma2|gemma2|llama-spm|--swa 8"
    "gemma3|gemma3|llama-spm|--swa 8 --layers 6"
    "phi3|phi3|llama-spm|"
)

# The mixtures of experts (issue 11, docs/EXPERTS.md): Mixtral-style llama (8 experts,
# top-2), Qwen3-MoE (16 experts, top-4, Qwen 3's wide heads, the real Qwen vocabulary),
# Qwen2-MoE (8 experts, top-2, a shared expert), GLM-4.5 (glm4moe: 16 experts top-4,
# sigmoid routing with the selection bias, an ungated shared expert, layer 0 dense, a NextN
# block, partial RoPE; without q/k norms as GLM-4.5-Air, and with them and expert groups),
# DeepSeek V3-style deepseek2 (16 experts top-4 in 4 groups of which 2 are used, 2 shared,
# a leading dense layer, scaled weights) and gpt-oss (8 experts, top-2, biases, sinks, a
# window of 8 on every other layer, YaRN; GPT-2's BPE stands in for its o200k vocabulary).
# They are in ARCH_MODELS too, so models_ref.sh compares them in F32; moe_models_ref.sh in
# Q8_0 (and gpt-oss in MXFP4_MOE).
MOE_MODELS=(
    "mixtral|mixtral|llama-spm|"
    "qwen3moe|qwen3moe|qwen2|--head-dim HD --rope-base 1000000"
    "qwen2moe|qwen2moe|gpt-2|--rope-base 1000000"
    "glm4moe|glm4moe|qwen2|--rope-base 1000000 --expert-scale 2.5"
    "glm4moe-qknorm|glm4moe|qwen2|--qk-norm --expert-groups 4 --groups-used 2"
    "deepseek2-groups|deepseek2|llama-bpe|--q-lora 32 --layers 3 --experts 16 --experts-used 4 --shared-experts 2 --dense-layers 1 --expert-ff 64 --expert-groups 4 --groups-used 2 --expert-scale 2.5"
    "gpt-oss|gpt-oss|gpt-2|--swa 8 --rope-base 150000"
)
ARCH_MODELS+=("${MOE_MODELS[@]}")

# deepseek2's latent attention (issue 35, model/mla.h): with q_lora_rank, with the older
# fused attn_kv_b, without q_lora_rank (the peer reads a file without it only at
# DeepSeek-V2-Lite's 27 or 26 layers, so that one has 26), with YaRN, and with experts
# (8, top-2, a shared one, a leading dense layer).
MLA_MODELS=(
    "deepseek2|deepseek2|llama-bpe|--q-lora 32"
    "deepseek2-fused|deepseek2|llama-bpe|--q-lora 32 --kv-b-fused"
    "deepseek2-lite|deepseek2|llama-bpe|--layers 26"
    "deepseek2-yarn|deepseek2|llama-bpe|--q-lora 32 --yarn 4 --yarn-log-mul 0.3"
    "deepseek2-moe|deepseek2|llama-bpe|--q-lora 32 --layers 3 --experts 8 --experts-used 2 --shared-experts 1 --dense-layers 1 --expert-ff 64"
)
ARCH_MODELS+=("${MLA_MODELS[@]}")

# synth_arch_model SPEC TYPE DIM FF OUT [LOGIT_SCALE]: write SPEC's model (TYPE f32 or f16;
# logit scale 8 unless given). HD in the options is a head width of dim / 2 (queries twice
# as wide as the model, as in Qwen 3).
synth_arch_model() {
    local spec=$1 type=$2 dim=$3 ff=$4 out=$5 scale=${6:-8} name arch vocab extra
    IFS='|' read -r name arch vocab extra <<<"$spec"
    local v
    v=$(need_shared "vocab/ggml-vocab-$vocab.gguf")
    extra=${extra//HD/$((dim / 2))}
    # shellcheck disable=SC2086 # extra holds several options
    "$KVASIR" synth --arch "$arch" --shape custom --layers 2 --dim "$dim" --ff "$ff" \
        --heads 4 --kv-heads 2 --ctx 512 --type "$type" --seed 3 --logit-scale "$scale" \
        --vocab "$v" $extra -o "$out" >"$out.log" 2>&1 || { cat "$out.log"; fail "synth $name"; }
}

PROMPTS=(
    "Once upon a time there was a little girl who loved to play"
    "The quick brown fox jumps over the lazy dog, and then"
    "In 1492, Columbus sailed 3 ships: Niña, Pinta & Santa María!"
)

# compare_forced MODE REF REF_LOGITS OURS ARGS...: check Kvasir's teacher-forced steps (run
# --force-ids REF --json --logits N) against refgen's JSON REF (ids and margins) and
# REF_LOGITS (a shorter refgen run of the same prompt with its logits). Modes:
#   exact TOL            the logits of the steps both dumped within TOL relative max-abs
#                        (max |ours - ref| / max |ref|)
#   quant MIN_MARGIN PCT ABS
#                        argmax == refgen's id at >= PCT% of the steps where refgen's margin
#                        >= MIN_MARGIN, and the dumped steps' logits within ABS max-abs
# Prints one summary line; exits 1 when the rule fails.
compare_forced() {
    python3 - "$@" <<'PY'
import json, sys
mode, ref_path, logits_path, ours_path = sys.argv[1:5]
ref = json.load(open(ref_path))["steps"]
ours = [json.loads(l) for l in open(ours_path)]
if len(ours) != len(ref):
    sys.exit(f"{ours_path}: {len(ours)} steps, refgen has {len(ref)}")
for r, r4 in zip(ref, json.load(open(logits_path))["steps"]):
    if r4["id"] != r["id"]:
        sys.exit("the two refgen runs disagree")
    r["logits"] = r4["logits"]
worst_rel = worst_abs = 0.0
n_logit_steps = 0
for r, o in zip(ref, ours):
    if "logits" in r and "logits" in o:
        rl, ol = r["logits"], o["logits"]
        if len(rl) != len(ol):
            sys.exit("logit rows differ in length")
        d = max(abs(a - b) for a, b in zip(rl, ol))
        worst_abs = max(worst_abs, d)
        worst_rel = max(worst_rel, d / max(abs(a) for a in rl))
        n_logit_steps += 1
if n_logit_steps == 0:
    sys.exit("no step carries logits on both sides")
if mode == "exact":
    tol = float(sys.argv[5])
    print(f"logits of {n_logit_steps} steps: max rel diff {worst_rel:.2e} (limit {tol:g})")
    sys.exit(0 if worst_rel <= tol else 1)
min_margin, pct, tol = float(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7])
counted = [(r["id"], o["argmax"]) for r, o in zip(ref, ours) if r["margin"] >= min_margin]
same = sum(1 for a, b in counted if a == b)
share = 100.0 * same / len(counted) if counted else 100.0
print(f"argmax equal at {same}/{len(counted)} steps with margin >= {min_margin:g} "
      f"({share:.1f}%, limit {pct:g}%); first {n_logit_steps} steps' logits max abs diff "
      f"{worst_abs:.4f} (limit {tol:g})")
sys.exit(0 if share >= pct and worst_abs <= tol else 1)
PY
}

# compare_greedy REF IDS: Kvasir's free-running greedy ids (space-separated, in file IDS)
# equal refgen's, up to the first step where refgen's own top-2 margin is under 1e-3 (a
# near-tie the peer itself decides by rounding; the comparison stops there and says so).
compare_greedy() {
    python3 - "$@" <<'PY'
import json, sys
ref = json.load(open(sys.argv[1]))["steps"]
ours = [int(t) for t in open(sys.argv[2]).read().split()]
for k, r in enumerate(ref):
    if r["margin"] < 1e-3:
        print(f"{k}/{len(ref)} ids equal; stopped at step {k}: refgen's margin "
              f"{r['margin']:.2e} < 1e-3")
        sys.exit(0)
    if k >= len(ours) or ours[k] != r["id"]:
        got = ours[k] if k < len(ours) else None
        sys.exit(f"step {k}: Kvasir {got}, llama.cpp {r['id']} (margin {r['margin']:.4f})")
print(f"{len(ref)}/{len(ref)} ids equal")
PY
}

# quant_forced SPEC PRESET DIM CTX PCT MAXABS: SPEC's model written in F16 at width DIM
# (context CTX), quantised to PRESET by the peer's llama-quantize and run teacher-forced on
# llama.cpp's own 64 greedy ids for each of PROMPTS (`kvasir run --force-ids`): the argmax
# equals llama.cpp's at >= PCT % of the steps where llama.cpp's top-2 margin is >= 0.05, and
# the first 4 steps' logits are within MAXABS max-abs. Fails the test otherwise.
quant_forced() {
    local spec=$1 preset=$2 dim=$3 ctx=$4 pct=$5 maxabs=$6
    local name=${spec%%|*} i p ref res
    local model=$TMP/$name-$preset.gguf
    synth_arch_model "$spec" f16 "$dim" "$ctx" "$TMP/$name-f16.gguf" 1
    llama_quantize "$TMP/$name-f16.gguf" "$model" "$preset" 2 >"$TMP/quantize.log" 2>&1 ||
        { tail -5 "$TMP/quantize.log"; fail "$name: llama-quantize $preset"; }
    rm -f "$TMP/$name-f16.gguf"
    if [ "$preset" = MXFP4_MOE ]; then
        "$KVASIR" info "$model" | grep -q "mxfp4 [0-9]* bytes" || fail "$name: no MXFP4 tensors"
    fi
    for i in "${!PROMPTS[@]}"; do
        p=${PROMPTS[$i]}
        ref=$TMP/$name.$preset.$i.ref.json
        refgen "$model" "$p" 64 >"$ref" || fail "$name: refgen"
        refgen "$model" "$p" 4 1 >"$ref.logits" || fail "$name: refgen logits"
        timeout 60 "$KVASIR" run -m "$model" --force-ids "$ref" --json --logits 4 -t 2 \
            >"$TMP/forced.jsonl" 2>"$TMP/run.log" || { cat "$TMP/run.log"; fail "$name: run"; }
        res=$(compare_forced quant "$ref" "$ref.logits" "$TMP/forced.jsonl" 0.05 "$pct" \
            "$maxabs") || fail "$name $preset, prompt $i: $res"
        echo "ok: $name $preset, prompt $i: $res"
    done
    rm -f "$model"
}
