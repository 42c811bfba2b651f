/* kvpool.c - the bridge's KV block pool and prefix cache (see kvpool.h). */
#include "bridge/kvpool.h"

#include "core/alloc.h"

#include <string.h>

#define NONE UINT32_MAX

uint64_t kvr_kv_block_hash(uint64_t prev, const int32_t *tokens, uint32_t block_tokens)
{
    /* FNV-1a over the previous name and the token ids (4 bytes each), then a splitmix64
     * finaliser so that nearby inputs spread over the buckets. */
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < 8; i++)
        h = (h ^ ((prev >> (8 * i)) & 0xff)) * 0x100000001b3ull;
    for (uint32_t t = 0; t < block_tokens; t++) {
        uint32_t u = (uint32_t)tokens[t];
        for (int i = 0; i < 4; i++)
            h = (h ^ ((u >> (8 * i)) & 0xff)) * 0x100000001b3ull;
    }
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    return h ^ (h >> 31);
}

int kvr_kv_pool_init(struct kvr_kv_pool *p, uint32_t n_blocks, uint32_t block_tokens,
                     struct kvr_err *err)
{
    memset(p, 0, sizeof *p);
    if (!n_blocks || !block_tokens || n_blocks > (1u << 30))
        return kvr_err_set(err, KVR_EINVAL, "kv pool: %u blocks of %u tokens", n_blocks,
                           block_tokens);
    size_t n_tok;
    if (!kvr_mul_size(n_blocks, block_tokens, &n_tok))
        return kvr_err_set(err, KVR_ENOMEM, "kv pool: size overflows");
    p->n_blocks = n_blocks;
    p->block_tokens = block_tokens;
    p->n_buckets = 1;
    while (p->n_buckets < 2 * n_blocks)
        p->n_buckets <<= 1;
    p->state = kvr_calloc(n_blocks, sizeof *p->state);
    p->refs = kvr_calloc(n_blocks, sizeof *p->refs);
    p->named = kvr_calloc(n_blocks, sizeof *p->named);
    p->name = kvr_calloc(n_blocks, sizeof *p->name);
    p->prev = kvr_calloc(n_blocks, sizeof *p->prev);
    p->tokens = kvr_calloc(n_tok, sizeof *p->tokens);
    p->bucket = kvr_calloc(p->n_buckets, sizeof *p->bucket);
    p->chain = kvr_calloc(n_blocks, sizeof *p->chain);
    p->lru_prev = kvr_calloc(n_blocks, sizeof *p->lru_prev);
    p->lru_next = kvr_calloc(n_blocks, sizeof *p->lru_next);
    p->free_ids = kvr_calloc(n_blocks, sizeof *p->free_ids);
    if (!p->state || !p->refs || !p->named || !p->name || !p->prev || !p->tokens || !p->bucket ||
        !p->chain || !p->lru_prev || !p->lru_next || !p->free_ids) {
        kvr_kv_pool_fini(p);
        return kvr_err_set(err, KVR_ENOMEM, "kv pool: out of memory");
    }
    kvr_kv_pool_reset(p);
    return KVR_OK;
}

void kvr_kv_pool_fini(struct kvr_kv_pool *p)
{
    kvr_free(p->state);
    kvr_free(p->refs);
    kvr_free(p->named);
    kvr_free(p->name);
    kvr_free(p->prev);
    kvr_free(p->tokens);
    kvr_free(p->bucket);
    kvr_free(p->chain);
    kvr_free(p->lru_prev);
    kvr_free(p->lru_next);
    kvr_free(p->free_ids);
    memset(p, 0, sizeof *p);
}

void kvr_kv_pool_reset(struct kvr_kv_pool *p)
{
    for (uint32_t i = 0; i < p->n_buckets; i++)
        p->bucket[i] = NONE;
    for (uint32_t i = 0; i < p->n_blocks; i++) {
        p->state[i] = KVR_KV_BLOCK_FREE;
        p->refs[i] = 0;
        p->named[i] = false;
        p->free_ids[i] = p->n_blocks - 1 - i; /* block 0 is handed out first */
    }
    p->n_free = p->n_blocks;
    p->n_cached = p->n_used = 0;
    p->lru_head = p->lru_tail = NONE;
}

static uint32_t bucket_of(const struct kvr_kv_pool *p, uint64_t name)
{
    return (uint32_t)(name & (p->n_buckets - 1));
}

static void unname(struct kvr_kv_pool *p, uint32_t id)
{
    uint32_t *link = &p->bucket[bucket_of(p, p->name[id])];
    while (*link != id)
        link = &p->chain[*link];
    *link = p->chain[id];
    p->named[id] = false;
}

static void lru_unlink(struct kvr_kv_pool *p, uint32_t id)
{
    uint32_t a = p->lru_prev[id], b = p->lru_next[id];
    if (a == NONE)
        p->lru_head = b;
    else
        p->lru_next[a] = b;
    if (b == NONE)
        p->lru_tail = a;
    else
        p->lru_prev[b] = a;
}

static void lru_push(struct kvr_kv_pool *p, uint32_t id) /* as the most recently used */
{
    p->lru_prev[id] = p->lru_tail;
    p->lru_next[id] = NONE;
    if (p->lru_tail == NONE)
        p->lru_head = id;
    else
        p->lru_next[p->lru_tail] = id;
    p->lru_tail = id;
}

static uint32_t find(const struct kvr_kv_pool *p, uint64_t prev, uint64_t name,
                     const int32_t *tokens)
{
    size_t bt = p->block_tokens;
    for (uint32_t id = p->bucket[bucket_of(p, name)]; id != NONE; id = p->chain[id])
        if (p->name[id] == name && p->prev[id] == prev &&
            !memcmp(p->tokens + id * bt, tokens, bt * sizeof *tokens))
            return id;
    return NONE;
}

uint32_t kvr_kv_pool_lookup(const struct kvr_kv_pool *p, uint64_t seed, const int32_t *tokens,
                            uint32_t n_tokens, uint32_t max_blocks, uint32_t *out)
{
    uint32_t n = 0;
    uint64_t prev = seed;
    while (n < max_blocks && (uint64_t)(n + 1) * p->block_tokens <= n_tokens) {
        const int32_t *blk = tokens + (size_t)n * p->block_tokens;
        uint64_t name = kvr_kv_block_hash(prev, blk, p->block_tokens);
        uint32_t id = find(p, prev, name, blk);
        if (id == NONE)
            break;
        out[n++] = id;
        prev = name;
    }
    return n;
}

void kvr_kv_pool_acquire(struct kvr_kv_pool *p, const uint32_t *ids, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id = ids[i];
        if (p->state[id] == KVR_KV_BLOCK_CACHED) {
            lru_unlink(p, id);
            p->n_cached--;
            p->n_used++;
            p->state[id] = KVR_KV_BLOCK_USED;
        }
        p->refs[id]++;
    }
}

int kvr_kv_pool_alloc(struct kvr_kv_pool *p, uint32_t *out, uint32_t n)
{
    if (n > kvr_kv_pool_available(p))
        return KVR_EFULL;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id;
        if (p->n_free > 0) {
            id = p->free_ids[--p->n_free];
        } else {
            id = p->lru_head;
            lru_unlink(p, id);
            unname(p, id);
            p->n_cached--;
            p->n_evicted++;
        }
        p->state[id] = KVR_KV_BLOCK_USED;
        p->refs[id] = 1;
        p->n_used++;
        out[i] = id;
    }
    return KVR_OK;
}

bool kvr_kv_pool_publish(struct kvr_kv_pool *p, uint32_t id, uint64_t prev, uint64_t name,
                         const int32_t *tokens)
{
    if (p->named[id] || p->state[id] != KVR_KV_BLOCK_USED || find(p, prev, name, tokens) != NONE)
        return false;
    size_t bt = p->block_tokens;
    p->name[id] = name;
    p->prev[id] = prev;
    memcpy(p->tokens + id * bt, tokens, bt * sizeof *tokens);
    uint32_t b = bucket_of(p, name);
    p->chain[id] = p->bucket[b];
    p->bucket[b] = id;
    p->named[id] = true;
    return true;
}

void kvr_kv_pool_release(struct kvr_kv_pool *p, const uint32_t *ids, uint32_t n)
{
    for (uint32_t i = n; i-- > 0;) {
        uint32_t id = ids[i];
        if (p->state[id] != KVR_KV_BLOCK_USED || --p->refs[id] > 0)
            continue;
        p->n_used--;
        if (p->named[id]) {
            p->state[id] = KVR_KV_BLOCK_CACHED;
            lru_push(p, id);
            p->n_cached++;
        } else {
            p->state[id] = KVR_KV_BLOCK_FREE;
            p->free_ids[p->n_free++] = id;
        }
    }
}

uint32_t kvr_kv_pool_flush(struct kvr_kv_pool *p)
{
    uint32_t n = 0;
    while (p->lru_head != NONE) {
        uint32_t id = p->lru_head;
        lru_unlink(p, id);
        unname(p, id);
        p->state[id] = KVR_KV_BLOCK_FREE;
        p->free_ids[p->n_free++] = id;
        n++;
    }
    p->n_cached = 0;
    return n;
}

int kvr_kv_pool_check(const struct kvr_kv_pool *p, struct kvr_err *err)
{
    uint32_t n_state[KVR_KV_BLOCK_STATE_COUNT] = {0};
    for (uint32_t i = 0; i < p->n_blocks; i++) {
        if (p->state[i] >= KVR_KV_BLOCK_STATE_COUNT)
            return kvr_err_set(err, KVR_EINVAL, "block %u: state %u", i, p->state[i]);
        n_state[p->state[i]]++;
        if ((p->state[i] == KVR_KV_BLOCK_USED) != (p->refs[i] > 0))
            return kvr_err_set(err, KVR_EINVAL, "block %u: state %u with %u refs", i, p->state[i],
                               p->refs[i]);
        if (p->state[i] == KVR_KV_BLOCK_CACHED && !p->named[i])
            return kvr_err_set(err, KVR_EINVAL, "block %u: cached but unnamed", i);
        if (p->state[i] == KVR_KV_BLOCK_FREE && p->named[i])
            return kvr_err_set(err, KVR_EINVAL, "block %u: free but named", i);
        if (p->named[i] &&
            find(p, p->prev[i], p->name[i], p->tokens + (size_t)i * p->block_tokens) != i)
            return kvr_err_set(err, KVR_EINVAL, "block %u: named but not in the index", i);
    }
    if (n_state[KVR_KV_BLOCK_FREE] != p->n_free || n_state[KVR_KV_BLOCK_CACHED] != p->n_cached ||
        n_state[KVR_KV_BLOCK_USED] != p->n_used)
        return kvr_err_set(err, KVR_EINVAL,
                           "counts free/cached/used %u/%u/%u, states say "
                           "%u/%u/%u",
                           p->n_free, p->n_cached, p->n_used, n_state[KVR_KV_BLOCK_FREE],
                           n_state[KVR_KV_BLOCK_CACHED], n_state[KVR_KV_BLOCK_USED]);
    uint32_t n_lru = 0;
    for (uint32_t id = p->lru_head, last = NONE; id != NONE; last = id, id = p->lru_next[id]) {
        if (p->state[id] != KVR_KV_BLOCK_CACHED || p->lru_prev[id] != last || ++n_lru > p->n_cached)
            return kvr_err_set(err, KVR_EINVAL, "LRU list broken at block %u", id);
    }
    if (n_lru != p->n_cached)
        return kvr_err_set(err, KVR_EINVAL, "LRU list holds %u of %u cached", n_lru, p->n_cached);
    for (uint32_t k = 0; k < p->n_free; k++)
        if (p->state[p->free_ids[k]] != KVR_KV_BLOCK_FREE)
            return kvr_err_set(err, KVR_EINVAL, "free stack holds block %u, not free",
                               p->free_ids[k]);
    return KVR_OK;
}
