/* kv.h - the paged KV cache of one layer slice.
 *
 * Keys and values live in fixed-size blocks of `block_tokens` positions. Each sequence slot
 * has a block table mapping its position p to block table[p / block_tokens]. All memory is
 * allocated in kvr_kv_init; blocks move between a free list and block tables, nothing is
 * allocated per token. A freed sequence returns its blocks at once.
 *
 * Layout of `k` and `v` (floats): [n_layers][n_blocks][block_tokens][kv_dim], kv_dim =
 * n_head_kv * head_dim. Single-threaded mutation (the engine's driving thread); reads of
 * k/v rows from the compute pool during a forward pass are safe because the tables are not
 * changed while it runs. */
#ifndef KVR_MODEL_KV_H
#define KVR_MODEL_KV_H

#include "core/err.h"

#include <stddef.h>
#include <stdint.h>

struct kvr_kv {
    uint32_t n_layers;           /* layers in this slice */
    uint32_t kv_dim;             /* floats per position per layer, for K and for V */
    uint32_t block_tokens;       /* positions per block */
    uint32_t n_blocks;           /* blocks per layer (a block id names it in every layer) */
    uint32_t max_seqs;           /* sequence slots */
    uint32_t max_blocks_per_seq; /* ceil(n_ctx / block_tokens) */
    float *k;                    /* see layout above */
    float *v;
    uint32_t *tables;            /* [max_seqs][max_blocks_per_seq] block ids */
    uint32_t *n_pos;             /* [max_seqs] positions cached per sequence */
    uint32_t *free_ids;          /* stack of free block ids, n_free valid */
    uint32_t n_free;
};

int kvr_kv_init(struct kvr_kv *kv, uint32_t n_layers, uint32_t kv_dim, uint32_t block_tokens,
                uint32_t n_blocks, uint32_t max_seqs, uint32_t n_ctx, struct kvr_err *err);
void kvr_kv_fini(struct kvr_kv *kv);

/* Make room to write positions [pos0, pos0 + n_tokens) of `seq`: the sequence is first
 * truncated to pos0 (pos0 must be <= its cached length), then blocks are taken from the
 * free list. On KVR_EFULL or KVR_ERANGE nothing changes. */
int kvr_kv_prepare(struct kvr_kv *kv, uint32_t seq, uint32_t pos0, uint32_t n_tokens,
                   struct kvr_err *err);

/* Blocks needed for a sequence of n_tokens positions. */
static inline uint32_t kvr_kv_blocks_for(const struct kvr_kv *kv, uint32_t n_tokens)
{
    return (n_tokens + kv->block_tokens - 1) / kv->block_tokens;
}

static inline float *kvr_kv_row(const struct kvr_kv *kv, float *base, uint32_t layer,
                                uint32_t seq, uint32_t pos)
{
    uint32_t block = kv->tables[(size_t)seq * kv->max_blocks_per_seq + pos / kv->block_tokens];
    size_t idx = ((size_t)layer * kv->n_blocks + block) * kv->block_tokens +
                 pos % kv->block_tokens;
    return base + idx * kv->kv_dim;
}

void kvr_kv_free_seq(struct kvr_kv *kv, uint32_t seq);

#endif
