/* grammar.c - the matcher (grammar.h): sets of stacks, advancing them by a code point, and
 * by UTF-8 bytes with a character half-read between calls. Reading order: classes, stack
 * sets, expansion, advancing, bytes, the matcher API.
 *
 * A stack lists frame positions, bottom first; its top is always a character class (the
 * set is kept expanded). Expanding a position: a class is a finished stack; ALT or END
 * ends the frame (pop, and continue in the frame below, which already points past the
 * reference); a reference moves its frame past itself (or pops it when nothing of the rule
 * follows, so right recursion does not grow) and continues with one copy per alternative
 * of the rule it names. Compile refused left recursion, so expansion ends; a work bound
 * and KVR_GRAMMAR_MAX_DEPTH stop an adversarial grammar anyway (the stack is dropped and
 * `overflow` set). */
#include "model/grammar_int.h"

#include "core/alloc.h"
#include "core/utf8.h"

#include <string.h>

/* Expansion steps one advance may take, and how deep expansion may recurse. */
#define EXPAND_WORK (1u << 16)
#define EXPAND_RECURSION 1024u

bool kvr_gclass_any(const struct kvr_grammar *g, uint32_t c, uint32_t lo, uint32_t hi)
{
    const struct gclass *k = &g->cls[c];
    if (!k->negated) {
        for (uint32_t i = k->first; i < k->first + k->n; i++)
            if (g->lo[i] <= hi && g->hi[i] >= lo)
                return true;
        return false;
    }
    /* negated: some point of [lo, hi] lies outside every range */
    uint32_t x = lo;
    for (bool moved = true; moved && x <= hi;) {
        moved = false;
        for (uint32_t i = k->first; i < k->first + k->n; i++)
            if (g->lo[i] <= x && g->hi[i] >= x) {
                if (g->hi[i] >= hi)
                    return false;
                x = g->hi[i] + 1;
                moved = true;
            }
    }
    return x <= hi;
}

/* ---- stack sets ---------------------------------------------------------------------------- */

void kvr_gstacks_fini(struct gstacks *s)
{
    kvr_free(s->data);
    kvr_free(s->off);
    kvr_free(s->len);
    kvr_free(s->hash);
    kvr_free(s->slot_idx);
    kvr_free(s->slot_stamp);
    memset(s, 0, sizeof *s);
}

/* Forget the hash index (its stamp moves on). */
static void forget_index(struct gstacks *s)
{
    if (++s->stamp == 0 && s->slot_stamp) { /* wrapped: old stamps could match again */
        memset(s->slot_stamp, 0, 2 * KVR_GRAMMAR_MAX_STACKS * sizeof *s->slot_stamp);
        s->stamp = 1;
    }
}

void kvr_gstacks_clear(struct gstacks *s)
{
    s->n = 0;
    s->n_data = 0;
    s->overflow = false;
    forget_index(s);
}

static int reserve(struct gstacks *s, uint32_t n, size_t n_data)
{
    if (n > s->cap) {
        uint32_t c = s->cap ? s->cap : 8;
        while (c < n)
            c *= 2;
        uint32_t *o = kvr_realloc(s->off, c * sizeof *o);
        if (o)
            s->off = o;
        uint32_t *l = o ? kvr_realloc(s->len, c * sizeof *l) : NULL;
        if (l)
            s->len = l;
        uint64_t *h = l ? kvr_realloc(s->hash, c * sizeof *h) : NULL;
        if (!h)
            return KVR_ENOMEM;
        s->hash = h;
        s->cap = c;
    }
    /* data exists once any stack does, an empty one included, so data + off is never an
     * offset from NULL */
    if (n_data > s->cap_data || !s->data) {
        size_t c = s->cap_data ? s->cap_data : 64;
        while (c < n_data)
            c *= 2;
        uint32_t *d = kvr_realloc(s->data, c * sizeof *d);
        if (!d)
            return KVR_ENOMEM;
        s->data = d;
        s->cap_data = c;
    }
    return KVR_OK;
}

int kvr_gstacks_copy(struct gstacks *dst, const struct gstacks *src)
{
    if (reserve(dst, src->n, src->n_data))
        return KVR_ENOMEM;
    if (src->n_data)
        memcpy(dst->data, src->data, src->n_data * sizeof *dst->data);
    if (src->n) {
        memcpy(dst->off, src->off, src->n * sizeof *dst->off);
        memcpy(dst->len, src->len, src->n * sizeof *dst->len);
        memcpy(dst->hash, src->hash, src->n * sizeof *dst->hash);
    }
    dst->n = src->n;
    dst->n_data = src->n_data;
    dst->overflow = src->overflow;
    forget_index(dst); /* a copy is only read or cleared, never pushed to */
    return KVR_OK;
}

static uint64_t hash_frames(const uint32_t *f, uint32_t n)
{
    uint64_t h = 0xcbf29ce484222325ull ^ n;
    for (uint32_t i = 0; i < n; i++)
        h = (h ^ f[i]) * 0x100000001b3ull;
    return h;
}

static bool same_stack(const struct gstacks *s, uint32_t i, uint64_t h, const uint32_t *f,
                       uint32_t n)
{
    return s->hash[i] == h && s->len[i] == n &&
           (n == 0 || !memcmp(s->data + s->off[i], f, n * sizeof *f));
}

#define LINEAR_STACKS 16 /* below this many, duplicates are found by a scan */
#define SLOT_MASK (2 * KVR_GRAMMAR_MAX_STACKS - 1)

/* Index the set's stacks by hash (the first time it grows past LINEAR_STACKS). */
static int index_stacks(struct gstacks *s)
{
    if (!s->slot_idx) {
        s->slot_idx = kvr_calloc(SLOT_MASK + 1, sizeof *s->slot_idx);
        s->slot_stamp = kvr_calloc(SLOT_MASK + 1, sizeof *s->slot_stamp);
        if (!s->slot_idx || !s->slot_stamp)
            return KVR_ENOMEM;
        s->stamp = 1;
    }
    return KVR_OK;
}

/* The slot of hash h: the stack equal to (f, n), or an empty slot. */
static uint32_t find_slot(const struct gstacks *s, uint64_t h, const uint32_t *f, uint32_t n)
{
    uint32_t k = (uint32_t)(h ^ (h >> 32)) & SLOT_MASK;
    while (s->slot_stamp[k] == s->stamp && !same_stack(s, s->slot_idx[k] - 1, h, f, n))
        k = (k + 1) & SLOT_MASK;
    return k;
}

/* Add one finished stack unless the set holds it already. */
static int push_stack(struct gstacks *s, const uint32_t *f, uint32_t n)
{
    uint64_t h = hash_frames(f, n);
    uint32_t slot = 0;
    if (s->n < LINEAR_STACKS) {
        for (uint32_t i = 0; i < s->n; i++)
            if (same_stack(s, i, h, f, n))
                return KVR_OK;
    } else {
        if (index_stacks(s))
            return KVR_ENOMEM;
        if (s->n == LINEAR_STACKS) /* first time past the scan: index what is there */
            for (uint32_t i = 0; i < s->n; i++) {
                uint32_t k = find_slot(s, s->hash[i], s->data + s->off[i], s->len[i]);
                s->slot_stamp[k] = s->stamp;
                s->slot_idx[k] = i + 1;
            }
        slot = find_slot(s, h, f, n);
        if (s->slot_stamp[slot] == s->stamp)
            return KVR_OK;
    }
    if (s->n >= KVR_GRAMMAR_MAX_STACKS) {
        s->overflow = true;
        return KVR_OK;
    }
    if (reserve(s, s->n + 1, s->n_data + n))
        return KVR_ENOMEM;
    if (n) /* an empty stack (the text is complete) may come before any data */
        memcpy(s->data + s->n_data, f, n * sizeof *f);
    s->off[s->n] = (uint32_t)s->n_data;
    s->len[s->n] = n;
    s->hash[s->n] = h;
    s->n++;
    s->n_data += n;
    if (s->n > LINEAR_STACKS) {
        s->slot_stamp[slot] = s->stamp;
        s->slot_idx[slot] = s->n;
    }
    return KVR_OK;
}

/* ---- expansion ------------------------------------------------------------------------------- */

struct expander {
    const struct kvr_grammar *g;
    struct gstacks *dst;
    uint32_t buf[KVR_GRAMMAR_MAX_DEPTH + 1];
    uint32_t work;
};

static bool ends_frame(const struct kvr_grammar *g, uint32_t pos)
{
    return g->el[pos].type == GEL_END || g->el[pos].type == GEL_ALT;
}

/* Expand buf[0..len) into finished stacks. Writes below `len` are undone before return, so
 * a caller's buffer is as it was (buf[len] and above are scratch). */
static int expand(struct expander *x, uint32_t len, uint32_t recursion)
{
    const struct kvr_grammar *g = x->g;
    uint32_t *buf = x->buf;
    while (len > 0 && ends_frame(g, buf[len - 1]))
        len--;
    if (len == 0 || g->el[buf[len - 1]].type == GEL_CHAR)
        return push_stack(x->dst, buf, len);
    if (++x->work > EXPAND_WORK || recursion > EXPAND_RECURSION) {
        x->dst->overflow = true;
        return KVR_OK;
    }
    uint32_t pos = buf[len - 1], rule = g->el[pos].value;
    uint32_t base = ends_frame(g, pos + 1) ? len - 1 : len; /* a last item replaces its frame */
    if (base + x->dst->depth_base >= KVR_GRAMMAR_MAX_DEPTH) {
        x->dst->overflow = true;
        return KVR_OK;
    }
    uint32_t saved_top = buf[len - 1]; /* base is len - 1 or len: this undoes both */
    buf[len - 1] = pos + 1;
    int rc = KVR_OK;
    for (uint32_t a = g->rule_alt[rule]; a < g->rule_alt[rule + 1] && !rc; a++) {
        buf[base] = g->alt_first[a];
        rc = expand(x, base + 1, recursion + 1);
    }
    buf[len - 1] = saved_top;
    return rc;
}

int kvr_gstacks_start(const struct kvr_grammar *g, struct gstacks *dst)
{
    kvr_gstacks_clear(dst);
    struct expander x = {.g = g, .dst = dst};
    int rc = KVR_OK;
    for (uint32_t a = g->rule_alt[g->root]; a < g->rule_alt[g->root + 1] && !rc; a++) {
        x.buf[0] = g->alt_first[a];
        rc = expand(&x, 1, 0);
    }
    return rc;
}

int kvr_gstacks_add_from(const struct kvr_grammar *g, const uint32_t *frames, uint32_t n,
                         struct gstacks *dst)
{
    if (n > KVR_GRAMMAR_MAX_DEPTH)
        return KVR_EINVAL;
    struct expander x = {.g = g, .dst = dst};
    if (n)
        memcpy(x.buf, frames, n * sizeof *frames);
    return expand(&x, n, 0);
}

/* ---- advancing ------------------------------------------------------------------------------- */

int kvr_gstacks_advance(const struct kvr_grammar *g, const struct gstacks *src, uint32_t cp,
                        struct gstacks *dst)
{
    kvr_gstacks_clear(dst);
    struct expander x; /* buf is filled before use: no need to clear 2 KiB per byte */
    x.g = g;
    x.dst = dst;
    x.work = 0;
    int rc = KVR_OK;
    for (uint32_t i = 0; i < src->n && !rc; i++) {
        uint32_t n = src->len[i];
        const uint32_t *f = src->data + src->off[i];
        if (!n || !kvr_gclass_has(g, g->el[f[n - 1]].value, cp))
            continue;
        memcpy(x.buf, f, n * sizeof *f);
        x.buf[n - 1]++;
        rc = expand(&x, n, 0);
    }
    return rc;
}

bool kvr_gstacks_may_take(const struct kvr_grammar *g, const struct gstacks *s, uint32_t lo,
                          uint32_t hi)
{
    for (uint32_t i = 0; i < s->n; i++)
        if (s->len[i] && kvr_gclass_any(g, g->el[s->data[s->off[i] + s->len[i] - 1]].value, lo, hi))
            return true;
    return false;
}

bool kvr_gstacks_has_empty(const struct gstacks *s)
{
    for (uint32_t i = 0; i < s->n; i++)
        if (!s->len[i])
            return true;
    return false;
}

/* ---- bytes --------------------------------------------------------------------------------- */

/* The code points a character starting with part's bytes can be: the rest filled with the
 * smallest and largest continuation bytes allowed. */
static void partial_range(const struct gpartial *pt, uint32_t *lo, uint32_t *hi)
{
    static const uint8_t lead_mask[5] = {0, 0x7F, 0x1F, 0x0F, 0x07};
    uint8_t lo2 = 0x80, hi2 = 0xBF;
    kvr_utf8_second_range(pt->bytes[0], &lo2, &hi2);
    uint32_t a = pt->bytes[0] & lead_mask[pt->need], b = a;
    for (uint32_t k = 1; k < pt->need; k++) {
        uint32_t mn = k == 1 ? lo2 : 0x80, mx = k == 1 ? hi2 : 0xBF;
        uint32_t ca = k < pt->n ? pt->bytes[k] : mn, cb = k < pt->n ? pt->bytes[k] : mx;
        a = (a << 6) | (ca & 0x3F);
        b = (b << 6) | (cb & 0x3F);
    }
    *lo = a;
    *hi = b;
}

int kvr_gmatch_byte(const struct kvr_grammar *g, const struct gstacks *st,
                    const struct gpartial *part, uint8_t b, struct gstacks *dst,
                    struct gpartial *dpart, bool *stacks_changed)
{
    struct gpartial np = *part;
    *stacks_changed = false;
    uint32_t cp;
    if (np.n == 0) {
        if (b < 0x80) {
            cp = b;
        } else {
            size_t need = kvr_utf8_lead_len(b);
            if (need < 2)
                return KVR_EINVAL;
            np = (struct gpartial){.bytes = {b}, .n = 1, .need = (uint8_t)need};
            uint32_t lo, hi;
            partial_range(&np, &lo, &hi);
            if (!kvr_gstacks_may_take(g, st, lo, hi))
                return KVR_EINVAL;
            *dpart = np;
            return KVR_OK;
        }
    } else {
        uint8_t lo2 = 0x80, hi2 = 0xBF;
        if (np.n == 1)
            kvr_utf8_second_range(np.bytes[0], &lo2, &hi2);
        if (b < lo2 || b > hi2)
            return KVR_EINVAL;
        np.bytes[np.n++] = b;
        uint32_t lo, hi;
        partial_range(&np, &lo, &hi);
        if (np.n < np.need) {
            if (!kvr_gstacks_may_take(g, st, lo, hi))
                return KVR_EINVAL;
            *dpart = np;
            return KVR_OK;
        }
        cp = lo;
    }
    int rc = kvr_gstacks_advance(g, st, cp, dst);
    if (rc)
        return rc;
    if (!dst->n)
        return KVR_EINVAL;
    *dpart = (struct gpartial){0};
    *stacks_changed = true;
    return KVR_OK;
}

/* ---- the matcher ---------------------------------------------------------------------------- */

int kvr_grammar_match_create(struct kvr_grammar_match **out, const struct kvr_grammar *g)
{
    struct kvr_grammar_match *m = kvr_calloc(1, sizeof *m);
    *out = NULL;
    if (!m)
        return KVR_ENOMEM;
    m->g = g;
    if (kvr_gstacks_start(g, &m->st)) {
        kvr_grammar_match_destroy(m);
        return KVR_ENOMEM;
    }
    *out = m;
    return KVR_OK;
}

void kvr_grammar_match_destroy(struct kvr_grammar_match *m)
{
    if (!m)
        return;
    kvr_gstacks_fini(&m->st);
    kvr_gstacks_fini(&m->tmp);
    kvr_gstacks_fini(&m->tmp2);
    for (uint32_t i = 0; i < KVR_GRAMMAR_CACHE; i++) {
        kvr_free(m->cache[i].key);
        kvr_free(m->cache[i].bits);
    }
    kvr_free(m->key);
    kvr_free(m->apply_bits);
    kvr_gtop_free(m);
    for (uint32_t i = 0; i < m->n_lvl; i++)
        kvr_gstacks_fini(&m->lvl[i]);
    kvr_free(m->lvl);
    kvr_free(m->lpart);
    kvr_free(m->lcur);
    kvr_free(m->node_at);
    kvr_free(m);
}

void kvr_grammar_match_reset(struct kvr_grammar_match *m)
{
    m->part = (struct gpartial){0};
    if (kvr_gstacks_start(m->g, &m->st))
        kvr_gstacks_clear(&m->st); /* out of memory: nothing matches, and it says so */
}

int kvr_grammar_match_copy(struct kvr_grammar_match *dst, const struct kvr_grammar_match *src)
{
    if (kvr_gstacks_copy(&dst->st, &src->st))
        return KVR_ENOMEM;
    dst->part = src->part;
    return KVR_OK;
}

int kvr_grammar_match_bytes(struct kvr_grammar_match *m, const void *bytes, size_t n)
{
    const uint8_t *p = bytes;
    const struct gstacks *cur = &m->st;
    struct gpartial part = m->part;
    for (size_t i = 0; i < n; i++) {
        struct gstacks *out = cur == &m->tmp ? &m->tmp2 : &m->tmp;
        bool changed;
        int rc = kvr_gmatch_byte(m->g, cur, &part, p[i], out, &part, &changed);
        if (rc)
            return rc;
        if (changed)
            cur = out;
    }
    if (cur != &m->st) { /* swap the winner in */
        struct gstacks t = m->st;
        m->st = *cur;
        *(cur == &m->tmp ? &m->tmp : &m->tmp2) = t;
    }
    m->part = part;
    return KVR_OK;
}

int kvr_grammar_match_cp(struct kvr_grammar_match *m, uint32_t cp)
{
    char b[4];
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return KVR_EINVAL;
    return kvr_grammar_match_bytes(m, b, kvr_utf8_encode(cp, b));
}

bool kvr_grammar_match_complete(const struct kvr_grammar_match *m)
{
    return m->part.n == 0 && kvr_gstacks_has_empty(&m->st);
}

uint32_t kvr_grammar_match_n_stacks(const struct kvr_grammar_match *m)
{
    return m->st.n;
}

void kvr_grammar_match_stats(const struct kvr_grammar_match *m, struct kvr_grammar_stats *st)
{
    *st = m->stats;
}
