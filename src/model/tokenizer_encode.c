/* tokenizer_encode.c - text -> token ids (kvr_tok_encode): the caller's scratch, the merge
 * queue, the SentencePiece encoder, the special-token partition and the byte-level BPE
 * encoder. The algorithms follow llama.cpp's llama-vocab.cpp; comments point out where its
 * exact behaviour matters. */
#define _GNU_SOURCE /* memmem */
#include "model/tokenizer.h"

#include "core/alloc.h"
#include "core/utf8.h"
#include "model/tokenizer_impl.h"
#include "model/tokenizer_pre.h"
#include "model/tokenizer_unicode.h"

#include <string.h>

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

/* Split buf[0..m) into symbols, one per UTF-8 character judged by its lead byte only, as
 * llama.cpp does (a continuation or invalid byte is one symbol): the split must match. */
static int32_t split_symbols(struct kvr_tok_scratch *s, size_t m)
{
    int32_t n = 0;
    for (size_t off = 0; off < m;) {
        size_t len = kvr_utf8_llama_len((unsigned char)s->buf[off]);
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
    int32_t id = kvr_tok_map_find(t, s->buf + s->sym[l].off, size);
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
        int32_t id = kvr_tok_map_find(t, p, s->sym[i].n);
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

static void bpe_try_pair(const struct kvr_tok *t, struct kvr_tok_scratch *s, int32_t l, int32_t r)
{
    if (l < 0 || r < 0 || s->sym[l].id < 0 || s->sym[r].id < 0)
        return;
    const struct kvr_tok_merge_slot *m = kvr_tok_merge_find(t, s->sym[l].id, s->sym[r].id);
    if (!m)
        return;
    heap_push(s, (struct pair){0.0f, m->rank, l, r, s->sym[l].n + s->sym[r].n, m->result});
}

static int bpe_word(const struct kvr_tok *t, struct kvr_tok_scratch *s, const uint32_t *cps,
                    size_t n_cps, struct out *o)
{
    size_t m = 0;
    for (size_t i = 0; i < n_cps; i++)
        m += kvr_utf8_encode(cps[i], s->buf + m);
    if (t->pre->ignore_merges && m > 1 && m <= KVR_TOK_MAX_PIECE_BYTES) {
        /* The word as one piece, if the vocabulary has it: its byte-alphabet spelling (at
         * most two bytes per byte; a longer word cannot be a piece). */
        char spelled[2 * KVR_TOK_MAX_PIECE_BYTES];
        size_t k = 0;
        for (size_t i = 0; i < m; i++)
            k += kvr_utf8_encode(kvr_tok_byte_to_cp((uint8_t)s->buf[i]), spelled + k);
        int32_t id = kvr_tok_map_find(t, spelled, k);
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
        size_t k = kvr_utf8_encode(kvr_tok_byte_to_cp((uint8_t)s->buf[s->sym[i].off]), ch);
        for (size_t j = 0; j < k; j++) {
            int32_t id = kvr_tok_map_find(t, ch + j, 1);
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
    /* llama.cpp's decoding, bad bytes one U+FFFD each. Values above U+10FFFF also become
     * U+FFFD: llama.cpp cannot encode them back and fails. */
    for (size_t i = 0; i < len;)
        i += kvr_utf8_decode(text + i, len - i, &s->cps[n++], KVR_UTF8_LLAMA);
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
