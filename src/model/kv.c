#include "model/kv.h"

#include "core/alloc.h"

#include <string.h>

int kvr_kv_init(struct kvr_kv *kv, uint32_t n_layers, uint32_t kv_dim, uint32_t block_tokens,
                uint32_t n_blocks, uint32_t max_seqs, uint32_t n_ctx, struct kvr_err *err)
{
    memset(kv, 0, sizeof *kv);
    if (!kv_dim || !block_tokens || !n_blocks || !max_seqs || !n_ctx)
        return kvr_err_set(err, KVR_EINVAL, "kv cache: sizes must be non-zero");
    kv->n_layers = n_layers;
    kv->kv_dim = kv_dim;
    kv->block_tokens = block_tokens;
    kv->n_blocks = n_blocks;
    kv->max_seqs = max_seqs;
    kv->max_blocks_per_seq = (n_ctx + block_tokens - 1) / block_tokens;

    size_t n_floats, n_bytes, n_table;
    if (!kvr_mul_size((size_t)n_layers * n_blocks, (size_t)block_tokens * kv_dim, &n_floats) ||
        !kvr_mul_size(n_floats, sizeof(float), &n_bytes) ||
        !kvr_mul_size(max_seqs, kv->max_blocks_per_seq, &n_table))
        return kvr_err_set(err, KVR_ENOMEM, "kv cache: size overflows");
    kv->k = kvr_aligned_alloc(64, n_bytes ? n_bytes : 64);
    kv->v = kvr_aligned_alloc(64, n_bytes ? n_bytes : 64);
    kv->tables = kvr_calloc(n_table, sizeof *kv->tables);
    kv->n_pos = kvr_calloc(max_seqs, sizeof *kv->n_pos);
    kv->free_ids = kvr_calloc(n_blocks, sizeof *kv->free_ids);
    if (!kv->k || !kv->v || !kv->tables || !kv->n_pos || !kv->free_ids) {
        kvr_kv_fini(kv);
        return kvr_err_set(err, KVR_ENOMEM, "kv cache: cannot allocate %zu MiB",
                           2 * n_bytes >> 20);
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
    memset(kv, 0, sizeof *kv);
}

static void truncate_seq(struct kvr_kv *kv, uint32_t seq, uint32_t n_tokens)
{
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
                           "kv: sequence %u writes position %u but has only %u cached", seq,
                           pos0, kv->n_pos[seq]);
    uint64_t end = (uint64_t)pos0 + n_tokens;
    if (end > (uint64_t)kv->max_blocks_per_seq * kv->block_tokens)
        return kvr_err_set(err, KVR_ERANGE, "kv: sequence %u position %llu beyond context",
                           seq, (unsigned long long)end);
    /* Blocks the sequence already owns are rewritten in place; only new ones are taken. */
    uint32_t need = kvr_kv_blocks_for(kv, (uint32_t)end);
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

void kvr_kv_free_seq(struct kvr_kv *kv, uint32_t seq)
{
    if (seq < kv->max_seqs)
        truncate_seq(kv, seq, 0);
}
