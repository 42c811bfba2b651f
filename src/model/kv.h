/* kv.h - the paged KV cache of one layer slice (DESIGN.md 6). The bridge's block pool,
 * which names the blocks a ring stage maps, is bridge/kvpool.h.
 *
 * struct kvr_kv (one per engine): keys and values live in fixed-size blocks of
 * `block_tokens` positions. Each sequence slot has a block table mapping its position p
 * to block table[p / block_tokens]. All memory is allocated in kvr_kv_init; nothing is
 * allocated per token. Blocks reach a table in one of two ways, never both in one cache:
 *   - lazily (kvr_kv_prepare takes them from the cache's own free list): the single
 *     process engine (`kvasir run`, tests);
 *   - named by the caller (kvr_kv_map): a ring stage, whose bridge decides every block a
 *     sequence uses (bridge/kvpool.h) and sends the ids in-band, so every stage
 *     maps the same blocks in the same order. A mapped block may be in several tables
 *     (a shared prefix); the cache counts references only to report use.
 *
 * Layout of `k` and `v`: [n_layers][n_blocks][block_tokens] rows of `row_bytes`, one row
 * holding the kv_dim = n_head_kv * head_dim values of a position in the cache's type:
 *   f32   kv_dim floats (what the engine computes, kept exactly);
 *   f16   kv_dim IEEE half floats, round-to-nearest-even (half the bytes);
 *   q8_0  kv_dim / 32 GGUF Q8_0 blocks (fp16 scale d = max|x| / 127, 32 int8 q = round(x /
 *         d); 34 bytes per 32 values, 0.27x the bytes). A block never straddles two heads
 *         when head_dim is a multiple of 32, which the engine requires for q8_0.
 * Every row is converted by the plain functions kvr_kv_store / kvr_kv_load below, so the
 * bits read back depend only on the value written, never on the batch. Single-threaded
 * mutation (the engine's driving thread); reads of
 * k/v rows from the compute pool during a forward pass are safe because the tables are not
 * changed while it runs. */
#ifndef KVR_MODEL_KV_H
#define KVR_MODEL_KV_H

#include "core/err.h"
#include "model/dtype.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvr_kv {
    uint32_t n_layers;           /* layers in this slice */
    uint32_t kv_dim;             /* values per position per layer, for K and for V */
    enum kvr_dtype type;         /* KVR_DTYPE_F32, _F16 or _Q8_0 */
    size_t row_bytes;            /* bytes of one position's kv_dim values in `type` */
    uint32_t block_tokens;       /* positions per block */
    uint32_t n_blocks;           /* blocks per layer (a block id names it in every layer) */
    uint32_t max_seqs;           /* sequence slots */
    uint32_t max_blocks_per_seq; /* ceil(n_ctx / block_tokens) */
    uint8_t *k;                  /* see layout above */
    uint8_t *v;                  /* NULL in a keys-only cache (kvr_kv_init_keys) */
    uint32_t *tables;            /* [max_seqs][max_blocks_per_seq] block ids */
    uint32_t *n_pos;             /* [max_seqs] positions cached per sequence */
    uint32_t *free_ids;          /* stack of free block ids, n_free valid (lazy blocks) */
    uint32_t n_free;
    /* Named blocks (kvr_kv_map). */
    bool mapped;           /* blocks come from kvr_kv_map only (set by the first map) */
    uint32_t *n_mapped;    /* [max_seqs] table entries set by kvr_kv_map */
    uint32_t *refs;        /* [n_blocks] tables that hold each block */
    uint32_t n_referenced; /* blocks with refs > 0 */
};

/* Cache types: true for F32, F16 and Q8_0. */
bool kvr_kv_type_ok(enum kvr_dtype type);
/* Bytes of n values of a cache type (0 if the type is not one, or n is not a whole number
 * of its blocks: 32 values for q8_0). */
size_t kvr_kv_bytes(enum kvr_dtype type, uint64_t n);
/* Convert n values (a whole number of blocks) into the cache type, or back to floats:
 * plain loops over the dtype traits' reference conversions, the same bits on every CPU. */
void kvr_kv_store(enum kvr_dtype type, void *dst, const float *src, uint32_t n);
void kvr_kv_load(enum kvr_dtype type, float *dst, const void *src, uint32_t n);

/* KVR_EINVAL for a type kvr_kv_type_ok refuses or a kv_dim not a whole number of its
 * blocks. */
int kvr_kv_init(struct kvr_kv *kv, enum kvr_dtype type, uint32_t n_layers, uint32_t kv_dim,
                uint32_t block_tokens, uint32_t n_blocks, uint32_t max_seqs, uint32_t n_ctx,
                struct kvr_err *err);
/* kvr_kv_init with `k` only (`v` NULL): one row of kv_dim values per position and layer,
 * the compressed latent of multi-head latent attention (model/mla.h), which serves as
 * keys and values both. */
int kvr_kv_init_keys(struct kvr_kv *kv, enum kvr_dtype type, uint32_t n_layers, uint32_t kv_dim,
                     uint32_t block_tokens, uint32_t n_blocks, uint32_t max_seqs, uint32_t n_ctx,
                     struct kvr_err *err);
void kvr_kv_fini(struct kvr_kv *kv);

/* Make room to write positions [pos0, pos0 + n_tokens) of `seq`: the sequence is first
 * truncated to pos0 (pos0 must be <= its cached length), then, for a lazily filled cache,
 * blocks are taken from the free list; a mapped sequence must already have the blocks
 * (KVR_ERANGE otherwise). On KVR_EFULL or KVR_ERANGE nothing changes. */
int kvr_kv_prepare(struct kvr_kv *kv, uint32_t seq, uint32_t pos0, uint32_t n_tokens,
                   struct kvr_err *err);

/* Set entries [first, first + n) of `seq`'s block table to ids[0..n), and the positions it
 * has cached to n_cached (its first n_cached positions are in blocks already written by an
 * earlier sequence: a prefix-cache hit). The first map of a sequence must have first == 0
 * and the sequence must be empty; later ones continue at first == the entries set so far,
 * with the same n_cached. KVR_EINVAL (nothing changes) for an id out of range, a gap,
 * n_cached not a whole number of blocks or beyond the context, or a cache that has lazily
 * taken blocks. kvr_kv_prepare refuses to run the sequence while n_cached reaches past
 * the blocks mapped so far. */
int kvr_kv_map(struct kvr_kv *kv, uint32_t seq, uint32_t n_cached, uint32_t first,
               const uint32_t *ids, uint32_t n, struct kvr_err *err);

/* Blocks needed for a sequence of n_tokens positions. */
static inline uint32_t kvr_kv_blocks_for(const struct kvr_kv *kv, uint32_t n_tokens)
{
    return (n_tokens + kv->block_tokens - 1) / kv->block_tokens;
}

/* The row of `seq`'s position `pos` in layer `layer` of base (kv->k or kv->v). */
static inline uint8_t *kvr_kv_row(const struct kvr_kv *kv, uint8_t *base, uint32_t layer,
                                  uint32_t seq, uint32_t pos)
{
    uint32_t block = kv->tables[(size_t)seq * kv->max_blocks_per_seq + pos / kv->block_tokens];
    size_t idx = ((size_t)layer * kv->n_blocks + block) * kv->block_tokens + pos % kv->block_tokens;
    return base + idx * kv->row_bytes;
}

/* Drop a sequence: lazy blocks go back to the free list, mapped ones lose a reference. */
void kvr_kv_free_seq(struct kvr_kv *kv, uint32_t seq);
/* Blocks holding some sequence's KV. */
uint32_t kvr_kv_used(const struct kvr_kv *kv);

#endif
