#!/usr/bin/env bash
# `kvasir synth` and `kvasir info` end to end: write small models, read them back with info,
# check determinism and the .part/rename behaviour, and check that bad inputs fail with a
# message and the documented exit status (1 for a bad file or shape, 2 for bad usage).
set -euo pipefail
: "${KVASIR:?set KVASIR to the kvasir binary}"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# expect STATUS PATTERN CMD...: the command exits with STATUS and its stderr matches PATTERN.
expect() {
    local want=$1 pattern=$2 rc=0
    shift 2
    "$@" >"$dir/stdout" 2>"$dir/stderr" || rc=$?
    [ "$rc" -eq "$want" ] || fail "$* exited $rc, want $want: $(cat "$dir/stderr")"
    grep -q -- "$pattern" "$dir/stderr" || fail "$*: stderr lacks '$pattern': $(cat "$dir/stderr")"
}

"$KVASIR" synth --shape tiny --type q4_0 --seed 9 -o "$dir/a.gguf" >"$dir/summary"
grep -q "39 tensors" "$dir/summary" || fail "summary: $(cat "$dir/summary")"
[ ! -e "$dir/a.gguf.part" ] || fail "a .part file was left behind"
"$KVASIR" synth --shape tiny --type q4_0 --seed 9 --threads 1 -o "$dir/b.gguf" >/dev/null
cmp -s "$dir/a.gguf" "$dir/b.gguf" || fail "the same seed gave different files"

"$KVASIR" info "$dir/a.gguf" >"$dir/info"
grep -q "GGUF v3, .* alignment 32" "$dir/info" || fail "info header: $(head -1 "$dir/info")"
grep -Eq 'general\.architecture +string +"llama"' "$dir/info" || fail "info: architecture"
grep -Eq 'llama\.block_count +uint32 +4$' "$dir/info" || fail "info: block_count"
grep -Eq 'tokenizer\.ggml\.tokens +string\[512\] +"<unk>", "<s>", "</s>"' "$dir/info" ||
    fail "info: tokens summary"
grep -Eq 'blk\.3\.ffn_down\.weight +q4_0 +192 x 64 ' "$dir/info" || fail "info: tensor row"
grep -q "^total: 39 tensors" "$dir/info" || fail "info: total"

"$KVASIR" synth --shape custom --layers 2 --dim 128 --ff 256 --heads 4 --kv-heads 2 \
    --vocab-size 300 --type f16 -o "$dir/c.gguf" >/dev/null
"$KVASIR" info "$dir/c.gguf" >"$dir/info"
grep -Eq 'llama\.embedding_length +uint32 +128$' "$dir/info" || fail "custom: dim"
grep -Eq 'token_embd\.weight +f16 +128 x 300 ' "$dir/info" || fail "custom: token_embd"

"$KVASIR" info "$dir/a.gguf" >"$dir/info"
grep -q "^by type: f32 [0-9]* bytes (9 tensors); q4_0 [0-9]* bytes (30 tensors);" "$dir/info" ||
    fail "info: by type: $(grep '^by type' "$dir/info")"
grep -q "^architecture: llama, 4 layers, dim 64, ff 192, heads 4/2 of 16, vocab 512" "$dir/info" ||
    fail "info: architecture: $(grep '^architecture' "$dir/info")"

# Every architecture: its keys, its tensors, and info's reading of it.
"$KVASIR" synth --arch phi3 --shape tiny --type f16 -o "$dir/phi3.gguf" >"$dir/summary"
grep -q "phi3, shape tiny" "$dir/summary" || fail "phi3 summary: $(cat "$dir/summary")"
"$KVASIR" info "$dir/phi3.gguf" >"$dir/info"
grep -Eq 'phi3\.block_count +uint32 +4$' "$dir/info" || fail "phi3: block_count"
grep -Eq 'blk\.0\.attn_qkv\.weight +f16 +64 x 128 ' "$dir/info" || fail "phi3: fused qkv"
grep -Eq 'blk\.0\.ffn_up\.weight +f16 +64 x 384 ' "$dir/info" || fail "phi3: fused gate/up"
! grep -q 'ffn_gate' "$dir/info" || fail "phi3 has no ffn_gate"
"$KVASIR" synth --arch gemma3 --shape tiny --head-dim 32 --swa 8 --type f32 -o "$dir/g3.gguf" \
    >/dev/null
"$KVASIR" info "$dir/g3.gguf" >"$dir/info"
grep -Eq 'gemma3\.attention\.key_length +uint32 +32$' "$dir/info" || fail "gemma3: key_length"
grep -Eq 'blk\.1\.post_ffw_norm\.weight +f32 +64 ' "$dir/info" || fail "gemma3: post-norm"
! grep -q '^  output\.weight' "$dir/info" || fail "gemma3 ties its output"
grep -q "^architecture: gemma3, .*4/2 of 32, .*GeGLU, sliding window 8 (period 6), output tie" \
    "$dir/info" || fail "gemma3: $(grep '^architecture' "$dir/info")"
expect 2 "unknown --arch mamba (supported: llama, qwen2" "$KVASIR" synth --arch mamba --shape tiny \
    -o "$dir/x.gguf"
expect 1 "llama has no sliding window" "$KVASIR" synth --shape tiny --swa 4 -o "$dir/x.gguf"

# deepseek2 (issue 35): info names the latent attention's ranks, the kv_b form and YaRN.
"$KVASIR" synth --arch deepseek2 --shape tiny --q-lora 32 --kv-lora 64 --qk-rope 16 \
    --experts 8 --experts-used 2 --shared-experts 1 --dense-layers 1 --expert-groups 2 \
    --groups-used 1 --yarn 4 --yarn-log-mul 0.1 -o "$dir/ds.gguf" >/dev/null
"$KVASIR" info "$dir/ds.gguf" >"$dir/info"
grep -q "latent attention (MLA): kv_lora_rank 64, q_lora_rank 32, qk nope 16 + rope 16, value 16, split kv_b, KV cache 80 values per token and layer, YaRN x4 from 128" "$dir/info" ||
    fail "info: deepseek2 $(grep architecture: "$dir/info")"
"$KVASIR" synth --arch deepseek2 --shape tiny --kv-b-fused -o "$dir/ds.gguf" >/dev/null
"$KVASIR" info "$dir/ds.gguf" >"$dir/info"
grep -q "kv_lora_rank 32, q_lora_rank none, qk nope 16 + rope 8, value 16, fused kv_b" "$dir/info" ||
    fail "info: deepseek2 fused $(grep architecture: "$dir/info")"

head -c 1000 "$dir/a.gguf" >"$dir/cut.gguf"
expect 1 "cut.gguf: " "$KVASIR" info "$dir/cut.gguf"
expect 1 "cannot open" "$KVASIR" info "$dir/missing.gguf"
printf 'GGUF\001\000\000\000' >"$dir/v1.gguf"
expect 1 "" "$KVASIR" info "$dir/v1.gguf"
expect 2 "usage" "$KVASIR" info
expect 2 "unknown shape nope" "$KVASIR" synth --shape nope -o "$dir/x.gguf"
# gpt-oss with MXFP4 experts: the biases, sinks and MXFP4_MOE's types, and info's reading
# (sinks, the window's period, YaRN, the clamped SwiGLU).
"$KVASIR" synth --arch gpt-oss --shape tiny --swa 8 --type mxfp4 -o "$dir/oss.gguf" >/dev/null
"$KVASIR" info "$dir/oss.gguf" >"$dir/info"
grep -Eq 'general\.file_type +uint32 +38$' "$dir/info" || fail "gpt-oss: file type MXFP4_MOE"
grep -Eq 'blk\.0\.attn_sinks\.weight +f32 +4 ' "$dir/info" || fail "gpt-oss: sinks"
grep -Eq 'blk\.1\.ffn_down_exps\.bias +f32 +64 x 8 ' "$dir/info" || fail "gpt-oss: expert bias"
grep -Eq 'blk\.0\.ffn_up_exps\.weight +mxfp4 +64 x 192 x 8 ' "$dir/info" || fail "gpt-oss: mxfp4"
grep -Eq 'blk\.0\.attn_q\.weight +q8_0 ' "$dir/info" || fail "gpt-oss: attention in q8_0"
grep -q "^architecture: gpt-oss, .*clamped SwiGLU, sliding window 8 (period 2), attention sinks, YaRN x32 over 4096, 8 experts" \
    "$dir/info" || fail "gpt-oss info: $(grep '^architecture' "$dir/info")"
"$KVASIR" run -m "$dir/oss.gguf" -p "hello" -n 4 --temp 0 -q >/dev/null 2>&1 || fail "gpt-oss: run"

expect 2 "unknown --type" "$KVASIR" synth --shape tiny --type q9 -o "$dir/x.gguf"
expect 2 "custom needs" "$KVASIR" synth --shape custom --layers 2 -o "$dir/x.gguf"
expect 1 "not a multiple of heads" "$KVASIR" synth --shape tiny --heads 3 -o "$dir/x.gguf"
[ ! -e "$dir/x.gguf" ] && [ ! -e "$dir/x.gguf.part" ] || fail "a failed synth left a file"
echo "cli_synth_info: ok"
