/* grammar_top.c - masks by the top part of each stack: what makes a repeated structure's
 * masks cost a lookup, whatever it is nested in (grammar.h's masks, their fast path).
 *
 * A state's mask is the union of its stacks' masks (a set advances stack by stack). A
 * stack [b, t1 .. tk] matches a token's bytes with its top part t1 .. tk alone until that
 * part has ended; only then does the bottom frame b matter. So a walk of the whole trie
 * from the top part alone, done once per distinct top part and remembered, gives every
 * token that ends inside it and lists the trie nodes where the part has ended (its pops);
 * below each of those, the rest is walked from what b expands to. A JSON array with
 * minItems 100 compiles to 100 references in one rule: the same top parts come under 100
 * bottom frames, so the first item's walks serve the others, and the subtrees below the
 * pops (tokens such as `},` and `}]`) are small.
 *
 * XGrammar splits at every frame and adds a lookahead to decide the tokens that cross a
 * frame's end; one split above the bottom frame needs neither and stays exact.
 *
 * A stack of one frame has no top part: those stacks take one plain walk together. A top
 * part that ends under many nodes (more than MAX_POPS) would cost a plain walk anyway: the
 * state is then left to the plain walk, as is a half-read character. Exact: the mask
 * equals the plain walk's (tests/unit/test_grammar_top.c), except where a limit
 * (KVR_GRAMMAR_MAX_STACKS, the expansion work) drops stacks; a walk here that reaches one
 * gives the state to the plain walk, whose limits then decide. */
#include "model/grammar_int.h"

#include "core/alloc.h"

#include <string.h>

#define MAX_POPS 2048u

void kvr_gtop_free(struct kvr_grammar_match *m)
{
    for (uint32_t i = 0; m->top && i < KVR_GRAMMAR_TOP_CACHE; i++) {
        kvr_free(m->top[i].key);
        kvr_free(m->top[i].bits);
        kvr_free(m->top[i].pops.node);
    }
    kvr_free(m->top);
    m->top = NULL;
    m->n_top_words = 0;
    kvr_gstacks_fini(&m->one);
}

void kvr_grammar_match_set_plain(struct kvr_grammar_match *m, bool plain)
{
    m->plain = plain;
}

static uint64_t hash_key(const uint32_t *f, uint32_t n)
{
    uint64_t h = 0xcbf29ce484222325ull ^ n;
    for (uint32_t i = 0; i < n; i++)
        h = (h ^ f[i]) * 0x100000001b3ull;
    return h;
}

/* Walk the trie from the top part f[0..n) alone into entry e. 1 done, 0 a limit was
 * reached, KVR_ENOMEM. */
static int walk_top(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v,
                    struct gtop_entry *e, const uint32_t *f, uint32_t n, uint64_t h)
{
    uint32_t *k = kvr_realloc(e->key, n * sizeof *k);
    if (!k)
        return KVR_ENOMEM;
    e->key = k;
    if (!e->bits && !(e->bits = kvr_malloc(m->n_top_words * sizeof *e->bits)))
        return KVR_ENOMEM;
    memset(e->bits, 0, m->n_top_words * sizeof *e->bits);
    e->pops.n = 0;
    kvr_gstacks_clear(&m->one);
    const struct gpartial none = {0};
    m->walk_overflow = false;
    int rc = kvr_gstacks_add_from(m->g, f, n, &m->one);
    if (!rc)
        rc = kvr_gwalk(m, v, 0, &m->one, &none, 1, e->bits, &e->pops);
    if (rc)
        return rc;
    if (m->walk_overflow || m->one.overflow)
        return 0;
    memcpy(e->key, f, n * sizeof *f);
    e->n_key = n;
    e->key_hash = h;
    e->used = ++m->clock;
    m->stats.n_top_walks++;
    return 1;
}

/* The entry of top part f[0..n): remembered, or walked into the least recently used slot.
 * 1 (*out set), 0 a limit was reached, KVR_ENOMEM. */
static int top_entry(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v,
                     const uint32_t *f, uint32_t n, struct gtop_entry **out)
{
    uint64_t h = hash_key(f, n);
    struct gtop_entry *victim = &m->top[0];
    for (uint32_t i = 0; i < KVR_GRAMMAR_TOP_CACHE; i++) {
        struct gtop_entry *e = &m->top[i];
        if (e->used && e->key_hash == h && e->n_key == n && !memcmp(e->key, f, n * sizeof *f)) {
            e->used = ++m->clock;
            m->stats.n_top_cached++;
            *out = e;
            return 1;
        }
        if (e->used < victim->used)
            victim = e;
    }
    victim->used = 0; /* not valid until walked */
    *out = victim;
    return walk_top(m, v, victim, f, n, h);
}

/* Add the mask of stack f[0..n) (n >= 2): its top part's, then below each pop the rest
 * from what the bottom frame expands to. 1, 0 (leave it to the plain walk), KVR_ENOMEM. */
static int stack_mask(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v,
                      const uint32_t *f, uint32_t n, uint32_t *bits)
{
    struct gtop_entry *e;
    int rc = top_entry(m, v, f + 1, n - 1, &e);
    if (rc <= 0)
        return rc;
    if (e->pops.n > MAX_POPS)
        return 0;
    for (uint32_t w = 0; w < m->n_top_words; w++)
        bits[w] |= e->bits[w];
    if (!e->pops.n)
        return 1;
    kvr_gstacks_clear(&m->one);
    if ((rc = kvr_gstacks_add_from(m->g, f, 1, &m->one)))
        return rc;
    const struct gpartial none = {0};
    for (uint32_t i = 0; i < e->pops.n && !rc; i++)
        rc = kvr_gwalk(m, v, e->pops.node[i], &m->one, &none, 0, bits, NULL);
    if (rc)
        return rc;
    return m->walk_overflow || m->one.overflow ? 0 : 1;
}

int kvr_gtop_mask(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v, uint32_t *bits)
{
    if (m->part.n)
        return 0;
    uint32_t words = ((uint32_t)kvr_grammar_vocab_n(v) + 31) / 32;
    if (m->n_top_words != words) {
        kvr_gtop_free(m);
        if (!(m->top = kvr_calloc(KVR_GRAMMAR_TOP_CACHE, sizeof *m->top)))
            return KVR_ENOMEM;
        m->n_top_words = words;
    }
    const struct gstacks *st = &m->st;
    /* stacks of one frame: one plain walk together, as the whole state would take them */
    kvr_gstacks_clear(&m->one);
    int rc = KVR_OK;
    for (uint32_t i = 0; i < st->n && !rc; i++)
        if (st->len[i] == 1)
            rc = kvr_gstacks_add_from(m->g, st->data + st->off[i], 1, &m->one);
    if (rc)
        return rc;
    m->walk_overflow = false;
    if (m->one.n) {
        const struct gpartial none = {0};
        if ((rc = kvr_gwalk(m, v, 0, &m->one, &none, 0, bits, NULL)))
            return rc;
        if (m->walk_overflow || m->one.overflow)
            return 0;
    }
    for (uint32_t i = 0; i < st->n; i++) {
        if (st->len[i] < 2)
            continue;
        if ((rc = stack_mask(m, v, st->data + st->off[i], st->len[i], bits)) <= 0)
            return rc;
    }
    return 1;
}
