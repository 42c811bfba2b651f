/* mla.h - multi-head latent attention (DeepSeek V2/V3, Kimi K2: `deepseek2`), the attention
 * block of an MLA layer over a batch of rows, with a KV cache of compressed latents.
 *
 * For a row x (already RMS-normed by the caller), with H heads, head widths nope + rope for
 * queries and keys, v for values, and latent width L = kv_lora_rank:
 *
 *   q      = q_b(rmsnorm(q_a x)), or attn_q x without q_lora_rank: H x (nope + rope)
 *   kv     = kv_a_mqa x: L + rope values; c = rmsnorm(kv[0..L)) (attn_kv_a_norm) is the
 *            latent, k_pe = RoPE(kv[L..L+rope)) the one rotary key all heads share
 *   cache  the row [k_pe | c], L + rope values per token and layer (model/kv.h, keys only)
 *   score  head h at cached position t: scale * (RoPE(q_pe_h) . k_pe_t + q_nope_h . K_h c_t)
 *          = scale * ([RoPE(q_pe_h) | K_h^T q_nope_h] . [k_pe_t | c_t]): the key projection
 *          K_h (attn_k_b) is absorbed into the query, so the cache never holds full keys
 *   out    head h: V_h (sum_t p_t c_t), V_h = attn_v_b: the values' projection applied
 *          after the weighted sum; the H x v outputs go to attn_output (the caller's)
 *
 * GGUF (per layer blk.N.): attn_q_a.weight [n_embd, q_lora], attn_q_a_norm.weight [q_lora],
 * attn_q_b.weight [q_lora, H (nope + rope)] (or attn_q.weight [n_embd, H (nope + rope)]),
 * attn_kv_a_mqa.weight [n_embd, L + rope], attn_kv_a_norm.weight [L], and either the split
 * attn_k_b.weight [nope, L, H] and attn_v_b.weight [L, v, H] current converters write, or
 * the older fused attn_kv_b.weight [L, H (nope + v)] (head h's nope key rows, then its v
 * value rows). The fused file's key part is transposed once at load into an owned f32 copy
 * of the split form (dequantized: the fused form is a legacy one). Keys `deepseek2.`
 * attention.q_lora_rank (absent: plain attn_q), attention.kv_lora_rank,
 * attention.key_length_mla / value_length_mla (nope + rope and v; the older files' own
 * key_length / value_length), rope.dimension_count (rope), and YaRN's keys (model/yarn.h,
 * read by arch.c into hparams.yarn).
 *
 * RoPE pairs adjacent values (2i, 2i + 1) of the rope slices only. YaRN, as llama.cpp
 * computes it: each pair's angle blends the interpolated (pos / factor) and extrapolated
 * (pos) angles by a ramp over pair indices between the correction dims of beta_fast 32 and
 * beta_slow 1; cos and sin are not rescaled (DeepSeek's own mscale ratio is 1), and the
 * attention scale is mscale^2 / sqrt(nope + rope) with mscale = 1 + log_mul ln(factor).
 *
 * Batch invariance: every matmul goes through kvr_matmul (each element in one fixed
 * order), norms and RoPE are per row, and a unit of attention (a row and a fixed group of
 * heads) is computed by one thread in one order, so a row's result does not depend on the
 * batch, the thread count or the split.
 *
 * Ownership: a struct kvr_mla_layer views the caller's GGUF mapping (it must outlive it)
 * and may own the transposed key projection of a fused file (kvr_mla_layer_fini frees it).
 * A struct kvr_mla_work owns all scratch, sized at create; nothing is allocated per call.
 * Thread-safety: one thread calls into a work at a time; the pool runs the parallel
 * parts. */
#ifndef KVR_MODEL_MLA_H
#define KVR_MODEL_MLA_H

#include "core/err.h"
#include "core/pool.h"
#include "model/dtype.h"
#include "model/gguf.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_hparams;
struct kvr_kv;

struct kvr_mla_hparams {
    uint32_t q_lora_rank;  /* 0: queries through a plain attn_q */
    uint32_t kv_lora_rank; /* L, the latent's width; 0: not an MLA model */
    uint32_t n_nope;       /* per-head key width without RoPE */
    uint32_t n_rope;       /* per-head RoPE width (rope.dimension_count) */
    uint32_t n_v;          /* per-head value width */
    float kq_scale;        /* score scale: mscale^2 / sqrt(n_nope + n_rope) */
};

/* Read the MLA keys of a deepseek2 file into hp->mla and set the widths the rest of the
 * engine sizes by: n_head_kv 1 (all heads share the latent), head_dim and kv_dim L + rope
 * (a cache row), q_dim H x v (attn_output's input), n_rot rope. After read_shape (arch.c):
 * n_embd, n_head, rope base and n_ctx_train are known. */
int kvr_mla_hparams_read(struct kvr_hparams *hp, const struct kvr_gguf *g, struct kvr_err *err);

/* Views of one layer's attention tensors (attn_norm and attn_output stay the engine's). */
struct kvr_mla_layer {
    struct kvr_matrix wq_a;  /* [n_embd] -> [q_lora] (q_lora_rank > 0) */
    const float *q_a_norm;   /* [q_lora] */
    struct kvr_matrix wq_b;  /* [q_lora] -> [H (nope + rope)] */
    struct kvr_matrix wq;    /* [n_embd] -> [H (nope + rope)] (q_lora_rank == 0) */
    struct kvr_matrix wkv_a; /* [n_embd] -> [L + rope] */
    const float *kv_a_norm;  /* [L] */
    struct kvr_matrix wk_b;  /* head 0 of [nope] -> [L], heads k_b_stride bytes apart */
    struct kvr_matrix wv_b;  /* head 0 of [L] -> [v], heads v_b_stride bytes apart */
    size_t k_b_stride, v_b_stride;
    bool fused;       /* the file has attn_kv_b */
    float *k_b_owned; /* a fused file's transposed key part (f32), owned */
};

/* View layer il's MLA tensors with every shape and type checked; a fused file's key part
 * is transposed into an owned copy here. */
int kvr_mla_layer_view(struct kvr_mla_layer *l, const struct kvr_gguf *g,
                       const struct kvr_hparams *hp, uint32_t il, struct kvr_err *err);
void kvr_mla_layer_fini(struct kvr_mla_layer *l);
/* Bytes of layer il's latent attention tensors in the file (those it has of attn_q_a,
 * attn_q_a_norm, attn_q_b, attn_q, attn_kv_a_mqa, attn_kv_a_norm, attn_k_b, attn_v_b,
 * attn_kv_b): all of them are read per token (the plan balancer's cost). */
double kvr_mla_layer_file_bytes(const struct kvr_gguf *g, uint32_t il);
/* Bytes a layer owns beyond the file (the transposed copy of a fused file). */
size_t kvr_mla_layer_owned_bytes(const struct kvr_mla_layer *l, uint32_t n_head);

struct kvr_mla_work;

/* Scratch for up to max_rows rows of the given layers, n_threads threads and n_ctx
 * positions. */
int kvr_mla_work_create(struct kvr_mla_work **out, const struct kvr_hparams *hp,
                        const struct kvr_mla_layer *layers, uint32_t n_layers, uint32_t max_rows,
                        uint32_t n_threads, uint32_t n_ctx, uint32_t kv_block_tokens,
                        struct kvr_err *err);
void kvr_mla_work_destroy(struct kvr_mla_work *w);
/* Bytes kvr_mla_work_create allocates for these sizes (for the engine's memory estimate). */
size_t kvr_mla_work_bytes(const struct kvr_hparams *hp, uint32_t max_rows, uint32_t n_threads,
                          uint32_t n_ctx, uint32_t kv_block_tokens);

/* The attention block of cache layer `layer` for n_rows rows of x (n_rows x n_embd): every
 * row's latent is stored at (row_seq[r], row_pos[r]) first (the caller has prepared the
 * cache), then each row attends causally to its sequence's positions 0..row_pos[r].
 * out: n_rows x (H v) floats, the input of attn_output. */
void kvr_mla_attention(struct kvr_mla_work *w, const struct kvr_mla_layer *l, struct kvr_kv *kv,
                       uint32_t layer, const float *x, uint32_t n_rows, const uint32_t *row_seq,
                       const uint32_t *row_pos, float *out, struct kvr_pool *pool);

/* The plain reference for tests: the same block computed the naive way, with full keys
 * and values decompressed per head (k_nope = K_h c, v = V_h c) and no absorption, in
 * double, for one sequence whose rows 0..n_pos-1 are x (n_pos x n_embd); out gets the last
 * row's H x v values. */
int kvr_mla_attention_ref(const struct kvr_hparams *hp, const struct kvr_mla_layer *l,
                          const float *x, uint32_t n_pos, float *out);

#endif
