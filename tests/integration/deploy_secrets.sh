#!/usr/bin/env bash
# Secrets and model identity across machines (issue 13, acceptance 2):
#   - `kvasir plan` never writes the secret into the plan: it makes PLAN.key (mode 0600)
#     beside it and names it, and refuses to print a plan with no place for the secret;
#   - the plan records the model's fingerprint, and a stage given a different model file is
#     refused at start with a message naming both fingerprints;
#   - a secret file its group or others may read is refused, naming the chmod that fixes it;
#   - --secret-file replaces the plan's own (which then need not exist);
#   - an old plan with the secret inline still loads, with a warning.
set -euo pipefail
source "$(dirname "$0")/lib.bash"

"$KVASIR" synth --shape tiny --type q8_0 --seed 21 -o "$TMP/model.gguf" >/dev/null 2>&1 || fail synth
"$KVASIR" synth --shape tiny --type q8_0 --seed 22 -o "$TMP/other.gguf" >/dev/null 2>&1 || fail synth

set +e; out=$("$KVASIR" plan -m "$TMP/model.gguf" --stages 2 2>&1); rc=$?; set -e
[ $rc = 2 ] && grep -q "never written into the plan" <<<"$out" || { echo "$out"; fail "plan to stdout"; }
echo "ok: no plan without a secret file: $out"

mkdir -p "$TMP/a"
base=$(reserve_base_port)
"$KVASIR" plan -m "$TMP/model.gguf" --stages 2 --base-port "$base" -o "$TMP/a/plan.json" \
    2>"$TMP/plan.log" || { cat "$TMP/plan.log"; fail "kvasir plan"; }
[ "$(stat -c %a "$TMP/a/plan.key")" = 600 ] || fail "plan.key is not mode 600"
python3 - "$TMP/a/plan.json" "$TMP/a/plan.key" <<'PY'
import json, sys
plan, key = json.load(open(sys.argv[1])), open(sys.argv[2]).read().strip()
assert plan["secret_file"] == "plan.key" and "secret" not in plan, plan
assert key not in open(sys.argv[1]).read(), "the secret is in the plan"
assert len(key) == 64 and int(key, 16) >= 0
assert int(plan["model_fingerprint"], 16) != 0, plan["model_fingerprint"]
PY
fp_plan=$(python3 -c 'import json,sys; print("%016x" % int(json.load(open(sys.argv[1]))["model_fingerprint"], 16))' "$TMP/a/plan.json")
fp_model=$("$KVASIR" info "$TMP/model.gguf" | sed -n 's/.*fingerprint \([0-9a-f]*\).*/\1/p')
[ "$fp_model" = "$fp_plan" ] || fail "plan fingerprint $fp_plan is not the model's $fp_model"
echo "ok: the plan names plan.key (0600) and records fingerprint $fp_model"

# expect_refusal TAG PATTERN... -- CMD: CMD exits 1 within 30 s, its output has every PATTERN.
expect_refusal() {
    local tag=$1 pats=() rc
    shift
    while [ "$1" != -- ]; do pats+=("$1"); shift; done
    shift
    set +e; timeout 30 "$@" >"$TMP/$tag.out" 2>&1; rc=$?; set -e
    [ $rc = 1 ] || { cat "$TMP/$tag.out"; fail "$tag: exit $rc, expected 1"; }
    for p in "${pats[@]}"; do
        grep -qF -- "$p" "$TMP/$tag.out" || { cat "$TMP/$tag.out"; fail "$tag: no '$p'"; }
    done
    echo "ok: $tag: $(grep -F -- "${pats[0]}" "$TMP/$tag.out" | head -1)"
}

# Another model file under the plan's model name.
mkdir -p "$TMP/b"
cp "$TMP/a/plan.json" "$TMP/a/plan.key" "$TMP/b/"
fp_other=$("$KVASIR" info "$TMP/other.gguf" | sed -n 's/.*fingerprint \([0-9a-f]*\).*/\1/p')
python3 - "$TMP/b/plan.json" "$TMP/other.gguf" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1])); plan["model"] = sys.argv[2]
json.dump(plan, open(sys.argv[1], "w"))
PY
expect_refusal fingerprint "fingerprint 0x$fp_other" "expects 0x$fp_model" "same model file" -- \
    "$KVASIR" stage --plan "$TMP/b/plan.json" --index 0

chmod 644 "$TMP/a/plan.key"
expect_refusal key_mode "has mode 0644" "chmod 600" -- \
    "$KVASIR" stage --plan "$TMP/a/plan.json" --index 0
chmod 600 "$TMP/a/plan.key"

# runs_ok TAG CMD...: CMD is still running after 1.5 s (a stage waiting for its peers).
runs_ok() {
    local tag=$1 pid
    shift
    "$@" >"$TMP/$tag.out" 2>&1 &
    pid=$!
    PIDS+=($pid)
    sleep 1.5
    kill -0 "$pid" 2>/dev/null || { cat "$TMP/$tag.out"; fail "$tag: the stage exited"; }
    kill "$pid"; wait "$pid" 2>/dev/null || true
}
python3 - "$TMP/a/plan.json" "$TMP/c.json" "$TMP/inline.json" "$TMP/a/plan.key" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
plan["model"] = plan["model"] if plan["model"].startswith("/") else \
    __import__("os").path.join(__import__("os").path.dirname(sys.argv[1]), plan["model"])
json.dump(dict(plan, secret_file="missing.key"), open(sys.argv[2], "w"))
inline = {k: v for k, v in plan.items() if k != "secret_file"}
inline["secret"] = open(sys.argv[4]).read().strip()
json.dump(inline, open(sys.argv[3], "w"))
PY
runs_ok secret_flag "$KVASIR" stage --plan "$TMP/c.json" --index 1 --secret-file "$TMP/a/plan.key"
echo "ok: --secret-file replaces the plan's (missing) secret file"
runs_ok inline "$KVASIR" stage --plan "$TMP/inline.json" --index 1
grep -q "holds the cluster secret inline" "$TMP/inline.out" || { cat "$TMP/inline.out"; fail "no warning"; }
echo "ok: inline secret loads with: $(grep "inline" "$TMP/inline.out" | head -1)"
echo PASS
