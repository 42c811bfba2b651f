/* kv.c - the paged KV cache of one layer slice (see kv.h). */
#include "model/kv.h"

#include "core/alloc.h"

#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

static int init(struct kvr_kv *kv, enum kvr_dtype type, uint32_t n_layers, uint32_t kv_dim,
                uint32_t block_tokens, uint32_t n_blocks, uint32_t max_seqs, uint32_t n_ctx,
                bool with_v, struct kvr_err *err)
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
    kv->v = with_v ? kvr_aligned_alloc(64, n_bytes ? n_bytes : 64) : NULL;
    kv->tables = kvr_calloc(n_table, sizeof *kv->tables);
    kv->n_pos = kvr_calloc(max_seqs, sizeof *kv->n_pos);
    kv->free_ids = kvr_calloc(n_blocks, sizeof *kv->free_ids);
    kv->n_mapped = kvr_calloc(max_seqs, sizeof *kv->n_mapped);
    kv->refs = kvr_calloc(n_blocks, sizeof *kv->refs);
    if (!kv->k || (with_v && !kv->v) || !kv->tables || !kv->n_pos || !kv->free_ids ||
        !kv->n_mapped || !kv->refs) {
        kvr_kv_fini(kv);
        return kvr_err_set(err, KVR_ENOMEM, "kv cache: cannot allocate %zu MiB",
                           (with_v ? 2 : 1) * n_bytes >> 20);
    }
    /* Stack order: block 0 is handed out first. */
    for (uint32_t i = 0; i < n_blocks; i++)
        kv->free_ids[i] = n_blocks - 1 - i;
    kv->n_free = n_blocks;
    return KVR_OK;
}

int kvr_kv_init(struct kvr_kv *kv, enum kvr_dtype type, uint32_t n_layers, uint32_t kv_dim,
                uint32_t block_tokens, uint32_t n_blocks, uint32_t max_seqs, uint32_t n_ctx,
                struct kvr_err *err)
{
    return init(kv, type, n_layers, kv_dim, block_tokens, n_blocks, max_seqs, n_ctx, true, err);
}

int kvr_kv_init_keys(struct kvr_kv *kv, enum kvr_dtype type, uint32_t n_layers, uint32_t kv_dim,
                     uint32_t block_tokens, uint32_t n_blocks, uint32_t max_seqs, uint32_t n_ctx,
                     struct kvr_err *err)
{
    return init(kv, type, n_layers, kv_dim, block_tokens, n_blocks, max_seqs, n_ctx, false, err);
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
