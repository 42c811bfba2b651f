/* tokenizer.c - SentencePiece and byte-level BPE tokenizers over a GGUF vocabulary.
 *
 * Reading order: the piece -> id hash map, UTF-8 and GPT-2 byte-alphabet helpers, building
 * a tokenizer (validation, decoded pieces, special-token tables) from arrays or a GGUF, the
 * scratch and the merge queue, the SPM encoder, the special-token partition, the BPE
 * encoder, kvr_tok_encode tying them together, then decoding and the streaming
 * detokenizer.
 *
 * The algorithms follow llama.cpp's llama-vocab.cpp (that is the reference the test vectors
 * come from); comments point out where its exact behaviour matters. */
#define _GNU_SOURCE /* memmem */
#include "model/tokenizer.h"

#include "core/alloc.h"
#include "model/tokenizer_pre.h"
#include "model/tokenizer_unicode.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- piece -> id map ------------------------------------------------------------------
 * Open addressing with linear probing over a power-of-two table at most half full. Each
 * slot keeps the piece's 32-bit hash so most probes never touch the piece bytes. */

struct slot {
    uint32_t hash;
    int32_t id; /* -1: empty */
};

/* A merge rule of the BPE model: the pair (left, right) of token ids merges into `result`
 * with priority `rank` (lower first). */
struct merge_slot {
    int32_t left, right; /* -1: empty */
    int32_t rank;
    int32_t result;
};

struct kvr_tok {
    enum kvr_tok_kind kind;
    int32_t n_vocab;

    /* Pieces as stored in the file, back to back: piece i is text[off[i] .. off[i+1]). */
    char *text;
    uint32_t *off; /* [n_vocab + 1] */
    /* Decoded pieces (what a token prints as; see kvr_tok_decode_piece). */
    char *dec;
    uint32_t *dec_off;    /* [n_vocab + 1] */
    float *scores;        /* [n_vocab] SPM merge priority (higher merges first) */
    uint8_t *types;       /* [n_vocab] enum kvr_tok_type */
    size_t max_out_bytes; /* longest decoded or raw piece */

    struct slot *map;
    uint32_t map_mask;

    /* Token for each raw byte when no piece covers it: SPM "<0xXX>" byte tokens (or the
     * single-byte piece, or <unk>), BPE the piece of the byte's code point. -1: none. */
    int32_t byte_id[256];

    /* Tokens split out of the text before the model runs (control, unknown, user-defined),
     * longest piece first, then lowest id. */
    int32_t *specials;
    int32_t n_specials;

    int32_t bos, eos, unk, pad, eot, eom;
    int32_t eog[KVR_TOK_MAX_EOG];
    int n_eog;
    bool add_bos, add_eos, add_space_prefix;

    /* BPE only. */
    struct merge_slot *merges;
    uint32_t merge_mask;
    const struct kvr_pre *pre; /* how text is split into words before merging */
};

static uint32_t hash_bytes(const char *p, size_t n)
{
    /* FNV-1a, folded to 32 bits. */
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)p[i];
        h *= 0x100000001b3ull;
    }
    return (uint32_t)(h ^ (h >> 32));
}

static int32_t map_find(const struct kvr_tok *t, const char *p, size_t n)
{
    uint32_t h = hash_bytes(p, n);
    for (uint32_t i = h & t->map_mask;; i = (i + 1) & t->map_mask) {
        const struct slot *s = &t->map[i];
        if (s->id < 0)
            return -1;
        if (s->hash == h) {
            uint32_t a = t->off[s->id], b = t->off[s->id + 1];
            if (b - a == n && memcmp(t->text + a, p, n) == 0)
                return s->id;
        }
    }
}

/* Insert piece `id`; returns the id of an earlier identical piece, or -1. */
static int32_t map_insert(struct kvr_tok *t, int32_t id)
{
    const char *p = t->text + t->off[id];
    size_t n = t->off[id + 1] - t->off[id];
    uint32_t h = hash_bytes(p, n);
    for (uint32_t i = h & t->map_mask;; i = (i + 1) & t->map_mask) {
        struct slot *s = &t->map[i];
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

static uint32_t pair_hash(int32_t a, int32_t b)
{
    uint64_t h = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) * 0x9e3779b97f4a7c15ull;
    return (uint32_t)(h >> 32);
}

static const struct merge_slot *merge_find(const struct kvr_tok *t, int32_t a, int32_t b)
{
    for (uint32_t i = pair_hash(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const struct merge_slot *s = &t->merges[i];
        if (s->left < 0)
            return NULL;
        if (s->left == a && s->right == b)
            return s;
    }
}

/* ---- UTF-8 helpers ------------------------------------------------------------------- */

/* Length of a UTF-8 sequence judged by its first byte only, as llama.cpp's
 * unicode_len_utf8 does (continuation and invalid bytes count as 1). SPM and BPE split the
 * text into symbols with it, so it must stay this lenient to match. */
static size_t utf8_len(uint8_t c)
{
    static const uint8_t len_by_high_nibble[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len_by_high_nibble[c >> 4];
}

static size_t utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Decode one well-formed UTF-8 character at p[0..n); returns its length, or 0 if the bytes
 * there are not a valid, shortest-form character. */
static size_t utf8_get(const uint8_t *p, size_t n, uint32_t *cp)
{
    uint8_t c = p[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t len;
    uint32_t v, min;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2, v = c & 0x1F, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, v = c & 0x0F, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, v = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0;
        v = v << 6 | (p[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    *cp = v;
    return len;
}

/* ---- GPT-2 byte <-> code point map ----------------------------------------------------
 * Byte-level BPE works on text where every byte is replaced by one printable code point:
 * the printable Latin-1 bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) stand for themselves and
 * the other 68 bytes take U+0100, U+0101, ... in byte order (so ' ' is U+0120 "Ġ"). */

static bool byte_is_printable(unsigned b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

static uint32_t byte_to_cp(unsigned b)
{
    if (byte_is_printable(b))
        return b;
    uint32_t n = 0;
    for (unsigned i = 0; i < b; i++)
        n += !byte_is_printable(i);
    return 0x100 + n;
}

/* Inverse of byte_to_cp; -1 for a code point outside the alphabet. */
static int cp_to_byte(uint32_t cp)
{
    if (cp < 0x100)
        return byte_is_printable(cp) ? (int)cp : -1;
    if (cp >= 0x100 + 68)
        return -1;
    uint32_t n = 0;
    for (unsigned b = 0; b < 256; b++) {
        if (!byte_is_printable(b)) {
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
        size_t len = utf8_get((const uint8_t *)p + k, n - k, &cp);
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
        int32_t a = map_find(t, p, nl), b = map_find(t, sp + 1, nr);
        int32_t c = map_find(t, cat, nl + nr);
        const char *missing = a < 0 ? p : b < 0 ? sp + 1 : cat;
        size_t n_missing = a < 0 ? nl : b < 0 ? nr : nl + nr;
        if (a < 0 || b < 0 || c < 0)
            return kvr_err_set(err, KVR_EFORMAT,
                               "tokenizer: merge %lld '%s': '%s' is not in the vocabulary",
                               (long long)r, excerpt(p, n, q1), excerpt(missing, n_missing, q2));
        for (uint32_t i = pair_hash(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
            struct merge_slot *s = &t->merges[i];
            if (s->left < 0) {
                *s = (struct merge_slot){a, b, (int32_t)r, c};
                break;
            }
            if (s->left == a && s->right == b)
                break; /* a repeated rule keeps its first (best) rank */
        }
    }
    return 0;
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
    int32_t n = (int32_t)v->n_tokens;
    int rc = KVR_ENOMEM;

    struct kvr_tok *t = kvr_calloc(1, sizeof *t);
    if (!t)
        return kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory");
    t->kind = v->kind;
    t->n_vocab = n;
    if (t->kind == KVR_TOK_BPE) {
        if (v->pre.len > 0 && !v->pre.ptr) {
            rc = kvr_err_set(err, KVR_EINVAL, "tokenizer: pre-tokenizer name has no bytes");
            goto fail;
        }
        t->pre = v->pre.len ? kvr_pre_find(v->pre.ptr, (size_t)v->pre.len) : kvr_pre_gpt2();
        if (!t->pre) {
            char q[48], names[200];
            kvr_pre_list(names, sizeof names, false);
            rc = kvr_err_set(err, KVR_ENOTSUP,
                             "tokenizer.ggml.pre: '%s' is not supported (supported: %s, and "
                             "aliases)",
                             excerpt(v->pre.ptr, (size_t)v->pre.len, q), names);
            goto fail;
        }
    }

    /* Pieces. */
    uint64_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        if (v->tokens[i].len > KVR_TOK_MAX_PIECE_BYTES) {
            rc = kvr_err_set(err, KVR_ERANGE, "tokenizer: token %d is %llu bytes (max %d)", i,
                             (unsigned long long)v->tokens[i].len, KVR_TOK_MAX_PIECE_BYTES);
            goto fail;
        }
        if (v->tokens[i].len > 0 && !v->tokens[i].ptr) {
            rc = kvr_err_set(err, KVR_EINVAL, "tokenizer: token %d has no bytes", i);
            goto fail;
        }
        total += v->tokens[i].len; /* <= 2^24 * 4096 = 2^36: no overflow */
    }
    if (total > UINT32_MAX / 3) {
        rc = kvr_err_set(err, KVR_ERANGE, "tokenizer: %llu bytes of pieces is too many",
                         (unsigned long long)total);
        goto fail;
    }
    t->text = kvr_malloc(total ? (size_t)total : 1);
    t->off = kvr_malloc(((size_t)n + 1) * sizeof *t->off);
    t->dec_off = kvr_malloc(((size_t)n + 1) * sizeof *t->dec_off);
    t->scores = kvr_malloc((size_t)n * sizeof *t->scores);
    t->types = kvr_malloc((size_t)n);
    if (!t->text || !t->off || !t->dec_off || !t->scores || !t->types) {
        rc = kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory for %d tokens", n);
        goto fail;
    }
    uint32_t pos = 0;
    for (int32_t i = 0; i < n; i++) {
        t->off[i] = pos;
        if (v->tokens[i].len)
            memcpy(t->text + pos, v->tokens[i].ptr, (size_t)v->tokens[i].len);
        pos += (uint32_t)v->tokens[i].len;
        float s = v->scores ? rd_f32(v->scores, i) : 0.0f;
        if (isnan(s)) {
            rc = kvr_err_set(err, KVR_EFORMAT, "tokenizer: token %d has a NaN score", i);
            goto fail;
        }
        t->scores[i] = s;
        int32_t ty = v->types ? rd_i32(v->types, i) : KVR_TOK_TYPE_NORMAL;
        if (ty < 0 || ty >= KVR_TOK_TYPE_COUNT) {
            rc = kvr_err_set(err, KVR_EFORMAT, "tokenizer: token %d has unknown type %d", i,
                             (int)ty);
            goto fail;
        }
        t->types[i] = (uint8_t)ty;
        if (t->kind == KVR_TOK_SPM && ty == KVR_TOK_TYPE_BYTE &&
            spm_byte_of(t->text + t->off[i], v->tokens[i].len) < 0) {
            char q[48];
            rc = kvr_err_set(err, KVR_EFORMAT,
                             "tokenizer: byte token %d '%s' is not of the form <0xXX>", i,
                             excerpt(t->text + t->off[i], v->tokens[i].len, q));
            goto fail;
        }
    }
    t->off[n] = pos;

    /* Map. Empty pieces are never matched (llama.cpp renames them to "[EMPTY_<id>]");
     * duplicated pieces are rejected as llama.cpp's loader does. */
    uint32_t cap = 16;
    while (cap < 2 * (uint32_t)n)
        cap *= 2;
    t->map = kvr_malloc((size_t)cap * sizeof *t->map);
    if (!t->map) {
        rc = kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory");
        goto fail;
    }
    t->map_mask = cap - 1;
    for (uint32_t i = 0; i < cap; i++)
        t->map[i].id = -1;
    for (int32_t i = 0; i < n; i++) {
        if (t->off[i + 1] == t->off[i])
            continue;
        int32_t dup = map_insert(t, i);
        if (dup >= 0) {
            char q[48];
            rc = kvr_err_set(err, KVR_EFORMAT, "tokenizer: token %d '%s' duplicates token %d", i,
                             excerpt(t->text + t->off[i], t->off[i + 1] - t->off[i], q), dup);
            goto fail;
        }
    }

    /* Special ids and flags. */
    if ((rc = check_id(v->bos_id, n, "bos", &t->bos, err)) ||
        (rc = check_id(v->eos_id, n, "eos", &t->eos, err)) ||
        (rc = check_id(v->unk_id, n, "unknown", &t->unk, err)) ||
        (rc = check_id(v->pad_id, n, "padding", &t->pad, err)) ||
        (rc = check_id(v->eot_id, n, "eot", &t->eot, err)) ||
        (rc = check_id(v->eom_id, n, "eom", &t->eom, err)))
        goto fail;
    bool spm = t->kind == KVR_TOK_SPM;
    t->add_bos = v->add_bos < 0 ? spm || (t->pre && t->pre->add_bos) : v->add_bos != 0;
    t->add_eos = v->add_eos < 0 ? false : v->add_eos != 0;
    t->add_space_prefix = v->add_space_prefix < 0 ? spm : v->add_space_prefix != 0;
    if (t->add_bos && t->bos < 0) {
        rc = kvr_err_set(err, KVR_EFORMAT, "tokenizer: adds a BOS token but has no BOS id");
        goto fail;
    }
    if (t->add_eos && t->eos < 0) {
        rc = kvr_err_set(err, KVR_EFORMAT, "tokenizer: adds an EOS token but has no EOS id");
        goto fail;
    }

    /* End of generation. */
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
        int32_t id = map_find(t, eog_texts[k], strlen(eog_texts[k]));
        add_eog(t, id);
        if (id >= 0)
            t->types[id] = KVR_TOK_TYPE_CONTROL;
    }
    for (size_t k = 0; k < sizeof fim_texts / sizeof fim_texts[0]; k++) {
        int32_t id = map_find(t, fim_texts[k], strlen(fim_texts[k]));
        if (id >= 0)
            t->types[id] = KVR_TOK_TYPE_CONTROL;
    }

    /* Byte fallback. */
    for (int b = 0; b < 256; b++) {
        if (spm) {
            static const char hex[] = "0123456789ABCDEF";
            char buf[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
            char one = (char)b;
            int32_t id = map_find(t, buf, 6);
            if (id < 0)
                id = map_find(t, &one, 1);
            t->byte_id[b] = id >= 0 ? id : t->unk;
        } else {
            char buf[4];
            t->byte_id[b] = map_find(t, buf, utf8_put(byte_to_cp((unsigned)b), buf));
        }
    }

    /* Specials, longest first. */
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
        rc = kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory");
        goto fail;
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

    /* Decoded pieces: never longer than the raw piece ("▁" becomes one space, "<0xXX>" one
     * byte, a BPE code point one byte or itself). */
    t->dec = kvr_malloc(total ? (size_t)total : 1);
    if (!t->dec) {
        rc = kvr_err_set(err, KVR_ENOMEM, "tokenizer: out of memory");
        goto fail;
    }
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

int kvr_tok_create(struct kvr_tok **out, const struct kvr_gguf *g, struct kvr_err *err)
{
    *out = NULL;
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

    struct kvr_gguf_str pre = {0, NULL};
    if (kind == KVR_TOK_BPE) {
        /* llama.cpp falls back to a "default" pattern when the key is missing and warns that
         * the output will be degraded; a file without the key is refused here instead. */
        rc = kvr_gguf_get_str(g, "tokenizer.ggml.pre", &pre, err);
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
        if (pre.len == 0)
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.pre: empty");
    }

    struct kvr_tok_vocab v;
    kvr_tok_vocab_init(&v, kind);
    v.pre = pre;

    struct kvr_gguf_arr arr;
    rc = kvr_gguf_get_arr(g, "tokenizer.ggml.tokens", &arr, err);
    if (rc == KVR_ENOTFOUND)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.tokens: missing");
    if (rc)
        return rc;
    if (arr.type != KVR_GGUF_TYPE_STRING)
        return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.tokens: not a string array");
    if (arr.n == 0 || arr.n > KVR_TOK_MAX_VOCAB)
        return kvr_err_set(err, KVR_ERANGE, "tokenizer.ggml.tokens: %llu tokens (allowed 1..%d)",
                           (unsigned long long)arr.n, KVR_TOK_MAX_VOCAB);
    v.n_tokens = (int64_t)arr.n;
    v.tokens = arr.strs;

    bool present;
    if ((rc = gguf_opt_arr(g, "tokenizer.ggml.scores", &arr, &present, err)) != 0)
        return rc;
    if (present) {
        if (arr.type != KVR_GGUF_TYPE_FLOAT32)
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.scores: not a float32 array");
        if (arr.n != (uint64_t)v.n_tokens)
            return kvr_err_set(err, KVR_EFORMAT,
                               "tokenizer.ggml.scores: %llu scores for %lld tokens",
                               (unsigned long long)arr.n, (long long)v.n_tokens);
        v.scores = arr.data;
    }

    if ((rc = gguf_opt_arr(g, "tokenizer.ggml.token_type", &arr, &present, err)) != 0)
        return rc;
    if (present) {
        if (arr.type != KVR_GGUF_TYPE_INT32 && arr.type != KVR_GGUF_TYPE_UINT32)
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.token_type: not an int32 array");
        if (arr.n != (uint64_t)v.n_tokens)
            return kvr_err_set(err, KVR_EFORMAT,
                               "tokenizer.ggml.token_type: %llu types for %lld tokens",
                               (unsigned long long)arr.n, (long long)v.n_tokens);
        v.types = arr.data;
    }

    if (kind == KVR_TOK_BPE) {
        rc = kvr_gguf_get_arr(g, "tokenizer.ggml.merges", &arr, err);
        if (rc == KVR_ENOTFOUND)
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.merges: missing (gpt2 model)");
        if (rc)
            return rc;
        if (arr.type != KVR_GGUF_TYPE_STRING)
            return kvr_err_set(err, KVR_EFORMAT, "tokenizer.ggml.merges: not a string array");
        if (arr.n > (uint64_t)KVR_TOK_MAX_VOCAB * 4)
            return kvr_err_set(err, KVR_ERANGE, "tokenizer.ggml.merges: %llu merges",
                               (unsigned long long)arr.n);
        v.n_merges = (int64_t)arr.n;
        v.merges = arr.strs;
    }

    if ((rc = gguf_id(g, "tokenizer.ggml.bos_token_id", &v.bos_id, err)) ||
        (rc = gguf_id(g, "tokenizer.ggml.eos_token_id", &v.eos_id, err)) ||
        (rc = gguf_id(g, "tokenizer.ggml.unknown_token_id", &v.unk_id, err)) ||
        (rc = gguf_id(g, "tokenizer.ggml.padding_token_id", &v.pad_id, err)) ||
        (rc = gguf_id(g, "tokenizer.ggml.eot_token_id", &v.eot_id, err)) ||
        (rc = gguf_id(g, "tokenizer.ggml.eom_token_id", &v.eom_id, err)) ||
        (rc = gguf_flag(g, "tokenizer.ggml.add_bos_token", &v.add_bos, err)) ||
        (rc = gguf_flag(g, "tokenizer.ggml.add_eos_token", &v.add_eos, err)) ||
        (rc = gguf_flag(g, "tokenizer.ggml.add_space_prefix", &v.add_space_prefix, err)))
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
    return len ? map_find(t, piece, len) : -1;
}

/* ---- scratch ---------------------------------------------------------------------------
 * Sizes for a text of L bytes, with L1 = L + 1:
 *   buf    3 L1 bytes   SPM: the fragment with spaces escaped to 3-byte "▁" plus the prefix;
 *                       BPE: a word's code points re-encoded as UTF-8, where each invalid
 *                       input byte has become the 3-byte U+FFFD
 *   sym    SPM L1       one per character of buf, and a "▁" replaces one input byte;
 *          BPE 3 L1     one per byte of buf
 *   heap   3 * sym      the initial pairs plus at most two per merge
 *   frag   2 L1         each special match adds at most two nodes
 *   cps    BPE L1       the fragment's code points
 *   words  BPE 2 x L1   word ends while the pre-tokenizer splits (at most one per code
 *                       point) */

struct symbol {
    uint32_t off; /* into buf */
    uint32_t n;   /* bytes; 0 once merged into its left neighbour */
    int32_t prev, next;
    int32_t id; /* BPE: the symbol's token, or -1 for a byte with no token */
};

struct pair {
    float score;  /* SPM: the merged piece's score (higher first); BPE: 0 */
    int32_t rank; /* BPE: the merge rule's rank (lower first); SPM: 0 */
    int32_t left, right;
    uint32_t size;  /* bytes of left + right when queued, to detect stale pairs */
    int32_t result; /* the merged token */
};

struct frag {
    uint32_t off, len;
    int32_t id; /* special token, or -1 for raw text */
    int32_t next;
};

struct kvr_tok_scratch {
    enum kvr_tok_kind kind;
    size_t max_text;
    char *buf;
    struct symbol *sym;
    struct pair *heap;
    struct frag *frag;
    uint32_t *cps;
    uint32_t *words_a, *words_b; /* BPE: word ends, kvr_pre_split's two buffers */
    size_t n_heap;
};

int kvr_tok_scratch_create(struct kvr_tok_scratch **out, const struct kvr_tok *t,
                           size_t max_text_bytes)
{
    *out = NULL;
    /* Every offset and count below must fit in 32 bits. */
    if (max_text_bytes > UINT32_MAX / 16)
        return KVR_ERANGE;
    size_t l1 = max_text_bytes + 1;
    size_t n_sym = t->kind == KVR_TOK_SPM ? l1 : 3 * l1;
    struct kvr_tok_scratch *s = kvr_calloc(1, sizeof *s);
    if (!s)
        return KVR_ENOMEM;
    s->kind = t->kind;
    s->max_text = max_text_bytes;
    s->buf = kvr_malloc(3 * l1);
    s->sym = kvr_calloc(n_sym, sizeof *s->sym);
    s->heap = kvr_calloc(3 * n_sym, sizeof *s->heap);
    s->frag = kvr_calloc(2 * l1, sizeof *s->frag);
    bool bpe = t->kind == KVR_TOK_BPE;
    s->cps = bpe ? kvr_calloc(l1, sizeof *s->cps) : NULL;
    s->words_a = bpe ? kvr_calloc(l1, sizeof *s->words_a) : NULL;
    s->words_b = bpe ? kvr_calloc(l1, sizeof *s->words_b) : NULL;
    if (!s->buf || !s->sym || !s->heap || !s->frag ||
        (bpe && (!s->cps || !s->words_a || !s->words_b))) {
        kvr_tok_scratch_destroy(s);
        return KVR_ENOMEM;
    }
    *out = s;
    return 0;
}

void kvr_tok_scratch_destroy(struct kvr_tok_scratch *s)
{
    if (!s)
        return;
    kvr_free(s->buf);
    kvr_free(s->sym);
    kvr_free(s->heap);
    kvr_free(s->frag);
    kvr_free(s->cps);
    kvr_free(s->words_a);
    kvr_free(s->words_b);
    kvr_free(s);
}

size_t kvr_tok_scratch_max_text(const struct kvr_tok_scratch *s)
{
    return s->max_text;
}

/* ---- the merge queue -------------------------------------------------------------------
 * A binary heap of candidate pairs: the best first (SPM: highest score; BPE: lowest rank),
 * and of equal ones the leftmost pair (lowest left symbol index), which is the order
 * llama.cpp's priority queues pop in. The order of two entries equal in all three never
 * matters: only one of them can still be valid (see the stale check in the merge loops). */

static bool pair_before(const struct pair *a, const struct pair *b)
{
    if (a->score != b->score)
        return a->score > b->score;
    if (a->rank != b->rank)
        return a->rank < b->rank;
    return a->left < b->left;
}

static void heap_push(struct kvr_tok_scratch *s, struct pair p)
{
    size_t i = s->n_heap++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!pair_before(&p, &s->heap[up]))
            break;
        s->heap[i] = s->heap[up];
        i = up;
    }
    s->heap[i] = p;
}

static struct pair heap_pop(struct kvr_tok_scratch *s)
{
    struct pair top = s->heap[0];
    struct pair last = s->heap[--s->n_heap];
    size_t n = s->n_heap, i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && pair_before(&s->heap[c + 1], &s->heap[c]))
            c++;
        if (!pair_before(&s->heap[c], &last))
            break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n > 0)
        s->heap[i] = last;
    return top;
}

/* ---- output ---------------------------------------------------------------------------- */

struct out {
    int32_t *ids;
    size_t cap, n;
};

static int emit(struct out *o, int32_t id)
{
    if (o->n >= o->cap)
        return KVR_EFULL;
    o->ids[o->n++] = id;
    return 0;
}

/* Split buf[0..m) into symbols, one per (leniently judged) UTF-8 character. */
static int32_t split_symbols(struct kvr_tok_scratch *s, size_t m)
{
    int32_t n = 0;
    for (size_t off = 0; off < m;) {
        size_t len = utf8_len((uint8_t)s->buf[off]);
        if (len > m - off)
            len = m - off;
        s->sym[n] =
            (struct symbol){(uint32_t)off, (uint32_t)len, n - 1, off + len == m ? -1 : n + 1, -1};
        n++;
        off += len;
    }
    return n;
}

/* ---- SentencePiece -------------------------------------------------------------------- */

static void spm_try_pair(const struct kvr_tok *t, struct kvr_tok_scratch *s, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return;
    /* Neighbouring symbols are adjacent in buf, so the pair's text is contiguous. */
    uint32_t size = s->sym[l].n + s->sym[r].n;
    int32_t id = map_find(t, s->buf + s->sym[l].off, size);
    if (id < 0)
        return;
    heap_push(s, (struct pair){t->scores[id], 0, l, r, size, id});
}

/* Encode one raw fragment. llama.cpp escapes spaces, adds the prefix space, then merges. */
static int spm_fragment(const struct kvr_tok *t, struct kvr_tok_scratch *s, const char *text,
                        size_t len, bool prefix, struct out *o)
{
    size_t m = 0;
    if (prefix) {
        memcpy(s->buf, "\xE2\x96\x81", 3);
        m = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(s->buf + m, "\xE2\x96\x81", 3);
            m += 3;
        } else {
            s->buf[m++] = text[i];
        }
    }
    int32_t n_sym = split_symbols(s, m);
    if (n_sym == 0)
        return 0;

    s->n_heap = 0;
    for (int32_t i = 1; i < n_sym; i++)
        spm_try_pair(t, s, i - 1, i);
    while (s->n_heap > 0) {
        struct pair p = heap_pop(s);
        struct symbol *l = &s->sym[p.left], *r = &s->sym[p.right];
        /* A symbol only grows by absorbing its right neighbour, so a pair whose two sides
         * no longer add up to the size it was queued with is stale. */
        if (l->n == 0 || r->n == 0 || l->n + r->n != p.size)
            continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            s->sym[r->next].prev = p.left;
        spm_try_pair(t, s, l->prev, p.left);
        spm_try_pair(t, s, p.left, l->next);
    }

    /* Every merged symbol is a piece; a symbol left unmerged that is not a piece (a
     * character outside the vocabulary) falls back to one token per byte. */
    for (int32_t i = 0; i != -1; i = s->sym[i].next) {
        const char *p = s->buf + s->sym[i].off;
        int32_t id = map_find(t, p, s->sym[i].n);
        int rc;
        if (id >= 0) {
            if ((rc = emit(o, id)) != 0)
                return rc;
            continue;
        }
        for (uint32_t k = 0; k < s->sym[i].n; k++) {
            int32_t b = t->byte_id[(uint8_t)p[k]];
            if (b < 0)
                return KVR_EINVAL;
            if ((rc = emit(o, b)) != 0)
                return rc;
        }
    }
    return 0;
}

/* ---- special-token partition ------------------------------------------------------------
 * As llama.cpp's tokenizer_st_partition: for each special token, longest first, every raw
 * fragment is split at each leftmost non-overlapping occurrence. Returns the first node of
 * the fragment list (-1 for empty text). */
static int32_t partition(const struct kvr_tok *t, struct kvr_tok_scratch *s, const char *text,
                         size_t len, bool parse_special)
{
    if (len == 0)
        return -1;
    int32_t n_frag = 1;
    s->frag[0] = (struct frag){0, (uint32_t)len, -1, -1};
    for (int32_t k = 0; k < t->n_specials; k++) {
        int32_t id = t->specials[k];
        uint8_t ty = t->types[id];
        if (!parse_special && ty != KVR_TOK_TYPE_USER_DEFINED)
            continue;
        const char *p = t->text + t->off[id];
        uint32_t plen = t->off[id + 1] - t->off[id];
        if (plen > len)
            continue;
        for (int32_t i = 0; i != -1; i = s->frag[i].next) {
            if (s->frag[i].id >= 0)
                continue;
            int32_t cur = i;
            uint32_t off = s->frag[i].off, end = off + s->frag[i].len;
            for (;;) {
                const char *hit = memmem(text + off, end - off, p, plen);
                if (!hit)
                    break;
                uint32_t pos = (uint32_t)(hit - text);
                int32_t after = s->frag[cur].next, tok;
                if (pos > off) {
                    s->frag[cur].len = pos - off;
                    tok = n_frag++;
                    s->frag[cur].next = tok;
                } else {
                    tok = cur;
                }
                s->frag[tok] = (struct frag){pos, plen, id, after};
                cur = tok;
                if (pos + plen == end)
                    break;
                int32_t r = n_frag++;
                s->frag[r] = (struct frag){pos + plen, end - (pos + plen), -1, after};
                s->frag[tok].next = r;
                cur = r;
                off = pos + plen;
            }
            i = cur;
        }
    }
    return 0;
}

/* ---- BPE (GPT-2) ------------------------------------------------------------------------
 * 1. The fragment is decoded into code points the way llama.cpp does it: leniently (the
 *    lead byte decides the length, overlong forms are accepted), and a byte that cannot
 *    start a character becomes U+FFFD.
 * 2. The GPT-2 pre-tokenizer splits the code points into words. Its pattern is
 *      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *    matched by hand below, alternative by alternative, leftmost first.
 * 3. Each word is re-encoded as UTF-8; every byte becomes one symbol (the token of its
 *    byte-alphabet code point), and adjacent symbols merge by rule rank until none apply. */

/* llama.cpp's unicode_cpt_from_utf8, with its failure mapped to U+FFFD (one byte eaten).
 * Values above U+10FFFF (lead bytes F5..F7) also become U+FFFD: llama.cpp cannot encode
 * them back and fails. */
static uint32_t cp_lenient(const uint8_t *p, size_t n, size_t *len)
{
    uint8_t c = p[0];
    size_t k = c < 0x80 ? 1 : c < 0xC0 ? 0 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : c < 0xF8 ? 4 : 0;
    *len = 1;
    if (k == 0 || k > n)
        return 0xFFFD;
    if (k == 1)
        return c;
    uint32_t v = c & (0x7F >> k);
    for (size_t i = 1; i < k; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0xFFFD;
        v = v << 6 | (p[i] & 0x3F);
    }
    if (v > 0x10FFFF)
        return 0xFFFD;
    *len = k;
    return v;
}

static void bpe_try_pair(const struct kvr_tok *t, struct kvr_tok_scratch *s, int32_t l, int32_t r)
{
    if (l < 0 || r < 0 || s->sym[l].id < 0 || s->sym[r].id < 0)
        return;
    const struct merge_slot *m = merge_find(t, s->sym[l].id, s->sym[r].id);
    if (!m)
        return;
    heap_push(s, (struct pair){0.0f, m->rank, l, r, s->sym[l].n + s->sym[r].n, m->result});
}

static int bpe_word(const struct kvr_tok *t, struct kvr_tok_scratch *s, const uint32_t *cps,
                    size_t n_cps, struct out *o)
{
    size_t m = 0;
    for (size_t i = 0; i < n_cps; i++)
        m += utf8_put(cps[i], s->buf + m);
    if (t->pre->ignore_merges && m > 1 && m <= KVR_TOK_MAX_PIECE_BYTES) {
        /* The word as one piece, if the vocabulary has it: its byte-alphabet spelling (at
         * most two bytes per byte; a longer word cannot be a piece). */
        char spelled[2 * KVR_TOK_MAX_PIECE_BYTES];
        size_t k = 0;
        for (size_t i = 0; i < m; i++)
            k += utf8_put(byte_to_cp((uint8_t)s->buf[i]), spelled + k);
        int32_t id = map_find(t, spelled, k);
        if (id >= 0)
            return emit(o, id);
    }
    int32_t n_sym = (int32_t)m;
    for (int32_t i = 0; i < n_sym; i++)
        s->sym[i] = (struct symbol){(uint32_t)i, 1, i - 1, i + 1 == n_sym ? -1 : i + 1,
                                    t->byte_id[(uint8_t)s->buf[i]]};
    s->n_heap = 0;
    for (int32_t i = 1; i < n_sym; i++)
        bpe_try_pair(t, s, i - 1, i);
    while (s->n_heap > 0) {
        struct pair p = heap_pop(s);
        struct symbol *l = &s->sym[p.left], *r = &s->sym[p.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != p.size)
            continue; /* stale, as in spm_fragment */
        l->n += r->n;
        l->id = p.result;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            s->sym[r->next].prev = p.left;
        bpe_try_pair(t, s, l->prev, p.left);
        bpe_try_pair(t, s, p.left, l->next);
    }
    for (int32_t i = 0; i != -1 && n_sym > 0; i = s->sym[i].next) {
        int rc;
        if (s->sym[i].id >= 0) {
            if ((rc = emit(o, s->sym[i].id)) != 0)
                return rc;
            continue;
        }
        /* A byte whose alphabet character is not a token: llama.cpp tries each byte of
         * that character as a one-byte piece and silently drops the ones that are not. */
        char ch[4];
        size_t k = utf8_put(byte_to_cp((uint8_t)s->buf[s->sym[i].off]), ch);
        for (size_t j = 0; j < k; j++) {
            int32_t id = map_find(t, ch + j, 1);
            if (id >= 0 && (rc = emit(o, id)) != 0)
                return rc;
        }
    }
    return 0;
}

static int bpe_fragment(const struct kvr_tok *t, struct kvr_tok_scratch *s, const char *text,
                        size_t len, struct out *o)
{
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        size_t k;
        s->cps[n++] = cp_lenient((const uint8_t *)text + i, len - i, &k);
        i += k;
    }
    size_t n_words;
    const uint32_t *ends = kvr_pre_split(t->pre, s->cps, n, s->words_a, s->words_b, &n_words);
    for (size_t w = 0, pos = 0; w < n_words; w++) {
        int rc = bpe_word(t, s, s->cps + pos, ends[w] - pos, o);
        if (rc)
            return rc;
        pos = ends[w];
    }
    return 0;
}

/* ---- encode ----------------------------------------------------------------------------- */

int kvr_tok_encode(const struct kvr_tok *t, struct kvr_tok_scratch *s, const char *text, size_t len,
                   bool add_special, bool parse_special, int32_t *ids, size_t max_ids)
{
    if (s->kind != t->kind)
        return KVR_EINVAL;
    if (len > s->max_text)
        return KVR_ERANGE;
    struct out o = {ids, max_ids, 0};
    int rc;
    if (add_special && t->add_bos && (rc = emit(&o, t->bos)) != 0)
        return rc;
    /* SPM prefixes a space to the text and to every fragment that follows a special. */
    bool prev_special = true;
    for (int32_t i = partition(t, s, text, len, parse_special); i != -1; i = s->frag[i].next) {
        const struct frag *f = &s->frag[i];
        if (f->id >= 0) {
            rc = emit(&o, f->id);
            prev_special = true;
        } else if (t->kind == KVR_TOK_SPM) {
            rc = spm_fragment(t, s, text + f->off, f->len, t->add_space_prefix && prev_special, &o);
            prev_special = false;
        } else {
            rc = bpe_fragment(t, s, text + f->off, f->len, &o);
        }
        if (rc)
            return rc;
    }
    if (add_special && t->add_eos && (rc = emit(&o, t->eos)) != 0)
        return rc;
    return (int)o.n;
}

/* ---- decoding --------------------------------------------------------------------------- */

int kvr_tok_decode_piece(const struct kvr_tok *t, int32_t id, bool special, const char **ptr,
                         size_t *len)
{
    if (id < 0 || id >= t->n_vocab)
        return KVR_EINVAL;
    uint8_t ty = t->types[id];
    if (special && (ty == KVR_TOK_TYPE_CONTROL || ty == KVR_TOK_TYPE_UNKNOWN))
        return kvr_tok_piece(t, id, ptr, len);
    *ptr = t->dec + t->dec_off[id];
    *len = t->dec_off[id + 1] - t->dec_off[id];
    return 0;
}

void kvr_detok_init(struct kvr_detok *d, bool text_start, bool special)
{
    memset(d, 0, sizeof *d);
    d->strip_space = text_start;
    d->special = special;
}

size_t kvr_detok_max_bytes(const struct kvr_tok *t)
{
    /* Worst case: every byte (3 pending + the piece) becomes a 3-byte U+FFFD. */
    return 3 * (t->max_out_bytes + 4);
}

struct sink {
    char *out;
    size_t cap, n;
    bool full;
};

static void put(struct sink *k, const char *p, size_t n)
{
    if (k->n + n > k->cap) {
        k->full = true;
        return;
    }
    memcpy(k->out + k->n, p, n);
    k->n += n;
}

static void put_fffd(struct sink *k)
{
    put(k, "\xEF\xBF\xBD", 3);
}

/* One byte through the UTF-8 validator (the Unicode "maximal subpart" rule: a sequence cut
 * short becomes one U+FFFD and the byte that broke it is looked at afresh). */
static void feed(struct kvr_detok *d, uint8_t b, struct sink *k)
{
    if (d->n_pending > 0) {
        uint8_t lo = 0x80, hi = 0xBF;
        if (d->n_pending == 1) {
            switch (d->pending[0]) {
            case 0xE0:
                lo = 0xA0;
                break; /* no overlong 3-byte forms */
            case 0xED:
                hi = 0x9F;
                break; /* no surrogates */
            case 0xF0:
                lo = 0x90;
                break; /* no overlong 4-byte forms */
            case 0xF4:
                hi = 0x8F;
                break; /* nothing above U+10FFFF */
            default:
                break;
            }
        }
        if (b >= lo && b <= hi) {
            d->pending[d->n_pending++] = b;
            if (d->n_pending == d->need) {
                put(k, (const char *)d->pending, d->need);
                d->n_pending = 0;
            }
            return;
        }
        put_fffd(k);
        d->n_pending = 0;
    }
    if (b < 0x80) {
        char c = (char)b;
        put(k, &c, 1);
    } else if (b >= 0xC2 && b <= 0xDF) {
        d->need = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
        d->need = 3;
    } else if (b >= 0xF0 && b <= 0xF4) {
        d->need = 4;
    } else {
        put_fffd(k);
        return;
    }
    if (b >= 0x80) {
        d->pending[0] = b;
        d->n_pending = 1;
    }
}

int kvr_detok_push(const struct kvr_tok *t, struct kvr_detok *d, int32_t id, char *out, size_t cap)
{
    const char *p;
    size_t n;
    if (kvr_tok_decode_piece(t, id, d->special, &p, &n) != 0)
        return KVR_EINVAL;
    if (n == 0)
        return 0;
    struct kvr_detok saved = *d;
    if (d->strip_space) {
        d->strip_space = false;
        if (t->add_space_prefix && p[0] == ' ') {
            p++;
            n--;
        }
    }
    struct sink k = {out, cap, 0, false};
    for (size_t i = 0; i < n; i++)
        feed(d, (uint8_t)p[i], &k);
    if (k.full) {
        *d = saved;
        return KVR_EFULL;
    }
    return (int)k.n;
}

int kvr_detok_flush(struct kvr_detok *d, char *out, size_t cap)
{
    if (d->n_pending == 0)
        return 0;
    if (cap < 3)
        return KVR_EFULL;
    memcpy(out, "\xEF\xBF\xBD", 3);
    d->n_pending = 0;
    return 3;
}
