/* grammar_int.h - what grammar_parse.c (the compiler), grammar.c (the matcher) and
 * grammar_mask.c (vocabulary trie and masks) share. Not part of the API (grammar.h).
 *
 * Compiled form: every rule's alternatives laid out in one element array,
 *     el[rule_start[r] ..]:  alt 0 elements, ALT, alt 1 elements, ..., END
 * with alt_first[rule_alt[r] .. rule_alt[r + 1]) the index of each alternative's first
 * element. An element is a character class (CHAR, value = class index), a rule reference
 * (REF, value = rule id), or a separator (ALT, END). A class holds sorted code-point ranges
 * and, for speed, the bitmap of the ASCII characters it accepts (negation applied). */
#ifndef KVR_MODEL_GRAMMAR_INT_H
#define KVR_MODEL_GRAMMAR_INT_H

#include "model/grammar.h"

#include <stdbool.h>
#include <stdint.h>

enum gel_type { GEL_END = 0, GEL_ALT = 1, GEL_REF = 2, GEL_CHAR = 3, GEL_TYPE_COUNT = 4 };

struct gel {
    uint32_t type; /* enum gel_type */
    uint32_t value;
};

struct gclass {
    uint64_t ascii[2]; /* bit c: code point c < 128 is accepted */
    uint32_t first;    /* ranges lo[first .. first + n), hi[...], inclusive */
    uint32_t n;
    bool negated;
};

struct kvr_grammar {
    uint32_t n_el;
    struct gel *el;
    uint32_t n_rules;
    uint32_t *rule_start; /* [n_rules] */
    uint32_t *rule_alt;   /* [n_rules + 1] into alt_first */
    uint32_t *alt_first;  /* [rule_alt[n_rules]] */
    uint32_t n_class;
    struct gclass *cls;
    uint32_t n_range;
    uint32_t *lo, *hi;
    uint32_t root;
};

static inline bool kvr_gclass_has(const struct kvr_grammar *g, uint32_t c, uint32_t cp)
{
    const struct gclass *k = &g->cls[c];
    if (cp < 128)
        return (k->ascii[cp >> 6] >> (cp & 63)) & 1;
    bool in = false;
    for (uint32_t i = k->first; i < k->first + k->n && !in; i++)
        in = cp >= g->lo[i] && cp <= g->hi[i];
    return in != k->negated;
}

/* Whether the class accepts any code point in [lo, hi]. */
bool kvr_gclass_any(const struct kvr_grammar *g, uint32_t c, uint32_t lo, uint32_t hi);

/* A set of stacks: stack i is data[off[i] .. off[i] + len[i]) (frame positions, bottom
 * first), hash[i] its hash. Growable; a matcher and the mask walk each own some. */
struct gstacks {
    uint32_t *data;
    uint32_t *off, *len;
    uint64_t *hash;
    uint32_t n, cap; /* stacks */
    size_t n_data, cap_data;
    bool overflow; /* a limit dropped a stack */
    /* Frames that lie below every stack of the set but are not in it (the mask walk of a
     * stack's top part, grammar_top.c): expansion refuses depth past KVR_GRAMMAR_MAX_DEPTH
     * counting them, as it would with them there. Kept across clears. */
    uint32_t depth_base;
    /* Past a few stacks, duplicates are found by hash: slot (hash & mask) holds index + 1
     * of a stack when its stamp is the set's current one (clearing bumps the stamp). */
    uint32_t *slot_idx, *slot_stamp; /* [KVR_GRAMMAR_MAX_STACKS * 2], allocated on need */
    uint32_t stamp;
};

void kvr_gstacks_fini(struct gstacks *s);
void kvr_gstacks_clear(struct gstacks *s);
int kvr_gstacks_copy(struct gstacks *dst, const struct gstacks *src);
/* The stacks of `src` that accept code point cp, advanced past it and expanded, into
 * `dst` (cleared first). Returns KVR_OK or KVR_ENOMEM. */
int kvr_gstacks_advance(const struct kvr_grammar *g, const struct gstacks *src, uint32_t cp,
                        struct gstacks *dst);
/* Add to dst the stacks that frames[0..n) (bottom first) expands to: a top that ends its
 * frame pops, a reference enters its rule. KVR_OK, KVR_ENOMEM, KVR_EINVAL (n too deep). */
int kvr_gstacks_add_from(const struct kvr_grammar *g, const uint32_t *frames, uint32_t n,
                         struct gstacks *dst);
/* The start state: root's alternatives, expanded. */
int kvr_gstacks_start(const struct kvr_grammar *g, struct gstacks *dst);
/* Whether any stack's next class could accept a character in [lo, hi] (a character whose
 * first bytes are known). */
bool kvr_gstacks_may_take(const struct kvr_grammar *g, const struct gstacks *s, uint32_t lo,
                          uint32_t hi);
bool kvr_gstacks_has_empty(const struct gstacks *s);

/* A matcher: its stacks, a character half-read, and the mask cache (grammar_mask.c). */
struct gpartial {
    uint8_t bytes[4];
    uint8_t n, need; /* n bytes of a character of `need` bytes; n == 0: none pending */
};

struct gcache_entry {
    uint64_t key_hash;
    uint32_t *key; /* the state serialised (kvr_gmatch_key) */
    size_t n_key;
    uint32_t *bits;
    int32_t n_allowed;
    uint64_t used; /* last use, for eviction */
};

/* Trie nodes (grammar_mask.c's walk lists where a stack ran empty). */
struct gpops {
    uint32_t *node;
    uint32_t n, cap;
};

/* What the top part of a stack (every frame but the bottom one) allows on its own, whatever
 * lies below (grammar_top.c): the tokens it takes, and the trie nodes where it has ended,
 * below which the bottom frame decides. */
struct gtop_entry {
    uint64_t key_hash;
    uint32_t *key; /* the top part's frames */
    uint32_t n_key;
    uint32_t *bits;
    struct gpops pops;
    uint64_t used; /* last use, for eviction; 0: empty */
};

struct kvr_grammar_match {
    const struct kvr_grammar *g;
    struct gstacks st, tmp, tmp2; /* the state; scratch for advancing */
    struct gpartial part;
    struct gcache_entry cache[KVR_GRAMMAR_CACHE];
    uint32_t n_cache_words; /* words per cached mask (0 until the first mask) */
    uint64_t clock;
    struct kvr_grammar_stats stats;
    uint32_t *key; /* scratch for the key of the current state */
    size_t cap_key;
    uint32_t *apply_bits; /* kvr_grammar_apply's mask, sized on first use */
    uint32_t n_apply_words;
    /* the mask walk's state per trie depth (grammar_mask.c), sized on first use */
    struct gstacks *lvl;
    struct gpartial *lpart;
    const struct gstacks **lcur;
    uint32_t *node_at; /* the trie node tried at each depth */
    uint32_t n_lvl;
    bool walk_overflow; /* a walk's level dropped a stack (a limit) */
    /* masks by top part (grammar_top.c), allocated on first use */
    bool plain; /* never use them: every mask walks the whole trie (tests compare) */
    struct gtop_entry *top;
    uint32_t n_top_words;
    struct gstacks one; /* scratch: a stack's top part, or what its bottom frame expands to */
};

/* Walk the trie below `node` from (st, part) and set the bits of the tokens it allows
 * (grammar_mask.c). pops may be NULL. KVR_OK or KVR_ENOMEM. */
int kvr_gwalk(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v, uint32_t node,
              const struct gstacks *st, const struct gpartial *part, uint32_t depth_base,
              uint32_t *bits, struct gpops *pops);
/* The matcher's mask by the top parts of its stacks (grammar_top.c), into bits (zeroed):
 * 1 done, 0 this state needs the plain walk (bits then undefined), KVR_ENOMEM. */
int kvr_gtop_mask(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v, uint32_t *bits);
void kvr_gtop_free(struct kvr_grammar_match *m);
/* Tests: plain (true) makes every mask walk the whole trie, as before the top-part masks. */
void kvr_grammar_match_set_plain(struct kvr_grammar_match *m, bool plain);

/* Feed one byte to (stacks, partial) into (dst stacks, dst partial): KVR_OK, KVR_EINVAL
 * (refused), KVR_ENOMEM. dst may equal src for the partial only. */
int kvr_gmatch_byte(const struct kvr_grammar *g, const struct gstacks *st,
                    const struct gpartial *part, uint8_t b, struct gstacks *dst,
                    struct gpartial *dpart, bool *stacks_changed);

#endif
