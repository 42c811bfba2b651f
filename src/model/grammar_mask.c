/* grammar_mask.c - masks over a vocabulary (grammar.h): the token trie, the walk that
 * finds every token the grammar allows, and each matcher's cache of masks by state.
 *
 * Trie: nodes in depth-first order of the tokens' bytes sorted, so a node's first child is
 * the next node; siblings are linked in byte order. Each node lists the tokens whose bytes
 * end there (several tokens may decode to the same bytes). The walk keeps one matcher
 * state per depth: a byte the grammar refuses skips its whole subtree, and a byte inside a
 * multi-byte character only narrows the partial character (the stacks are shared with the
 * level above, not copied). */
#include "model/grammar_int.h"

#include "core/alloc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct tnode {
    uint32_t first_child, next_sibling; /* 0: none (the root is node 0, never a child) */
    uint32_t tok_first, tok_n;          /* ids[tok_first .. + tok_n) end here */
    uint8_t byte;
};

struct kvr_grammar_vocab {
    int32_t n_vocab;
    uint32_t n_nodes, max_depth;
    struct tnode *nodes;
    int32_t *ids;     /* token ids in trie order */
    uint8_t *blob;    /* every token's bytes */
    size_t *off;      /* [n_vocab + 1] token i is blob[off[i] .. off[i + 1]) */
    bool *eog;        /* [n_vocab] */
    int32_t *eog_ids; /* the end-of-generation tokens */
    uint32_t n_eog;
};

/* ---- the trie ---------------------------------------------------------------------------- */

struct tref {
    const uint8_t *p;
    size_t n;
    int32_t id;
};

static int cmp_tref(const void *a, const void *b)
{
    const struct tref *x = a, *y = b;
    size_t n = x->n < y->n ? x->n : y->n;
    int c = memcmp(x->p, y->p, n);
    if (c)
        return c;
    if (x->n != y->n)
        return x->n < y->n ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* Insert the sorted tokens: each shares a prefix with the one before, so only the path
 * below that prefix is new. */
static int build_trie(struct kvr_grammar_vocab *v, const struct tref *t, uint32_t n)
{
    size_t total = 1;
    for (uint32_t i = 0; i < n; i++)
        total += t[i].n;
    if (total > UINT32_MAX || !(v->nodes = kvr_calloc(total, sizeof *v->nodes)))
        return KVR_ENOMEM;
    uint32_t *path = kvr_calloc(v->max_depth + 1, sizeof *path); /* path[d]: depth d's node */
    if (!path)
        return KVR_ENOMEM;
    v->n_nodes = 1;
    const struct tref *prev = NULL;
    for (uint32_t i = 0; i < n; i++) {
        size_t lcp = 0;
        while (prev && lcp < prev->n && lcp < t[i].n && prev->p[lcp] == t[i].p[lcp])
            lcp++;
        for (size_t d = lcp; d < t[i].n; d++) {
            uint32_t node = v->n_nodes++;
            v->nodes[node].byte = t[i].p[d];
            /* in sorted order, the parent's last child so far is the previous token's node
             * one below the shared prefix */
            if (d == lcp && prev && prev->n > lcp)
                v->nodes[path[d + 1]].next_sibling = node;
            else
                v->nodes[path[d]].first_child = node;
            path[d + 1] = node;
        }
        uint32_t end = path[t[i].n];
        if (!v->nodes[end].tok_n)
            v->nodes[end].tok_first = i;
        v->nodes[end].tok_n++;
        v->ids[i] = t[i].id;
        prev = &t[i];
    }
    kvr_free(path);
    return KVR_OK;
}

int kvr_grammar_vocab_create_bytes(struct kvr_grammar_vocab **out, int32_t n_vocab,
                                   const char *const *bytes, const size_t *lens, const bool *eog,
                                   struct kvr_err *err)
{
    *out = NULL;
    if (n_vocab < 1)
        return kvr_err_set(err, KVR_EINVAL, "grammar vocab: %d tokens", n_vocab);
    struct kvr_grammar_vocab *v = kvr_calloc(1, sizeof *v);
    struct tref *t = kvr_calloc((size_t)n_vocab, sizeof *t);
    size_t total = 0;
    for (int32_t i = 0; i < n_vocab; i++)
        total += lens[i];
    if (!v || !t || !(v->off = kvr_calloc((size_t)n_vocab + 1, sizeof *v->off)) ||
        !(v->blob = kvr_malloc(total ? total : 1)) ||
        !(v->eog = kvr_calloc((size_t)n_vocab, sizeof *v->eog)) ||
        !(v->eog_ids = kvr_calloc((size_t)n_vocab, sizeof *v->eog_ids)) ||
        !(v->ids = kvr_calloc((size_t)n_vocab, sizeof *v->ids)))
        goto nomem;
    v->n_vocab = n_vocab;
    uint32_t n = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        memcpy(v->blob + v->off[i], bytes[i], lens[i]);
        v->off[i + 1] = v->off[i] + lens[i];
        v->eog[i] = eog && eog[i];
        if (v->eog[i])
            v->eog_ids[v->n_eog++] = i;
        else if (lens[i]) /* a token of no bytes can never advance a grammar */
            t[n++] = (struct tref){v->blob + v->off[i], lens[i], i};
        if (lens[i] > v->max_depth)
            v->max_depth = (uint32_t)lens[i];
    }
    qsort(t, n, sizeof *t, cmp_tref);
    if (build_trie(v, t, n))
        goto nomem;
    kvr_free(t);
    *out = v;
    return KVR_OK;
nomem:
    kvr_free(t);
    kvr_grammar_vocab_destroy(v);
    return kvr_err_set(err, KVR_ENOMEM, "grammar vocab: out of memory");
}

int kvr_grammar_vocab_create(struct kvr_grammar_vocab **out, const struct kvr_tok *tok,
                             struct kvr_err *err)
{
    int32_t n = kvr_tok_n_vocab(tok);
    const char **bytes = kvr_calloc((size_t)n, sizeof *bytes);
    size_t *lens = kvr_calloc((size_t)n, sizeof *lens);
    bool *eog = kvr_calloc((size_t)n, sizeof *eog);
    int rc = KVR_ENOMEM;
    if (bytes && lens && eog) {
        for (int32_t i = 0; i < n; i++) {
            if (kvr_tok_decode_piece(tok, i, false, &bytes[i], &lens[i]))
                lens[i] = 0, bytes[i] = "";
            eog[i] = kvr_tok_is_eog(tok, i);
        }
        rc = kvr_grammar_vocab_create_bytes(out, n, bytes, lens, eog, err);
    } else {
        kvr_err_set(err, rc, "grammar vocab: out of memory");
    }
    kvr_free(bytes);
    kvr_free(lens);
    kvr_free(eog);
    return rc;
}

void kvr_grammar_vocab_destroy(struct kvr_grammar_vocab *v)
{
    if (!v)
        return;
    kvr_free(v->nodes);
    kvr_free(v->ids);
    kvr_free(v->blob);
    kvr_free(v->off);
    kvr_free(v->eog);
    kvr_free(v->eog_ids);
    kvr_free(v);
}

int32_t kvr_grammar_vocab_n(const struct kvr_grammar_vocab *v)
{
    return v->n_vocab;
}

/* ---- the walk -------------------------------------------------------------------------------- */

static int ensure_levels(struct kvr_grammar_match *m, uint32_t n)
{
    if (m->n_lvl >= n)
        return KVR_OK;
    struct gstacks *l = kvr_realloc(m->lvl, n * sizeof *l);
    if (!l)
        return KVR_ENOMEM;
    m->lvl = l;
    memset(l + m->n_lvl, 0, (n - m->n_lvl) * sizeof *l);
    struct gpartial *p = kvr_realloc(m->lpart, n * sizeof *p);
    if (p)
        m->lpart = p;
    const struct gstacks **c = p ? kvr_realloc(m->lcur, n * sizeof *c) : NULL;
    if (c)
        m->lcur = c;
    uint32_t *at = c ? kvr_realloc(m->node_at, n * sizeof *at) : NULL;
    if (!at)
        return KVR_ENOMEM; /* lvl's new entries are zeroed: destroy frees them fine */
    m->node_at = at;
    m->n_lvl = n;
    return KVR_OK;
}

static int gpops_push(struct gpops *p, uint32_t node)
{
    if (p->n == p->cap) {
        uint32_t c = p->cap ? p->cap * 2 : 16;
        uint32_t *n = kvr_realloc(p->node, c * sizeof *n);
        if (!n)
            return KVR_ENOMEM;
        p->node = n;
        p->cap = c;
    }
    p->node[p->n++] = node;
    return KVR_OK;
}

static void allow_node(const struct kvr_grammar_vocab *v, const struct tnode *nd, uint32_t *bits)
{
    for (uint32_t k = 0; k < nd->tok_n; k++) {
        int32_t id = v->ids[nd->tok_first + k];
        bits[id >> 5] |= 1u << (id & 31);
    }
}

/* Depth-first over the subtree below trie node `node`, from the state (st, part) after the
 * node's bytes; level d holds the state after the first d bytes below it. Sets the bit of
 * every token that ends at a node the grammar lets through. With `pops`, also lists every
 * node where a stack has just run empty (grammar_top.c continues there with the frames
 * below). `depth_base`: as struct gstacks says. */
int kvr_gwalk(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v, uint32_t node,
              const struct gstacks *st, const struct gpartial *part, uint32_t depth_base,
              uint32_t *bits, struct gpops *pops)
{
    if (ensure_levels(m, v->max_depth + 2))
        return KVR_ENOMEM;
    for (uint32_t d = 1; d < v->max_depth + 2; d++)
        m->lvl[d].depth_base = depth_base;
    uint32_t *node_at = m->node_at;
    m->lcur[0] = st;
    m->lpart[0] = *part;
    uint32_t d = 0; /* the path's depth; node_at[d + 1] is the child being tried */
    node_at[1] = v->nodes[node].first_child;
    int rc = KVR_OK;
    while (!rc) {
        uint32_t c = node_at[d + 1];
        if (!c) { /* level d is done: back up to the parent's next sibling */
            if (d == 0)
                break;
            node_at[d] = v->nodes[node_at[d]].next_sibling;
            d--;
            continue;
        }
        const struct tnode *nd = &v->nodes[c];
        bool changed;
        int r = kvr_gmatch_byte(m->g, m->lcur[d], &m->lpart[d], nd->byte, &m->lvl[d + 1],
                                &m->lpart[d + 1], &changed);
        if (r == KVR_EINVAL) {
            node_at[d + 1] = nd->next_sibling;
            continue;
        }
        if (r) {
            rc = r;
            break;
        }
        if (changed) {
            m->walk_overflow |= m->lvl[d + 1].overflow;
            if (pops && kvr_gstacks_has_empty(&m->lvl[d + 1]) && (rc = gpops_push(pops, c)))
                break;
        }
        m->lcur[d + 1] = changed ? &m->lvl[d + 1] : m->lcur[d];
        allow_node(v, nd, bits);
        d++;
        node_at[d + 1] = nd->first_child;
    }
    for (uint32_t k = 1; k < v->max_depth + 2; k++)
        m->lvl[k].depth_base = 0;
    return rc;
}

/* ---- the cache ------------------------------------------------------------------------------- */

/* The state as words: the partial character, then each stack's length and frames. */
static int make_key(struct kvr_grammar_match *m, size_t *n_out, uint64_t *hash)
{
    size_t n = 2 + m->st.n + m->st.n_data;
    if (n > m->cap_key) {
        uint32_t *k = kvr_realloc(m->key, n * sizeof *k);
        if (!k)
            return KVR_ENOMEM;
        m->key = k;
        m->cap_key = n;
    }
    uint32_t *k = m->key;
    size_t at = 0;
    k[at++] = (uint32_t)m->part.n | (uint32_t)m->part.need << 8;
    k[at++] = (uint32_t)m->part.bytes[0] | (uint32_t)m->part.bytes[1] << 8 |
              (uint32_t)m->part.bytes[2] << 16 | (uint32_t)m->part.bytes[3] << 24;
    for (uint32_t i = 0; i < m->st.n; i++) {
        k[at++] = m->st.len[i];
        if (m->st.len[i])
            memcpy(k + at, m->st.data + m->st.off[i], m->st.len[i] * sizeof *k);
        at += m->st.len[i];
    }
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < at; i++)
        h = (h ^ k[i]) * 0x100000001b3ull;
    *n_out = at;
    *hash = h;
    return KVR_OK;
}

static int32_t count_bits(const uint32_t *bits, uint32_t n_words)
{
    int32_t n = 0;
    for (uint32_t i = 0; i < n_words; i++)
        n += __builtin_popcount(bits[i]);
    return n;
}

/* The current state's mask: a cache entry's (*out points at it), or computed into bits
 * (*out == bits) and remembered. Returns the number of allowed tokens, or KVR_ENOMEM. */
static int32_t mask_of(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v,
                       uint32_t *bits, const uint32_t **out)
{
    uint32_t words = ((uint32_t)v->n_vocab + 31) / 32;
    size_t n_key;
    uint64_t h;
    if (make_key(m, &n_key, &h))
        return KVR_ENOMEM;
    m->stats.n_masks++;
    m->clock++;
    struct gcache_entry *victim = &m->cache[0];
    for (uint32_t i = 0; i < KVR_GRAMMAR_CACHE; i++) {
        struct gcache_entry *e = &m->cache[i];
        if (e->bits && m->n_cache_words == words && e->key_hash == h && e->n_key == n_key &&
            !memcmp(e->key, m->key, n_key * sizeof *m->key)) {
            *out = e->bits;
            e->used = m->clock;
            m->stats.n_cached++;
            return e->n_allowed;
        }
        if (e->used < victim->used)
            victim = e;
    }
    *out = bits;
    memset(bits, 0, words * sizeof *bits);
    int fast = m->plain ? 0 : kvr_gtop_mask(m, v, bits);
    if (fast < 0)
        return KVR_ENOMEM;
    if (!fast) { /* the whole trie from the whole state */
        m->stats.n_plain++;
        memset(bits, 0, words * sizeof *bits);
        if (kvr_gwalk(m, v, 0, &m->st, &m->part, 0, bits, NULL))
            return KVR_ENOMEM;
    }
    int32_t n_allowed = count_bits(bits, words);
    if (kvr_grammar_match_complete(m) || !n_allowed) {
        for (uint32_t k = 0; k < v->n_eog; k++)
            bits[v->eog_ids[k] >> 5] |= 1u << (v->eog_ids[k] & 31);
        n_allowed = count_bits(bits, words);
    }
    /* remember it; a failed allocation only loses the cache entry */
    if (m->n_cache_words != words) {
        for (uint32_t i = 0; i < KVR_GRAMMAR_CACHE; i++) {
            kvr_free(m->cache[i].bits);
            kvr_free(m->cache[i].key);
            m->cache[i] = (struct gcache_entry){0};
        }
        m->n_cache_words = words;
    }
    uint32_t *kb = kvr_realloc(victim->key, (n_key ? n_key : 1) * sizeof *kb);
    if (kb)
        victim->key = kb;
    if (!victim->bits)
        victim->bits = kvr_malloc(words * sizeof *bits);
    if (kb && victim->bits) {
        memcpy(victim->key, m->key, n_key * sizeof *kb);
        memcpy(victim->bits, bits, words * sizeof *bits);
        victim->n_key = n_key;
        victim->key_hash = h;
        victim->n_allowed = n_allowed;
        victim->used = m->clock;
    }
    return n_allowed;
}

int32_t kvr_grammar_mask(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v,
                         uint32_t *bits)
{
    const uint32_t *p;
    int32_t n = mask_of(m, v, bits, &p);
    if (n >= 0 && p != bits)
        memcpy(bits, p, (((uint32_t)v->n_vocab + 31) / 32) * sizeof *bits);
    return n;
}

int32_t kvr_grammar_apply(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v,
                          float *logits, int32_t n_vocab)
{
    uint32_t words = ((uint32_t)v->n_vocab + 31) / 32;
    if (m->n_apply_words != words) { /* once per matcher: no allocation per token */
        kvr_free(m->apply_bits);
        m->n_apply_words = 0;
        if (!(m->apply_bits = kvr_malloc(words * sizeof *m->apply_bits)))
            return KVR_ENOMEM;
        m->n_apply_words = words;
    }
    const uint32_t *bits;
    int32_t n = mask_of(m, v, m->apply_bits, &bits);
    if (n < 0)
        return n;
    /* a word at a time: the refused tokens of a mostly open mask are few */
    int32_t lim = n_vocab < v->n_vocab ? n_vocab : v->n_vocab;
    for (int32_t w = 0; w * 32 < lim; w++) {
        uint32_t z = ~bits[w];
        while (z) {
            int32_t i = w * 32 + __builtin_ctz(z);
            if (i >= lim)
                break;
            logits[i] = -INFINITY;
            z &= z - 1;
        }
    }
    for (int32_t i = lim; i < n_vocab; i++)
        logits[i] = -INFINITY;
    return n;
}

int kvr_grammar_accept_token(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v,
                             int32_t id)
{
    if (id < 0 || id >= v->n_vocab)
        return KVR_EINVAL;
    if (v->eog[id])
        return kvr_grammar_match_complete(m) ? KVR_OK : KVR_EINVAL;
    size_t n = v->off[id + 1] - v->off[id];
    if (!n)
        return KVR_EINVAL;
    return kvr_grammar_match_bytes(m, v->blob + v->off[id], n);
}
