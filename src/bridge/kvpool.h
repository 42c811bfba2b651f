/* kvpool.h - the bridge's KV block pool and prefix cache (DESIGN.md 12).
 *
 * struct kvr_kv_pool: which block ids are free, which hold a named full block of some
 * earlier sequence (the prefix cache), and how many sequences use each. Every stage has
 * the same blocks, and the bridge names each one a sequence uses (MAP records), so this
 * pool is the layout of every stage's cache. A full block is named by kvr_kv_block_hash:
 * a hash of its tokens and of the name of the block before it. The first block's
 * "before" is a seed made of the model and the plan, so a name stands for the whole
 * prefix up to the block's end. Named blocks nobody uses stay cached and are evicted least
 * recently used when an allocation needs room.
 *
 * Pure bookkeeping, no KV memory. The pool owns its arrays (kvr_kv_pool_init allocates
 * them all, kvr_kv_pool_fini frees them). One thread uses it: the scheduler's caller. */
#ifndef KVR_BRIDGE_KVPOOL_H
#define KVR_BRIDGE_KVPOOL_H

#include "core/err.h"

#include <stdbool.h>
#include <stdint.h>

/* The name of a full block: its tokens after the name of the block before it (`prev`; for
 * the first block, the seed). */
uint64_t kvr_kv_block_hash(uint64_t prev, const int32_t *tokens, uint32_t block_tokens);

enum kvr_kv_block_state {
    KVR_KV_BLOCK_FREE,   /* unnamed, unused: on the free stack */
    KVR_KV_BLOCK_CACHED, /* named, unused: on the LRU list, evictable */
    KVR_KV_BLOCK_USED,   /* used by refs[] > 0 sequences (named or not) */
    KVR_KV_BLOCK_STATE_COUNT
};

struct kvr_kv_pool {
    uint32_t n_blocks, block_tokens;
    uint8_t *state;                /* [n_blocks] enum kvr_kv_block_state */
    uint32_t *refs;                /* [n_blocks] sequences using the block */
    bool *named;                   /* [n_blocks] in the name index */
    uint64_t *name;                /* [n_blocks] kvr_kv_block_hash, if named */
    uint64_t *prev;                /* [n_blocks] the name before it (checked on lookup) */
    int32_t *tokens;               /* [n_blocks][block_tokens] its tokens (checked on lookup) */
    uint32_t *bucket;              /* [n_buckets] first block of each name chain, or UINT32_MAX */
    uint32_t *chain;               /* [n_blocks] next block in the same bucket */
    uint32_t n_buckets;            /* a power of two >= 2 * n_blocks */
    uint32_t *lru_prev, *lru_next; /* [n_blocks] the CACHED list, oldest at lru_head */
    uint32_t lru_head, lru_tail;
    uint32_t *free_ids; /* stack of FREE blocks, n_free valid */
    uint32_t n_free, n_cached, n_used;
    uint64_t n_evicted; /* named blocks evicted to make room, ever */
};

int kvr_kv_pool_init(struct kvr_kv_pool *p, uint32_t n_blocks, uint32_t block_tokens,
                     struct kvr_err *err);
void kvr_kv_pool_fini(struct kvr_kv_pool *p);

/* The longest run of named blocks that starts `tokens` (n_tokens of them; only whole blocks
 * count, at most max_blocks), names chained from `seed`: their ids into out[] (capacity
 * max_blocks). Returns the number of blocks found. Changes nothing. */
uint32_t kvr_kv_pool_lookup(const struct kvr_kv_pool *p, uint64_t seed, const int32_t *tokens,
                            uint32_t n_tokens, uint32_t max_blocks, uint32_t *out);

/* A sequence starts using blocks found by lookup (they leave the LRU list if unused). */
void kvr_kv_pool_acquire(struct kvr_kv_pool *p, const uint32_t *ids, uint32_t n);
/* Take n blocks for a sequence, all or none: free ones first, then the least recently used
 * cached ones (their names are forgotten). KVR_EFULL if fewer than n are free or cached. */
int kvr_kv_pool_alloc(struct kvr_kv_pool *p, uint32_t *out, uint32_t n);
/* Name a used block once its tokens are all written: later lookups find it. A block whose
 * name another block already has stays unnamed (a duplicate, private to its sequence).
 * Returns whether the block was named. */
bool kvr_kv_pool_publish(struct kvr_kv_pool *p, uint32_t id, uint64_t prev, uint64_t name,
                         const int32_t *tokens);
/* A sequence stops using n blocks, released last first, so that a prefix's first block is
 * the most recently used and a chain is evicted from its end. Unused named blocks become
 * cached; unnamed ones free. */
void kvr_kv_pool_release(struct kvr_kv_pool *p, const uint32_t *ids, uint32_t n);
/* Forget every cached block (they become free); blocks in use keep their names. Returns
 * how many were cached. */
uint32_t kvr_kv_pool_flush(struct kvr_kv_pool *p);
/* Forget every name and use: every block is free (the stages lost their KV). */
void kvr_kv_pool_reset(struct kvr_kv_pool *p);
/* Blocks an allocation could take now: free + cached. */
static inline uint32_t kvr_kv_pool_available(const struct kvr_kv_pool *p)
{
    return p->n_free + p->n_cached;
}
/* Check the pool's invariants (tests): counts agree with the states, the lists and the
 * index. KVR_EINVAL with a message naming the first broken one. */
int kvr_kv_pool_check(const struct kvr_kv_pool *p, struct kvr_err *err);

#endif
