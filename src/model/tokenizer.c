/* tokenizer.c - building a SentencePiece or byte-level BPE tokenizer from a GGUF vocabulary,
 * and its accessors. Encoding is in tokenizer_encode.c, decoding in tokenizer_decode.c; the
 * layout of struct kvr_tok and the helpers the three share are in tokenizer_impl.h.
 *
 * Reading order: the map insert, the GPT-2 byte-alphabet helpers, building a tokenizer
 * from arrays (validation, the map, special ids, end-of-generation and byte-fallback tokens,
 * the special-token table, decoded pieces, BPE merges), then from a GGUF, then the accessors.
 *
 * The algorithms follow llama.cpp's llama-vocab.cpp (that is the reference the test vectors
 * come from); comments point out where its exact behaviour matters. */
#include "model/tokenizer.h"

#include "core/alloc.h"
#include "core/utf8.h"
#include "model/tokenizer_impl.h"
#include "model/tokenizer_pre.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Insert piece `id`; returns the id of an earlier identical piece, or -1. */
static int32_t map_insert(struct kvr_tok *t, int32_t id)
{
    const char *p = t->text + t->off[id];
    size_t n = t->off[id + 1] - t->off[id];
    uint32_t h = kvr_tok_hash_bytes(p, n);
    for (uint32_t i = h & t->map_mask;; i = (i + 1) & t->map_mask) {
        struct kvr_tok_slot *s = &t->map[i];
        if (s->id < 0) {
            s->hash = h;
            s->id = id;
            return -1;
        }
        if (s->hash == h) {
            uint32_t a = t->off[s->id], b = t->off[s->id + 1];
            if (b - a == n && memcmp(t->text + a, p, n) == 0)
                return s->id;
        }
    }
}

/* ---- GPT-2 byte alphabet ------------------------------------------------------------- */

/* Inverse of kvr_tok_byte_to_cp; -1 for a code point outside the alphabet. */
static int cp_to_byte(uint32_t cp)
{
    if (cp < 0x100)
        return kvr_tok_byte_is_printable(cp) ? (int)cp : -1;
    if (cp >= 0x100 + 68)
        return -1;
    uint32_t n = 0;
    for (unsigned b = 0; b < 256; b++) {
        if (!kvr_tok_byte_is_printable(b)) {
            if (n == cp - 0x100)
                return (int)b;
            n++;
        }
    }
    return -1;
}

/* ---- building ------------------------------------------------------------------------ */

static float rd_f32(const void *base, int64_t i)
{
    float f;
    memcpy(&f, (const uint8_t *)base + 4 * i, 4);
    return f;
}

static int32_t rd_i32(const void *base, int64_t i)
{
    int32_t v;
    memcpy(&v, (const uint8_t *)base + 4 * i, 4);
    return v;
}

void kvr_tok_vocab_init(struct kvr_tok_vocab *v, enum kvr_tok_kind kind)
{
    memset(v, 0, sizeof *v);
    v->kind = kind;
    v->bos_id = kind == KVR_TOK_SPM ? 1 : -1;
    v->eos_id = kind == KVR_TOK_SPM ? 2 : -1;
    v->unk_id = kind == KVR_TOK_SPM ? 0 : -1;
    v->pad_id = v->eot_id = v->eom_id = -1;
    v->add_bos = v->add_eos = v->add_space_prefix = -1;
}

static void add_eog(struct kvr_tok *t, int32_t id)
{
    if (id < 0)
        return;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return;
    if (t->n_eog < KVR_TOK_MAX_EOG)
        t->eog[t->n_eog++] = id;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* The byte a SPM byte token "<0xXX>" stands for, or -1 if the piece has another form. */
static int spm_byte_of(const char *p, size_t n)
{
    if (n != 6 || memcmp(p, "<0x", 3) != 0 || p[5] != '>')
        return -1;
    int hi = hexval(p[3]), lo = hexval(p[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

/* Decoded form of piece i, written to out (capacity >= 3 * piece bytes); returns length. */
static size_t decode_piece_into(const struct kvr_tok *t, int32_t i, char *out)
{
    const char *p = t->text + t->off[i];
    size_t n = t->off[i + 1] - t->off[i];
    switch (t->types[i]) {
    case KVR_TOK_TYPE_USER_DEFINED:
        memcpy(out, p, n);
        return n;
    case KVR_TOK_TYPE_NORMAL:
        break;
    case KVR_TOK_TYPE_BYTE:
        if (t->kind == KVR_TOK_SPM) {
            out[0] = (char)spm_byte_of(p, n);
            return 1;
        }
        return 0; /* llama.cpp prints nothing for BPE byte-type tokens */
    default:
        return 0; /* control, unknown, unused, undefined: invisible */
    }
    size_t m = 0;
    if (t->kind == KVR_TOK_SPM) {
        for (size_t k = 0; k < n; k++) {
            if (k + 3 <= n && memcmp(p + k, "\xE2\x96\x81", 3) == 0) {
                out[m++] = ' ';
                k += 2;
            } else {
                out[m++] = p[k];
            }
        }
        return m;
    }
    /* BPE: every code point of the piece maps back to one byte; a code point outside the
     * byte alphabet (or an invalid byte) is kept as it is. */
    for (size_t k = 0; k < n;) {
        uint32_t cp;
        size_t len = kvr_utf8_decode(p + k, n - k, &cp, KVR_UTF8_STRICT);
        int b = len ? cp_to_byte(cp) : -1;
        if (b >= 0) {
            out[m++] = (char)b;
        } else {
            len = len ? len : 1;
            memcpy(out + m, p + k, len);
            m += len;
        }
        k += len;
    }
    return m;
}

static int special_cmp_len(const struct kvr_tok *t, int32_t a, int32_t b)
{
    uint32_t la = t->off[a + 1] - t->off[a], lb = t->off[b + 1] - t->off[b];
    if (la != lb)
        return la > lb ? -1 : 1;
    return a < b ? -1 : (a > b);
}

/* Insertion sort would be quadratic on vocabularies with thousands of specials; this is a
 * plain bottom-up merge sort into `tmp`. */
static void sort_specials(const struct kvr_tok *t, int32_t *v, int32_t *tmp, int32_t n)
{
    for (int32_t w = 1; w < n; w *= 2) {
        for (int32_t lo = 0; lo < n; lo += 2 * w) {
            int32_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            int32_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi)
                tmp[k++] = special_cmp_len(t, v[i], v[j]) <= 0 ? v[i++] : v[j++];
            while (i < mid)
                tmp[k++] = v[i++];
            while (j < hi)
                tmp[k++] = v[j++];
        }
        memcpy(v, tmp, (size_t)n * sizeof *v);
    }
}

/* A piece from an untrusted file, made safe to quote in an error message: at most 40 bytes,
 * control bytes as '?'. Returns buf. */
static const char *excerpt(const char *p, size_t n, char buf[48])
{
    size_t m = n > 40 ? 40 : n;
    for (size_t i = 0; i < m; i++)
        buf[i] = (uint8_t)p[i] < 0x20 || p[i] == 0x7F ? '?' : p[i];
    memcpy(buf + m, n > 40 ? "..." : "", n > 40 ? 4 : 1);
    return buf;
}

static int check_id(int64_t id, int64_t n, const char *what, int32_t *out, struct kvr_err *err)
{
    if (id < 0 || id == 0xFFFFFFFFll) {
        *out = -1;
        return 0;
    }
    if (id >= n)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer: %s id %lld out of range (vocab %lld)",
                           what, (long long)id, (long long)n);
    *out = (int32_t)id;
    return 0;
}

static int build_merges(struct kvr_tok *t, const struct kvr_tok_vocab *v, struct kvr_err *err)
{
    if (v->n_merges < 0 || v->n_merges > KVR_TOK_MAX_VOCAB * 4ll)
        return kvr_err_set(err, KVR_ERANGE, "tokenizer: %lld merges out of range",
                           (long long)v->n_merges);
    if (v->n_merges > 0 && !v->merges)
        return kvr_err_set(err, KVR_EINVAL, "tokenizer: merges missing");
    uint32_t cap = 16;
    while (cap < 2 * (uint64_t)v->n_merges)
        cap *= 2;
    t->merges = kvr_malloc((size_t)cap * sizeof *t->merges);
    if (!t->merges)
        return kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory for %lld merges",
                           (long long)v->n_merges);
    t->merge_mask = cap - 1;
    for (uint32_t i = 0; i < cap; i++)
        t->merges[i].left = t->merges[i].right = -1;
    char q1[48], q2[48];
    for (int64_t r = 0; r < v->n_merges; r++) {
        const char *p = v->merges[r].ptr;
        uint64_t n = v->merges[r].len;
        if (n > 2 * KVR_TOK_MAX_PIECE_BYTES + 1)
            return kvr_err_set(err, KVR_ERANGE, "tokenizer: merge %lld is %llu bytes long",
                               (long long)r, (unsigned long long)n);
        /* "left right": the separator is the first space after the first byte, as
         * llama.cpp splits it. */
        const char *sp = n > 1 ? memchr(p + 1, ' ', n - 1) : NULL;
        if (!sp)
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer: merge %lld '%s' has no space",
                               (long long)r, excerpt(p, n, q1));
        size_t nl = (size_t)(sp - p), nr = n - nl - 1;
        char cat[2 * KVR_TOK_MAX_PIECE_BYTES + 1];
        memcpy(cat, p, nl);
        memcpy(cat + nl, sp + 1, nr);
        int32_t a = kvr_tok_map_find(t, p, nl), b = kvr_tok_map_find(t, sp + 1, nr);
        int32_t c = kvr_tok_map_find(t, cat, nl + nr);
        const char *missing = a < 0 ? p : b < 0 ? sp + 1 : cat;
        size_t n_missing = a < 0 ? nl : b < 0 ? nr : nl + nr;
        if (a < 0 || b < 0 || c < 0)
            return kvr_err_set(err, KVR_EFORMAT,
                               "tokenizer: merge %lld '%s': '%s' is not in the vocabulary",
                               (long long)r, excerpt(p, n, q1), excerpt(missing, n_missing, q2));
        for (uint32_t i = kvr_tok_pair_hash(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
            struct kvr_tok_merge_slot *s = &t->merges[i];
            if (s->left < 0) {
                *s = (struct kvr_tok_merge_slot){a, b, (int32_t)r, c};
                break;
            }
            if (s->left == a && s->right == b)
                break; /* a repeated rule keeps its first (best) rank */
        }
    }
    return 0;
}

/* The pre-tokenizer a BPE vocabulary names (GPT-2's if it names none). */
static int set_pre(struct kvr_tok *t, const struct kvr_tok_vocab *v, struct kvr_err *err)
{
    if (t->kind == KVR_TOK_BPE) {
        if (v->pre.len > 0 && !v->pre.ptr)
            return kvr_err_set(err, KVR_EINVAL, "tokenizer: pre-tokenizer name has no bytes");
        t->pre = v->pre.len ? kvr_pre_find(v->pre.ptr, (size_t)v->pre.len) : kvr_pre_gpt2();
        if (!t->pre) {
            char q[48], names[200];
            kvr_pre_list(names, sizeof names, false);
            return kvr_err_set(err, KVR_ENOTSUP,
                               "tokenizer.ggml.pre: '%s' is not supported (supported: %s, and "
                               "aliases)",
                               excerpt(v->pre.ptr, (size_t)v->pre.len, q), names);
        }
    }
    return KVR_OK;
}

/* Copy the pieces, scores and types, checking each; *total gets the pieces' bytes. */
static int copy_pieces(struct kvr_tok *t, const struct kvr_tok_vocab *v, uint64_t *total_out,
                       struct kvr_err *err)
{
    int32_t n = t->n_vocab;
    uint64_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        if (v->tokens[i].len > KVR_TOK_MAX_PIECE_BYTES)
            return kvr_err_set(err, KVR_ERANGE, "tokenizer: token %d is %llu bytes (max %d)", i,
                               (unsigned long long)v->tokens[i].len, KVR_TOK_MAX_PIECE_BYTES);
        if (v->tokens[i].len > 0 && !v->tokens[i].ptr)
            return kvr_err_set(err, KVR_EINVAL, "tokenizer: token %d has no bytes", i);
        total += v->tokens[i].len; /* <= 2^24 * 4096 = 2^36: no overflow */
    }
    if (total > UINT32_MAX / 3)
        return kvr_err_set(err, KVR_ERANGE, "tokenizer: %llu bytes of pieces is too many",
                           (unsigned long long)total);
    t->text = kvr_malloc(total ? (size_t)total : 1);
    t->off = kvr_malloc(((size_t)n + 1) * sizeof *t->off);
    t->dec_off = kvr_malloc(((size_t)n + 1) * sizeof *t->dec_off);
    t->scores = kvr_malloc((size_t)n * sizeof *t->scores);
    t->types = kvr_malloc((size_t)n);
    if (!t->text || !t->off || !t->dec_off || !t->scores || !t->types)
        return kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory for %d tokens", n);
    uint32_t pos = 0;
    for (int32_t i = 0; i < n; i++) {
        t->off[i] = pos;
        if (v->tokens[i].len)
            memcpy(t->text + pos, v->tokens[i].ptr, (size_t)v->tokens[i].len);
        pos += (uint32_t)v->tokens[i].len;
        float s = v->scores ? rd_f32(v->scores, i) : 0.0f;
        if (isnan(s))
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer: token %d has a NaN score", i);
        t->scores[i] = s;
        int32_t ty = v->types ? rd_i32(v->types, i) : KVR_TOK_TYPE_NORMAL;
        if (ty < 0 || ty >= KVR_TOK_TYPE_COUNT)
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer: token %d has unknown type %d", i,
                               (int)ty);
        t->types[i] = (uint8_t)ty;
        if (t->kind == KVR_TOK_SPM && ty == KVR_TOK_TYPE_BYTE &&
            spm_byte_of(t->text + t->off[i], v->tokens[i].len) < 0) {
            char q[48];
            return kvr_err_set(err, KVR_EFORMAT,
                               "tokenizer: byte token %d '%s' is not of the form <0xXX>", i,
                               excerpt(t->text + t->off[i], v->tokens[i].len, q));
        }
    }
    t->off[n] = pos;
    *total_out = total;
    return KVR_OK;
}

/* The piece -> id map. Empty pieces are never matched (llama.cpp renames them to
 * "[EMPTY_<id>]"); duplicated pieces are rejected as llama.cpp's loader does. */
static int build_map(struct kvr_tok *t, struct kvr_err *err)
{
    int32_t n = t->n_vocab;
    uint32_t cap = 16;
    while (cap < 2 * (uint32_t)n)
        cap *= 2;
    t->map = kvr_malloc((size_t)cap * sizeof *t->map);
    if (!t->map)
        return kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory");
    t->map_mask = cap - 1;
    for (uint32_t i = 0; i < cap; i++)
        t->map[i].id = -1;
    for (int32_t i = 0; i < n; i++) {
        if (t->off[i + 1] == t->off[i])
            continue;
        int32_t dup = map_insert(t, i);
        if (dup >= 0) {
            char q[48];
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer: token %d '%s' duplicates token %d", i,
                               excerpt(t->text + t->off[i], t->off[i + 1] - t->off[i], q), dup);
        }
    }
    return KVR_OK;
}

/* The special ids (each checked against the vocabulary) and the BOS / EOS / space flags. */
static int set_special_ids(struct kvr_tok *t, const struct kvr_tok_vocab *v, struct kvr_err *err)
{
    int32_t n = t->n_vocab;
    int rc;
    if ((rc = check_id(v->bos_id, n, "bos", &t->bos, err)) ||
        (rc = check_id(v->eos_id, n, "eos", &t->eos, err)) ||
        (rc = check_id(v->unk_id, n, "unknown", &t->unk, err)) ||
        (rc = check_id(v->pad_id, n, "padding", &t->pad, err)) ||
        (rc = check_id(v->eot_id, n, "eot", &t->eot, err)) ||
        (rc = check_id(v->eom_id, n, "eom", &t->eom, err)))
        return rc;
    bool spm = t->kind == KVR_TOK_SPM;
    t->add_bos = v->add_bos < 0 ? spm || (t->pre && t->pre->add_bos) : v->add_bos != 0;
    t->add_eos = v->add_eos < 0 ? false : v->add_eos != 0;
    t->add_space_prefix = v->add_space_prefix < 0 ? spm : v->add_space_prefix != 0;
    if (t->add_bos && t->bos < 0)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer: adds a BOS token but has no BOS id");
    if (t->add_eos && t->eos < 0)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer: adds an EOS token but has no EOS id");
    return KVR_OK;
}

/* The end-of-generation ids, and the pieces llama.cpp makes control tokens. */
static void mark_eog(struct kvr_tok *t)
{
    add_eog(t, t->eos);
    add_eog(t, t->eot);
    add_eog(t, t->eom);
    /* The end-of-turn and end-of-message pieces llama.cpp also stops at, whatever their
     * type. DeepSeek writes its markers <｜...｜> with U+FF5C and U+2581 for spaces. */
#define DS_SP "\xE2\x96\x81"
#define DS_MARK(s) "<\xEF\xBD\x9C" s "\xEF\xBD\x9C>"
    static const char *const eog_texts[] = {"<|eot_id|>",
                                            "<|im_end|>",
                                            "<|end|>",
                                            "<end_of_turn>",
                                            "<|endoftext|>",
                                            "<|eom_id|>",
                                            "<EOT>",
                                            "_<EOT>",
                                            "<|end_of_text|>",
                                            "<end_of_utterance>",
                                            "<|return|>",
                                            "<|call|>",
                                            DS_MARK("end" DS_SP "of" DS_SP "sentence")};
    /* Fill-in-the-middle markers of code models. */
    static const char *const fim_texts[] = {"<|fim_prefix|>",
                                            "<fim-prefix>",
                                            "<PRE>",
                                            "<|code_prefix|>",
                                            "<|fim_suffix|>",
                                            "<fim-suffix>",
                                            "<SUF>",
                                            "<|code_suffix|>",
                                            "<|fim_middle|>",
                                            "<fim-middle>",
                                            "<MID>",
                                            "<|code_middle|>",
                                            "<|fim_pad|>",
                                            "<fim-pad>",
                                            "<|fim_repo|>",
                                            "<|repo_name|>",
                                            "<fim-repo>",
                                            "<REPO>",
                                            "<reponame>",
                                            "<|file_sep|>",
                                            "<file_sep>",
                                            DS_MARK("fim" DS_SP "begin"),
                                            DS_MARK("fim" DS_SP "hole"),
                                            DS_MARK("fim" DS_SP "end")};
    /* llama.cpp treats both kinds as control tokens whatever type the file gives them (a
     * user-defined <|fim_prefix|> is then text unless specials are parsed, and decodes to
     * nothing unless asked), so they are made control here too. */
    for (size_t k = 0; k < sizeof eog_texts / sizeof eog_texts[0]; k++) {
        int32_t id = kvr_tok_map_find(t, eog_texts[k], strlen(eog_texts[k]));
        add_eog(t, id);
        if (id >= 0)
            t->types[id] = KVR_TOK_TYPE_CONTROL;
    }
    for (size_t k = 0; k < sizeof fim_texts / sizeof fim_texts[0]; k++) {
        int32_t id = kvr_tok_map_find(t, fim_texts[k], strlen(fim_texts[k]));
        if (id >= 0)
            t->types[id] = KVR_TOK_TYPE_CONTROL;
    }
}

/* The token of each raw byte no piece covers (struct kvr_tok.byte_id). */
static void set_byte_fallback(struct kvr_tok *t)
{
    bool spm = t->kind == KVR_TOK_SPM;
    for (int b = 0; b < 256; b++) {
        if (spm) {
            static const char hex[] = "0123456789ABCDEF";
            char buf[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
            char one = (char)b;
            int32_t id = kvr_tok_map_find(t, buf, 6);
            if (id < 0)
                id = kvr_tok_map_find(t, &one, 1);
            t->byte_id[b] = id >= 0 ? id : t->unk;
        } else {
            char buf[4];
            t->byte_id[b] =
                kvr_tok_map_find(t, buf, kvr_utf8_encode(kvr_tok_byte_to_cp((unsigned)b), buf));
        }
    }
}

/* The tokens split out of text before the model runs, longest first. */
static int collect_specials(struct kvr_tok *t, struct kvr_err *err)
{
    int32_t n = t->n_vocab;
    int32_t n_sp = 0;
    for (int32_t i = 0; i < n; i++) {
        uint8_t ty = t->types[i];
        n_sp += (ty == KVR_TOK_TYPE_CONTROL || ty == KVR_TOK_TYPE_UNKNOWN ||
                 ty == KVR_TOK_TYPE_USER_DEFINED) &&
                t->off[i + 1] > t->off[i];
    }
    t->specials = kvr_malloc(((size_t)n_sp + 1) * sizeof *t->specials);
    int32_t *tmp = kvr_malloc(((size_t)n_sp + 1) * sizeof *tmp);
    if (!t->specials || !tmp) {
        kvr_free(tmp);
        return kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory");
    }
    for (int32_t i = 0; i < n; i++) {
        uint8_t ty = t->types[i];
        if ((ty == KVR_TOK_TYPE_CONTROL || ty == KVR_TOK_TYPE_UNKNOWN ||
             ty == KVR_TOK_TYPE_USER_DEFINED) &&
            t->off[i + 1] > t->off[i])
            t->specials[t->n_specials++] = i;
    }
    sort_specials(t, t->specials, tmp, t->n_specials);
    kvr_free(tmp);
    return KVR_OK;
}

/* Decoded pieces: never longer than the raw piece ("▁" becomes one space, "<0xXX>" one
 * byte, a BPE code point one byte or itself), so `total` bytes hold them all. */
static int decode_pieces(struct kvr_tok *t, uint64_t total, struct kvr_err *err)
{
    int32_t n = t->n_vocab;
    t->dec = kvr_malloc(total ? (size_t)total : 1);
    if (!t->dec)
        return kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory");
    uint32_t dpos = 0;
    for (int32_t i = 0; i < n; i++) {
        t->dec_off[i] = dpos;
        dpos += (uint32_t)decode_piece_into(t, i, t->dec + dpos);
        size_t raw = t->off[i + 1] - t->off[i], dl = dpos - t->dec_off[i];
        if (raw > t->max_out_bytes)
            t->max_out_bytes = raw;
        if (dl > t->max_out_bytes)
            t->max_out_bytes = dl;
    }
    t->dec_off[n] = dpos;
    return KVR_OK;
}

int kvr_tok_create_from_vocab(struct kvr_tok **out, const struct kvr_tok_vocab *v,
                              struct kvr_err *err)
{
    *out = NULL;
    if (v->kind != KVR_TOK_SPM && v->kind != KVR_TOK_BPE)
        return kvr_err_set(err, KVR_ENOTSUP, "tokenizer: unknown kind %d", (int)v->kind);
    if (v->n_tokens <= 0 || v->n_tokens > KVR_TOK_MAX_VOCAB)
        return kvr_err_set(err, KVR_ERANGE, "tokenizer: %lld tokens (allowed 1..%d)",
                           (long long)v->n_tokens, KVR_TOK_MAX_VOCAB);
    if (!v->tokens)
        return kvr_err_set(err, KVR_EINVAL, "tokenizer: token list missing");
    struct kvr_tok *t = kvr_calloc(1, sizeof *t);
    if (!t)
        return kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory");
    t->kind = v->kind;
    t->n_vocab = (int32_t)v->n_tokens;
    uint64_t total = 0;
    int rc;
    if ((rc = set_pre(t, v, err)) || (rc = copy_pieces(t, v, &total, err)) ||
        (rc = build_map(t, err)) || (rc = set_special_ids(t, v, err)))
        goto fail;
    mark_eog(t);
    set_byte_fallback(t);
    if ((rc = collect_specials(t, err)) || (rc = decode_pieces(t, total, err)))
        goto fail;
    if (t->kind == KVR_TOK_BPE && (rc = build_merges(t, v, err)) != 0)
        goto fail;

    *out = t;
    return 0;
fail:
    kvr_tok_destroy(t);
    return rc;
}

void kvr_tok_destroy(struct kvr_tok *t)
{
    if (!t)
        return;
    kvr_free(t->text);
    kvr_free(t->off);
    kvr_free(t->dec);
    kvr_free(t->dec_off);
    kvr_free(t->scores);
    kvr_free(t->types);
    kvr_free(t->map);
    kvr_free(t->specials);
    kvr_free(t->merges);
    kvr_free(t);
}

/* ---- reading the GGUF ----------------------------------------------------------------- */

static int gguf_id(const struct kvr_gguf *g, const char *key, int64_t *out, struct kvr_err *err)
{
    int64_t i = kvr_gguf_find_kv(g, key);
    if (i < 0)
        return 0; /* keep the default */
    double d;
    if (kvr_gguf_kv_num(g, i, &d) != 0 || kvr_gguf_kv_type(g, i) == KVR_GGUF_TYPE_BOOL ||
        kvr_gguf_kv_type(g, i) == KVR_GGUF_TYPE_FLOAT32 ||
        kvr_gguf_kv_type(g, i) == KVR_GGUF_TYPE_FLOAT64)
        return kvr_err_set(err, KVR_EFORMAT, "%s: expected an integer token id", key);
    if (d < -1 || d > 4294967295.0)
        return kvr_err_set(err, KVR_EFORMAT, "%s: token id %.0f out of range", key, d);
    *out = (int64_t)d;
    return 0;
}

static int gguf_flag(const struct kvr_gguf *g, const char *key, int *out, struct kvr_err *err)
{
    bool b;
    if (kvr_gguf_find_kv(g, key) < 0)
        return 0; /* keep the default */
    int rc = kvr_gguf_get_bool(g, key, &b, err);
    if (rc)
        return rc;
    *out = b;
    return 0;
}

/* An optional array: 0 with *present false if the key is absent. */
static int gguf_opt_arr(const struct kvr_gguf *g, const char *key, struct kvr_gguf_arr *arr,
                        bool *present, struct kvr_err *err)
{
    *present = kvr_gguf_find_kv(g, key) >= 0;
    return *present ? kvr_gguf_get_arr(g, key, arr, err) : 0;
}

/* The tokenizer model tokenizer.ggml.model names (llama: SPM, gpt2: BPE). */
static int read_kind(const struct kvr_gguf *g, enum kvr_tok_kind *out, struct kvr_err *err)
{
    struct kvr_gguf_str model;
    int rc = kvr_gguf_get_str(g, "tokenizer.ggml.model", &model, err);
    if (rc == KVR_ENOTFOUND)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.model: missing");
    if (rc)
        return rc;
    enum kvr_tok_kind kind = KVR_TOK_KIND_COUNT;
    if (model.len == 5 && memcmp(model.ptr, "llama", 5) == 0)
        kind = KVR_TOK_SPM;
    else if (model.len == 4 && memcmp(model.ptr, "gpt2", 4) == 0)
        kind = KVR_TOK_BPE;
    char q[48];
    if (kind == KVR_TOK_KIND_COUNT)
        return kvr_err_set(err, KVR_ENOTSUP,
                           "tokenizer.ggml.model: '%s' is not supported (llama and gpt2 are)",
                           excerpt(model.ptr, model.len, q));
    *out = kind;
    return KVR_OK;
}

/* A BPE vocabulary's pre-tokenizer name (tokenizer.ggml.pre), required. */
static int read_pre(const struct kvr_gguf *g, struct kvr_gguf_str *pre, struct kvr_err *err)
{
    /* llama.cpp falls back to a "default" pattern when the key is missing and warns that
     * the output will be degraded; a file without the key is refused here instead. */
    int rc = kvr_gguf_get_str(g, "tokenizer.ggml.pre", pre, err);
    if (rc == KVR_ENOTFOUND) {
        char names[200];
        kvr_pre_list(names, sizeof names, false);
        return kvr_err_set(err, KVR_ENOTSUP,
                           "tokenizer.ggml.pre: missing (a gpt2 vocabulary names its "
                           "pre-tokenizer: %s, and aliases)",
                           names);
    }
    if (rc)
        return rc;
    if (pre->len == 0)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.pre: empty");
    return KVR_OK;
}

/* The pieces (tokenizer.ggml.tokens) and, if present, their scores and types. */
static int read_pieces(const struct kvr_gguf *g, struct kvr_tok_vocab *v, struct kvr_err *err)
{
    struct kvr_gguf_arr arr;
    int rc = kvr_gguf_get_arr(g, "tokenizer.ggml.tokens", &arr, err);
    if (rc == KVR_ENOTFOUND)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.tokens: missing");
    if (rc)
        return rc;
    if (arr.type != KVR_GGUF_TYPE_STRING)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.tokens: not a string array");
    if (arr.n == 0 || arr.n > KVR_TOK_MAX_VOCAB)
        return kvr_err_set(err, KVR_ERANGE, "tokenizer.ggml.tokens: %llu tokens (allowed 1..%d)",
                           (unsigned long long)arr.n, KVR_TOK_MAX_VOCAB);
    v->n_tokens = (int64_t)arr.n;
    v->tokens = arr.strs;

    bool present;
    if ((rc = gguf_opt_arr(g, "tokenizer.ggml.scores", &arr, &present, err)) != 0)
        return rc;
    if (present) {
        if (arr.type != KVR_GGUF_TYPE_FLOAT32)
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.scores: not a float32 array");
        if (arr.n != (uint64_t)v->n_tokens)
            return kvr_err_set(err, KVR_EFORMAT,
                               "tokenizer.ggml.scores: %llu scores for %lld tokens",
                               (unsigned long long)arr.n, (long long)v->n_tokens);
        v->scores = arr.data;
    }

    if ((rc = gguf_opt_arr(g, "tokenizer.ggml.token_type", &arr, &present, err)) != 0)
        return rc;
    if (present) {
        if (arr.type != KVR_GGUF_TYPE_INT32 && arr.type != KVR_GGUF_TYPE_UINT32)
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.token_type: not an int32 array");
        if (arr.n != (uint64_t)v->n_tokens)
            return kvr_err_set(err, KVR_EFORMAT,
                               "tokenizer.ggml.token_type: %llu types for %lld tokens",
                               (unsigned long long)arr.n, (long long)v->n_tokens);
        v->types = arr.data;
    }
    return KVR_OK;
}

/* A BPE vocabulary's merge rules (tokenizer.ggml.merges), required. */
static int read_merges(const struct kvr_gguf *g, struct kvr_tok_vocab *v, struct kvr_err *err)
{
    struct kvr_gguf_arr arr;
    int rc = kvr_gguf_get_arr(g, "tokenizer.ggml.merges", &arr, err);
    if (rc == KVR_ENOTFOUND)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.merges: missing (gpt2 model)");
    if (rc)
        return rc;
    if (arr.type != KVR_GGUF_TYPE_STRING)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.merges: not a string array");
    if (arr.n > (uint64_t)KVR_TOK_MAX_VOCAB * 4)
        return kvr_err_set(err, KVR_ERANGE, "tokenizer.ggml.merges: %llu merges",
                           (unsigned long long)arr.n);
    v->n_merges = (int64_t)arr.n;
    v->merges = arr.strs;
    return KVR_OK;
}

/* The special ids and the flags; absent keys leave kvr_tok_vocab_init's defaults. */
static int read_ids(const struct kvr_gguf *g, struct kvr_tok_vocab *v, struct kvr_err *err)
{
    int rc;
    if ((rc = gguf_id(g, "tokenizer.ggml.bos_token_id", &v->bos_id, err)) ||
        (rc = gguf_id(g, "tokenizer.ggml.eos_token_id", &v->eos_id, err)) ||
        (rc = gguf_id(g, "tokenizer.ggml.unknown_token_id", &v->unk_id, err)) ||
        (rc = gguf_id(g, "tokenizer.ggml.padding_token_id", &v->pad_id, err)) ||
        (rc = gguf_id(g, "tokenizer.ggml.eot_token_id", &v->eot_id, err)) ||
        (rc = gguf_id(g, "tokenizer.ggml.eom_token_id", &v->eom_id, err)) ||
        (rc = gguf_flag(g, "tokenizer.ggml.add_bos_token", &v->add_bos, err)) ||
        (rc = gguf_flag(g, "tokenizer.ggml.add_eos_token", &v->add_eos, err)) ||
        (rc = gguf_flag(g, "tokenizer.ggml.add_space_prefix", &v->add_space_prefix, err)))
        return rc;
    return KVR_OK;
}

int kvr_tok_create(struct kvr_tok **out, const struct kvr_gguf *g, struct kvr_err *err)
{
    *out = NULL;
    enum kvr_tok_kind kind = KVR_TOK_KIND_COUNT;
    int rc = read_kind(g, &kind, err);
    if (rc)
        return rc;
    struct kvr_tok_vocab v;
    kvr_tok_vocab_init(&v, kind);
    if ((kind == KVR_TOK_BPE && (rc = read_pre(g, &v.pre, err))) ||
        (rc = read_pieces(g, &v, err)) || (kind == KVR_TOK_BPE && (rc = read_merges(g, &v, err))) ||
        (rc = read_ids(g, &v, err)))
        return rc;
    return kvr_tok_create_from_vocab(out, &v, err);
}

/* ---- accessors ------------------------------------------------------------------------ */

const char *kvr_tok_pre_name(size_t i)
{
    return kvr_pre_name(i);
}

enum kvr_tok_kind kvr_tok_kind(const struct kvr_tok *t)
{
    return t->kind;
}
int32_t kvr_tok_n_vocab(const struct kvr_tok *t)
{
    return t->n_vocab;
}
int32_t kvr_tok_bos(const struct kvr_tok *t)
{
    return t->bos;
}
int32_t kvr_tok_eos(const struct kvr_tok *t)
{
    return t->eos;
}
bool kvr_tok_add_bos(const struct kvr_tok *t)
{
    return t->add_bos;
}
bool kvr_tok_add_eos(const struct kvr_tok *t)
{
    return t->add_eos;
}

bool kvr_tok_is_eog(const struct kvr_tok *t, int32_t id)
{
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return true;
    return false;
}

enum kvr_tok_type kvr_tok_type(const struct kvr_tok *t, int32_t id)
{
    if (id < 0 || id >= t->n_vocab)
        return KVR_TOK_TYPE_UNDEFINED;
    return (enum kvr_tok_type)t->types[id];
}

int kvr_tok_piece(const struct kvr_tok *t, int32_t id, const char **ptr, size_t *len)
{
    if (id < 0 || id >= t->n_vocab)
        return KVR_EINVAL;
    *ptr = t->text + t->off[id];
    *len = t->off[id + 1] - t->off[id];
    return 0;
}

int32_t kvr_tok_find(const struct kvr_tok *t, const char *piece, size_t len)
{
    return len ? kvr_tok_map_find(t, piece, len) : -1;
}
