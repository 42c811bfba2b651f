#!/usr/bin/env bash
# The BPE pre-tokenizer table against llama.cpp's, live: for every tokenizer.ggml.pre name
# kvasir accepts (`kvasir tokenize --list-pre`), a copy of the Llama 3 vocabulary is written
# with that name (tests/tools/kvr_setpre.c, tokenizer.ggml.add_bos_token dropped so each
# name's own BOS default applies), and the same text is tokenized by the peer's
# llama-tokenize and by `kvasir tokenize`; the ids must be identical.
#
# The text is every input of llama.cpp's vectors in ../shared/vocab plus this test's own
# (tokenize_peer.inp: digit runs, CJK, contractions, mixed scripts, white-space runs,
# newlines, emoji, punctuation, code), joined by <|eot_id|>, a control token both sides
# split out before pre-tokenizing (so each input is pre-tokenized on its own, and one run
# per name covers them all). A mismatch is reported input by input.
#
# Then the Llama 3 and Qwen vocabularies as they are, on the same inputs, with special
# tokens parsed and as text (chat markers, Qwen's user-defined <think>).
# Also: a name outside the table is refused with the list of supported names.
# Needs ../shared (the vocabulary and the peer) and python3; skips without them (fails
# under CI=true).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.bash"

vocab=$(need_shared vocab/ggml-vocab-llama-bpe.gguf)
peer_tool llama-tokenize
peer=$PEER_TOOL
setpre=${KVR_BUILD:?set KVR_BUILD to the build directory (CTest does)}/kvr_setpre
[ -x "$setpre" ] || fail "$setpre not built"
command -v python3 >/dev/null || {
    [ "${CI:-}" = true ] && fail "python3 missing under CI"
    echo "SKIP: python3 not found"
    exit 77
}

"$peer" --help >/dev/null 2>&1 || fail "the peer's llama-tokenize does not run"

# Refusal of an unknown name, with the supported ones listed.
"$setpre" "$vocab" "$TMP/bad.gguf" no-such-pre
if "$KVASIR" tokenize -m "$TMP/bad.gguf" --ids x >"$TMP/out" 2>"$TMP/err"; then
    fail "an unknown pre-tokenizer was accepted"
fi
grep -q "'no-such-pre' is not supported (supported: gpt-2, llama-bpe, " "$TMP/err" ||
    fail "unexpected refusal: $(cat "$TMP/err")"

start=$(date +%s)
KVASIR="$KVASIR" PEER="$peer" SETPRE="$setpre" VOCAB="$vocab" SHARED="$SHARED" TMP="$TMP" \
    INP="$here/tokenize_peer.inp" python3 - <<'EOF'
import concurrent.futures, glob, os, subprocess, sys

SEP_TEXT = b"<|eot_id|>"
SEP_ID = 128009
env = os.environ

inputs = []
for path in sorted(glob.glob(os.path.join(env["SHARED"], "vocab", "*.gguf.inp"))) + [env["INP"]]:
    with open(path, "rb") as f:
        for x in f.read().split(b"\n__ggml_vocab_test__\n"):
            if x and SEP_TEXT not in x:
                inputs.append(x)
text = SEP_TEXT.join(inputs)
names = subprocess.run([env["KVASIR"], "tokenize", "--list-pre"], check=True,
                       capture_output=True, text=True).stdout.split()
assert len(names) >= 20, names
if env.get("TOKENIZE_PEER_NAMES"):  # to look at a few names by hand
    names = env["TOKENIZE_PEER_NAMES"].split()


def ids_of(cmd, stdin):
    r = subprocess.run(cmd, input=stdin, capture_output=True, timeout=120)
    if r.returncode != 0:
        return None, r.stderr.decode(errors="replace")[-400:]
    out = r.stdout.decode().strip()
    if not (out.startswith("[") and out.endswith("]")):
        return None, "not an id list: " + out[:200]
    return [int(v) for v in out[1:-1].split(",") if v.strip()], ""


def parts(ids):
    out, cur = [], []
    for i in ids:
        if i == SEP_ID:
            out.append(cur)
            cur = []
        else:
            cur.append(i)
    out.append(cur)
    return out


def check(name):
    gguf = os.path.join(env["TMP"], "pre-%s.gguf" % name)
    subprocess.run([env["SETPRE"], env["VOCAB"], gguf, name, "--drop",
                    "tokenizer.ggml.add_bos_token"], check=True)
    want, err = ids_of([env["PEER"], "-m", gguf, "--stdin", "--ids", "--no-escape",
                      "--log-disable"], text)
    if want is None:
        return name, ["the peer failed: " + err]
    got, err = ids_of([env["KVASIR"], "tokenize", "-m", gguf, "--stdin", "--ids",
                       "--special"], text)
    if got is None:
        return name, ["kvasir failed: " + err]
    os.remove(gguf)
    if got == want:
        return name, []
    msgs = []
    if (got[:1] == [128000]) != (want[:1] == [128000]):
        msgs.append("BOS: peer %s, kvasir %s" % (want[:1], got[:1]))
    pw, pg = parts(want), parts(got)
    if len(pw) != len(inputs) or len(pg) != len(inputs):
        msgs.append("%d / %d parts for %d inputs" % (len(pw), len(pg), len(inputs)))
    for k, (a, b) in enumerate(zip(pw, pg)):
        if a != b and k < len(inputs):
            msgs.append("input %r\n      peer   %s\n      kvasir %s" % (inputs[k][:80], a[:24],
                                                                       b[:24]))
    return name, msgs or ["ids differ"]


def check_file(label, gguf, special):
    """The vocabulary file as it is, specials parsed or not, on all inputs at once."""
    whole = b"\n".join(inputs)
    want, err = ids_of([env["PEER"], "-m", gguf, "--stdin", "--ids", "--no-escape",
                        "--log-disable"] + ([] if special else ["--no-parse-special"]), whole)
    if want is None:
        return label, ["the peer failed: " + err]
    got, err = ids_of([env["KVASIR"], "tokenize", "-m", gguf, "--stdin", "--ids"] +
                      (["--special"] if special else []), whole)
    if got is None:
        return label, ["kvasir failed: " + err]
    if got == want:
        return label, []
    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return label, ["first difference at id %d: peer %s, kvasir %s" %
                   (k, want[max(0, k - 4):k + 8], got[max(0, k - 4):k + 8])]


jobs = [(check, (name,)) for name in names]
if not env.get("TOKENIZE_PEER_NAMES"):
    for v in ("llama-bpe", "qwen2"):
        path = os.path.join(env["SHARED"], "vocab", "ggml-vocab-%s.gguf" % v)
        for special in (True, False):
            label = "%s file, specials %s" % (v, "parsed" if special else "as text")
            jobs.append((check_file, (label, path, special)))
bad = 0
with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    for label, msgs in pool.map(lambda j: j[0](*j[1]), jobs):
        if msgs:
            bad += 1
            print("FAIL %s: %d difference(s)" % (label, len(msgs)))
            for m in msgs[:6]:
                print("    " + m)
        else:
            print("ok   %s" % label)
print("%d inputs (%d bytes), %d pre-tokenizer names and 4 file checks: %d passed, %d failed" %
      (len(inputs), len(text), len(names), len(jobs) - bad, bad))
sys.exit(1 if bad else 0)
EOF
echo "tokenize_peer: $(($(date +%s) - start)) s"
