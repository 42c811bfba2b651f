/* engine.h - the forward pass of one layer slice over one micro-batch (DESIGN.md 3, 7), for
 * every architecture of the table in arch.h (kvr_hparams_read lives there).
 *
 * An engine owns: a view of its slice of the model (weights stay in the caller's mmapped
 * GGUF), the paged KV cache of its layers, activation scratch sized for the widest batch,
 * and a fixed thread pool. Everything is allocated in kvr_engine_create; kvr_engine_forward
 * allocates nothing.
 *
 * A micro-batch is a list of segments. A segment is n_tokens consecutive positions of one
 * sequence starting at pos0 (a prefill chunk, or one decode row). Rows are laid out
 * segment after segment. The head (first_layer == 0) takes token ids and embeds them; other
 * stages take boundary rows (hidden states, f32). The tail (last_layer == n_layer-1)
 * applies the final norm and output head, and only to the LAST row of each segment flagged
 * KVR_SEG_WANTS_TOKEN (to EVERY row of one also flagged KVR_SEG_DRAFTS); other engines output
 * boundary rows for every row.
 *
 * Batch invariance: a row's result depends only on its own sequence's tokens and KV, never
 * on the other segments of the batch, the thread count, or the layer split.
 *
 * Thread-safety: one thread drives an engine (forward, seq_free); the pool is internal. */
#ifndef KVR_MODEL_ENGINE_H
#define KVR_MODEL_ENGINE_H

#include "core/err.h"
#include "model/arch.h"
#include "model/dtype.h"
#include "model/gguf.h"
#include "model/moe.h"

#include <stdbool.h>
#include <stdint.h>

enum kvr_seg_flag {
    KVR_SEG_PREFILL = 1u << 0,     /* a chunk of the prompt */
    KVR_SEG_LAST_CHUNK = 1u << 1,  /* the last prefill chunk of its prompt */
    KVR_SEG_DECODE = 1u << 2,      /* one generated token fed back */
    KVR_SEG_WANTS_TOKEN = 1u << 3, /* the tail computes logits for the segment's last row */
    KVR_SEG_DRAFTS = 1u << 4,      /* with DECODE and WANTS_TOKEN: 1 + k rows, the last token
                                      and k drafted ones (issue 37, spec_accept.h); the tail
                                      computes logits for every row */
    KVR_SEG_FLAG_COUNT = 5
};

struct kvr_seg {
    uint32_t seq;      /* sequence slot, < max_seqs */
    uint32_t pos0;     /* position of the first row, in tokens */
    uint32_t n_tokens; /* rows in this segment, >= 1 */
    uint32_t flags;    /* enum kvr_seg_flag bits */
};

struct kvr_engine_config {
    uint32_t first_layer; /* inclusive slice [first_layer, last_layer] */
    uint32_t last_layer;
    uint32_t max_rows;        /* the plan's row width: most token rows per forward */
    uint32_t max_seqs;        /* sequence slots */
    uint32_t n_ctx;           /* most positions per sequence */
    uint32_t kv_block_tokens; /* KV block size in tokens */
    uint32_t kv_n_blocks;     /* KV blocks per layer (0: enough for max_seqs * n_ctx) */
    enum kvr_dtype kv_type;   /* KV cache values: F32 (0), F16 or Q8_0 (kv.h) */
    uint32_t n_threads;
};

struct kvr_engine;

/* Options of the model layer for the whole process, read by every later kernel choice and
 * engine. The model reads no environment: cli/ fills this from the variables named below once
 * at start-up (tests and benches the same way) and calls kvr_model_configure before creating
 * an engine and before threads start. */
struct kvr_model_options {
    struct kvr_kernel_options kernels; /* KVR_ISA, KVR_PREFETCH (kvr_kernels_configure) */
    bool no_pack; /* KVR_NO_PACK=1: no packed copies, the kernels read the mapped file (A/B runs) */
};
void kvr_model_configure(const struct kvr_model_options *opt);

/* `g` is borrowed and must outlive the engine. */
int kvr_engine_create(struct kvr_engine **out, const struct kvr_gguf *g,
                      const struct kvr_engine_config *cfg, struct kvr_err *err);
void kvr_engine_destroy(struct kvr_engine *e);

/* What an engine made with `cfg` on `g` holds resident once its KV cache and scratch have
 * been touched: the slice's weights as the kernels read them (the file's header and layer
 * tensors, the embedding at the head, the output head at the tail; packed copies in place
 * of the file pages they replace), the KV cache, and the activation scratch (an MoE
 * model's expert scratch is not counted). Computed from the views, without allocating. */
struct kvr_engine_bytes {
    size_t weights;
    size_t kv;
    size_t scratch;
};
int kvr_engine_expected_bytes(const struct kvr_gguf *g, const struct kvr_engine_config *cfg,
                              struct kvr_engine_bytes *out, struct kvr_err *err);

const struct kvr_hparams *kvr_engine_hparams(const struct kvr_engine *e);
bool kvr_engine_is_head(const struct kvr_engine *e);
bool kvr_engine_is_tail(const struct kvr_engine *e);

/* Count rows and logit rows of a membership and check it against the engine's bounds
 * (row width, seq slots, context, KV capacity). Pure check; nothing is changed. */
int kvr_engine_check(const struct kvr_engine *e, const struct kvr_seg *segs, uint32_t n_segs,
                     uint32_t *n_rows, uint32_t *n_logit_rows, struct kvr_err *err);

/* Run the slice over one micro-batch.
 *   tokens    head only: n_rows token ids
 *   hidden_in non-head only: n_rows x n_embd floats
 *   out       tail: n_logit_rows x n_vocab logits (segments with WANTS_TOKEN, in order; every
 *             row of a DRAFTS segment);
 *             otherwise n_rows x n_embd boundary floats
 * A segment's positions must continue its sequence (pos0 == tokens already cached), or
 * rewrite its tail (pos0 < cached: the cache is truncated to pos0 first, used when a
 * sequence is re-prefilled, and after drafted rows were rejected). A row attends only to
 * positions up to its own, so rows past the cached length are never read. */
int kvr_engine_forward(struct kvr_engine *e, const struct kvr_seg *segs, uint32_t n_segs,
                       const int32_t *tokens, const float *hidden_in, float *out,
                       struct kvr_err *err);

/* A MoE engine: let fn(ctx, ...) compute the experts of every layer (expert agents,
 * ring/experts.h) instead of this process; NULL restores local computing. The results are
 * the same bits either way (moe.h). Call between forwards, from the driving thread. */
void kvr_engine_set_expert_dispatch(struct kvr_engine *e, kvr_moe_dispatch_fn fn, void *ctx);

/* Release a sequence's KV blocks (its slot may be reused at once). */
void kvr_engine_seq_free(struct kvr_engine *e, uint32_t seq);
/* Name the KV blocks of a sequence (kv.h kvr_kv_map): entries [first, first + n) of its
 * block table; its first n_cached positions are already in them (a prefix-cache hit). A
 * ring stage maps every sequence it is told to open; an engine whose sequences took their
 * own blocks refuses (KVR_EINVAL). */
int kvr_engine_seq_map(struct kvr_engine *e, uint32_t seq, uint32_t n_cached, uint32_t first,
                       const uint32_t *ids, uint32_t n, struct kvr_err *err);
/* KV blocks in use, and total, for metrics. */
void kvr_engine_kv_usage(const struct kvr_engine *e, uint32_t *used, uint32_t *total);

#endif
