/* kv.c - the paged KV cache and the bridge's block pool (see kv.h). */
#include "model/kv.h"

#include "core/alloc.h"

#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define NONE UINT32_MAX

bool kvr_kv_type_ok(enum kvr_dtype type)
{
    return type == KVR_DTYPE_F32 || type == KVR_DTYPE_F16 || type == KVR_DTYPE_Q8_0;
}

size_t kvr_kv_bytes(enum kvr_dtype type, uint64_t n)
{
    size_t bytes;
    if (!kvr_kv_type_ok(type) || n > INT64_MAX || !kvr_dtype_row_bytes(type, (int64_t)n, &bytes))
        return 0;
    return bytes;
}

#if defined(__x86_64__)
/* Single to half with F16C, 8 at a time, rounding to nearest even: the bits of
 * kvr_f32_to_f16 (NaNs made quiet alike; test_kv checks a million floats over the whole
 * range). Every row of a forward stores its keys and values, so it is worth a loop. */
__attribute__((target("avx,f16c"))) static void f16_store_f16c(uint16_t *dst, const float *src,
                                                               uint32_t n)
{
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++)
        dst[i] = kvr_f32_to_f16(src[i]);
}
#endif

void kvr_kv_store(enum kvr_dtype type, void *dst, const float *src, uint32_t n)
{
    if (type == KVR_DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
#if defined(__x86_64__)
    if (type == KVR_DTYPE_F16 && kvr_kernels_avx2_ok()) {
        f16_store_f16c(dst, src, n);
        return;
    }
#endif
    kvr_dtype_traits(type)->from_float(src, dst, n);
}

#if defined(__x86_64__)
/* Half to single with F16C, 8 at a time: the conversion is exact, so these are the bits of
 * kvr_f16_to_f32 for every half that is not a signalling NaN (test_kv checks all 65536).
 * Attention reads every cached value of a sequence per row, so this is its hot loop. */
__attribute__((target("avx,f16c"))) static void f16_load_f16c(float *dst, const uint16_t *src,
                                                              uint32_t n)
{
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++)
        dst[i] = kvr_f16_to_f32(src[i]);
}
#endif

void kvr_kv_load(enum kvr_dtype type, float *dst, const void *src, uint32_t n)
{
    if (type == KVR_DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
#if defined(__x86_64__)
    if (type == KVR_DTYPE_F16 && kvr_kernels_avx2_ok()) {
        f16_load_f16c(dst, src, n);
        return;
    }
#endif
    kvr_dtype_traits(type)->to_float(src, dst, n);
}

int kvr_kv_init(struct kvr_kv *kv, enum kvr_dtype type, uint32_t n_layers, uint32_t kv_dim,
                uint32_t block_tokens, uint32_t n_blocks, uint32_t max_seqs, uint32_t n_ctx,
                struct kvr_err *err)
{
    memset(kv, 0, sizeof *kv);
    if (!kv_dim || !block_tokens || !n_blocks || !max_seqs || !n_ctx)
        return kvr_err_set(err, KVR_EINVAL, "kv cache: sizes must be non-zero");
    if (!kvr_kv_type_ok(type))
        return kvr_err_set(err, KVR_EINVAL, "kv cache: type %d is not f32, f16 or q8_0", (int)type);
    kv->row_bytes = kvr_kv_bytes(type, kv_dim);
    if (!kv->row_bytes)
        return kvr_err_set(err, KVR_EINVAL,
                           "kv cache: %u values per position are not whole %s blocks", kv_dim,
                           kvr_dtype_traits(type)->name);
    kv->type = type;
    kv->n_layers = n_layers;
    kv->kv_dim = kv_dim;
    kv->block_tokens = block_tokens;
    kv->n_blocks = n_blocks;
    kv->max_seqs = max_seqs;
    kv->max_blocks_per_seq = (n_ctx + block_tokens - 1) / block_tokens;

    size_t n_rows, n_bytes, n_table;
    if (!kvr_mul_size((size_t)n_layers * n_blocks, block_tokens, &n_rows) ||
        !kvr_mul_size(n_rows, kv->row_bytes, &n_bytes) ||
        !kvr_mul_size(max_seqs, kv->max_blocks_per_seq, &n_table))
        return kvr_err_set(err, KVR_ENOMEM, "kv cache: size overflows");
    kv->k = kvr_aligned_alloc(64, n_bytes ? n_bytes : 64);
    kv->v = kvr_aligned_alloc(64, n_bytes ? n_bytes : 64);
    kv->tables = kvr_calloc(n_table, sizeof *kv->tables);
    kv->n_pos = kvr_calloc(max_seqs, sizeof *kv->n_pos);
    kv->free_ids = kvr_calloc(n_blocks, sizeof *kv->free_ids);
    kv->n_mapped = kvr_calloc(max_seqs, sizeof *kv->n_mapped);
    kv->refs = kvr_calloc(n_blocks, sizeof *kv->refs);
    if (!kv->k || !kv->v || !kv->tables || !kv->n_pos || !kv->free_ids || !kv->n_mapped ||
        !kv->refs) {
        kvr_kv_fini(kv);
        return kvr_err_set(err, KVR_ENOMEM, "kv cache: cannot allocate %zu MiB", 2 * n_bytes >> 20);
    }
    /* Stack order: block 0 is handed out first. */
    for (uint32_t i = 0; i < n_blocks; i++)
        kv->free_ids[i] = n_blocks - 1 - i;
    kv->n_free = n_blocks;
    return KVR_OK;
}

void kvr_kv_fini(struct kvr_kv *kv)
{
    kvr_free(kv->k);
    kvr_free(kv->v);
    kvr_free(kv->tables);
    kvr_free(kv->n_pos);
    kvr_free(kv->free_ids);
    kvr_free(kv->n_mapped);
    kvr_free(kv->refs);
    memset(kv, 0, sizeof *kv);
}

static void truncate_seq(struct kvr_kv *kv, uint32_t seq, uint32_t n_tokens)
{
    if (kv->mapped) { /* the blocks stay mapped: they are the bridge's to reassign */
        kv->n_pos[seq] = n_tokens;
        return;
    }
    uint32_t *table = kv->tables + (size_t)seq * kv->max_blocks_per_seq;
    uint32_t have = kvr_kv_blocks_for(kv, kv->n_pos[seq]);
    uint32_t keep = kvr_kv_blocks_for(kv, n_tokens);
    for (uint32_t b = keep; b < have; b++)
        kv->free_ids[kv->n_free++] = table[b];
    kv->n_pos[seq] = n_tokens;
}

int kvr_kv_prepare(struct kvr_kv *kv, uint32_t seq, uint32_t pos0, uint32_t n_tokens,
                   struct kvr_err *err)
{
    if (seq >= kv->max_seqs)
        return kvr_err_set(err, KVR_ERANGE, "kv: sequence %u out of range (max %u)", seq,
                           kv->max_seqs);
    if (pos0 > kv->n_pos[seq])
        return kvr_err_set(err, KVR_ERANGE,
                           "kv: sequence %u writes position %u but has only %u cached", seq, pos0,
                           kv->n_pos[seq]);
    uint64_t end = (uint64_t)pos0 + n_tokens;
    if (end > (uint64_t)kv->max_blocks_per_seq * kv->block_tokens)
        return kvr_err_set(err, KVR_ERANGE, "kv: sequence %u position %llu beyond context", seq,
                           (unsigned long long)end);
    uint32_t need = kvr_kv_blocks_for(kv, (uint32_t)end);
    if (kv->mapped) {
        /* Every MAP of an opening names the same cached positions; they must be in blocks
         * mapped by the time the sequence runs. */
        if (need > kv->n_mapped[seq] || kvr_kv_blocks_for(kv, kv->n_pos[seq]) > kv->n_mapped[seq])
            return kvr_err_set(err, KVR_ERANGE,
                               "kv: sequence %u writes position %llu but "
                               "was mapped %u blocks",
                               seq, (unsigned long long)end - 1, kv->n_mapped[seq]);
        kv->n_pos[seq] = (uint32_t)end;
        return KVR_OK;
    }
    /* Blocks the sequence already owns are rewritten in place; only new ones are taken. */
    uint32_t have = kvr_kv_blocks_for(kv, kv->n_pos[seq]);
    uint32_t take = need > have ? need - have : 0;
    if (take > kv->n_free)
        return kvr_err_set(err, KVR_EFULL, "kv: out of blocks (need %u, free %u)", take,
                           kv->n_free);
    if (need < have)
        truncate_seq(kv, seq, (uint32_t)end);
    uint32_t *table = kv->tables + (size_t)seq * kv->max_blocks_per_seq;
    for (uint32_t b = have; b < need; b++)
        table[b] = kv->free_ids[--kv->n_free];
    kv->n_pos[seq] = (uint32_t)end;
    return KVR_OK;
}

int kvr_kv_map(struct kvr_kv *kv, uint32_t seq, uint32_t n_cached, uint32_t first,
               const uint32_t *ids, uint32_t n, struct kvr_err *err)
{
    if (seq >= kv->max_seqs)
        return kvr_err_set(err, KVR_EINVAL, "kv: map of sequence %u out of range (max %u)", seq,
                           kv->max_seqs);
    if (!kv->mapped && kv->n_free != kv->n_blocks)
        return kvr_err_set(err, KVR_EINVAL,
                           "kv: map of sequence %u into a cache whose "
                           "sequences took their own blocks",
                           seq);
    if (first != kv->n_mapped[seq] || (first == 0 && kv->n_pos[seq] != 0))
        return kvr_err_set(err, KVR_EINVAL,
                           "kv: map of sequence %u at block %u, but it has "
                           "%u mapped and %u positions",
                           seq, first, kv->n_mapped[seq], kv->n_pos[seq]);
    if (n > kv->max_blocks_per_seq - first)
        return kvr_err_set(err, KVR_EINVAL,
                           "kv: map of sequence %u: %u + %u blocks, at most "
                           "%u",
                           seq, first, n, kv->max_blocks_per_seq);
    if (n_cached % kv->block_tokens || n_cached / kv->block_tokens > kv->max_blocks_per_seq)
        return kvr_err_set(err, KVR_EINVAL,
                           "kv: map of sequence %u: %u cached positions, "
                           "at most %u blocks of %u",
                           seq, n_cached, kv->max_blocks_per_seq, kv->block_tokens);
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] >= kv->n_blocks)
            return kvr_err_set(err, KVR_EINVAL,
                               "kv: map of sequence %u: block %u, the cache "
                               "has %u",
                               seq, ids[i], kv->n_blocks);
    kv->mapped = true;
    uint32_t *table = kv->tables + (size_t)seq * kv->max_blocks_per_seq;
    for (uint32_t i = 0; i < n; i++) {
        table[first + i] = ids[i];
        kv->n_referenced += kv->refs[ids[i]]++ == 0;
    }
    kv->n_mapped[seq] = first + n;
    kv->n_pos[seq] = n_cached;
    return KVR_OK;
}

void kvr_kv_free_seq(struct kvr_kv *kv, uint32_t seq)
{
    if (seq >= kv->max_seqs)
        return;
    if (!kv->mapped) {
        truncate_seq(kv, seq, 0);
        return;
    }
    const uint32_t *table = kv->tables + (size_t)seq * kv->max_blocks_per_seq;
    for (uint32_t b = 0; b < kv->n_mapped[seq]; b++)
        kv->n_referenced -= --kv->refs[table[b]] == 0;
    kv->n_mapped[seq] = 0;
    kv->n_pos[seq] = 0;
}

uint32_t kvr_kv_used(const struct kvr_kv *kv)
{
    return kv->mapped ? kv->n_referenced : kv->n_blocks - kv->n_free;
}

/* ---- the block pool ------------------------------------------------------------------------ */

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
