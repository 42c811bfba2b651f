/* engine.c - llama-family forward pass of a layer slice over a micro-batch of rows.
 *
 * Reading order: hyperparameters, weight views, create/destroy, then the forward pass in
 * the order the data flows (embed -> per layer: attention block, feed-forward block ->
 * final norm and output head). Every tensor scratch buffer is sized at create from the
 * row width; the forward pass allocates nothing.
 *
 * Batch invariance (DESIGN.md 7): matmuls go through kvr_matmul, whose every output element
 * is reduced in one fixed order whatever the batch; every other operation (norm, rope,
 * attention, activation) is computed row by row by a single thread. So a row's result
 * never depends on its batch neighbours or on the thread count. */
#include "model/engine.h"

#include "core/alloc.h"
#include "core/log.h"
#include "core/pool.h"
#include "model/attn.h"
#include "model/dtype.h"
#include "model/kv.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- hyperparameters ------------------------------------------------------------------ */

enum {
    MAX_SEQS = 65536, /* most sequence slots an engine serves */
    MAX_ROT = 1024, /* most rotary dimensions per head we accept */
    MAX_GROUP = 64, /* most query heads sharing one KV head */
};

static int req_u32(const struct kvr_gguf *g, const char *key, uint32_t *out,
                   struct kvr_err *err)
{
    int rc = kvr_gguf_get_u32(g, key, out, err);
    if (rc == KVR_ENOTFOUND)
        return kvr_err_set(err, KVR_EFORMAT, "model: missing metadata key %s", key);
    return rc;
}

int kvr_hparams_read(struct kvr_hparams *hp, const struct kvr_gguf *g, struct kvr_err *err)
{
    memset(hp, 0, sizeof *hp);
    struct kvr_gguf_str arch;
    int rc = kvr_gguf_get_str(g, "general.architecture", &arch, err);
    if (rc == KVR_ENOTFOUND)
        return kvr_err_set(err, KVR_EFORMAT, "model: missing general.architecture");
    if (rc)
        return rc;
    if (arch.len != 5 || memcmp(arch.ptr, "llama", 5) != 0)
        return kvr_err_set(err, KVR_ENOTSUP, "model: architecture '%.*s' is not supported "
                           "(only llama-family models)", (int)(arch.len > 64 ? 64 : arch.len),
                           arch.ptr);
    if ((rc = req_u32(g, "llama.block_count", &hp->n_layer, err)) ||
        (rc = req_u32(g, "llama.embedding_length", &hp->n_embd, err)) ||
        (rc = req_u32(g, "llama.feed_forward_length", &hp->n_ff, err)) ||
        (rc = req_u32(g, "llama.attention.head_count", &hp->n_head, err)))
        return rc;
    hp->n_head_kv = hp->n_head;
    rc = kvr_gguf_get_u32(g, "llama.attention.head_count_kv", &hp->n_head_kv, err);
    if (rc && rc != KVR_ENOTFOUND)
        return rc;
    hp->n_ctx_train = 2048;
    rc = kvr_gguf_get_u32(g, "llama.context_length", &hp->n_ctx_train, err);
    if (rc && rc != KVR_ENOTFOUND)
        return rc;
    hp->rope_freq_base = 10000.0f;
    rc = kvr_gguf_get_f32(g, "llama.rope.freq_base", &hp->rope_freq_base, err);
    if (rc && rc != KVR_ENOTFOUND)
        return rc;
    hp->norm_eps = 1e-5f;
    rc = kvr_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &hp->norm_eps, err);
    if (rc && rc != KVR_ENOTFOUND)
        return rc;

    if (hp->n_layer == 0 || hp->n_layer > 4096 || hp->n_embd == 0 || hp->n_embd > 65536 ||
        hp->n_ff == 0 || hp->n_ff > 262144 || hp->n_head == 0 || hp->n_head_kv == 0)
        return kvr_err_set(err, KVR_EFORMAT, "model: implausible shape (layers %u, dim %u, "
                           "ff %u, heads %u/%u)", hp->n_layer, hp->n_embd, hp->n_ff,
                           hp->n_head, hp->n_head_kv);
    if (hp->n_embd % hp->n_head || hp->n_head % hp->n_head_kv ||
        hp->n_head / hp->n_head_kv > MAX_GROUP)
        return kvr_err_set(err, KVR_EFORMAT, "model: dim %u / heads %u / kv heads %u do not "
                           "divide", hp->n_embd, hp->n_head, hp->n_head_kv);
    hp->head_dim = hp->n_embd / hp->n_head;
    hp->n_rot = hp->head_dim;
    rc = kvr_gguf_get_u32(g, "llama.rope.dimension_count", &hp->n_rot, err);
    if (rc && rc != KVR_ENOTFOUND)
        return rc;
    if (hp->n_rot > hp->head_dim || hp->n_rot % 2 || hp->n_rot > MAX_ROT)
        return kvr_err_set(err, KVR_EFORMAT, "model: rope dimension %u invalid for head "
                           "dim %u", hp->n_rot, hp->head_dim);
    if (!(hp->rope_freq_base > 0.0f) || !(hp->norm_eps > 0.0f) || hp->norm_eps > 1.0f)
        return kvr_err_set(err, KVR_EFORMAT, "model: bad rope base or norm epsilon");

    const struct kvr_gguf_tensor *emb = kvr_gguf_find_tensor(g, "token_embd.weight");
    if (!emb)
        return kvr_err_set(err, KVR_EFORMAT, "model: missing tensor token_embd.weight");
    if (emb->n_dims != 2 || emb->ne[0] != hp->n_embd || emb->ne[1] < 1 ||
        emb->ne[1] > (1 << 22))
        return kvr_err_set(err, KVR_EFORMAT, "model: token_embd.weight has shape [%lld, %lld]"
                           ", expected [%u, n_vocab]", (long long)emb->ne[0],
                           (long long)emb->ne[1], hp->n_embd);
    hp->n_vocab = (uint32_t)emb->ne[1];
    return KVR_OK;
}

/* ---- weight views ---------------------------------------------------------------------- */

struct layer {
    const float *attn_norm;         /* [n_embd] */
    struct kvr_matrix wq;           /* [n_embd] -> [n_embd] */
    struct kvr_matrix wk, wv;       /* [n_embd] -> [kv_dim] */
    struct kvr_matrix wo;           /* [n_embd] -> [n_embd] */
    const float *ffn_norm;          /* [n_embd] */
    struct kvr_matrix w_gate, w_up; /* [n_embd] -> [n_ff] */
    struct kvr_matrix w_down;       /* [n_ff] -> [n_embd] */
};

static int view_matrix(const struct kvr_gguf *g, const char *name, int64_t n_in,
                       int64_t n_out, struct kvr_matrix *m, struct kvr_err *err)
{
    const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, name);
    if (!t)
        return kvr_err_set(err, KVR_EFORMAT, "model: missing tensor %s", name);
    if (t->n_dims != 2 || t->ne[0] != n_in || t->ne[1] != n_out)
        return kvr_err_set(err, KVR_EFORMAT, "model: tensor %s has shape [%lld, %lld], "
                           "expected [%lld, %lld]", name, (long long)t->ne[0],
                           (long long)t->ne[1], (long long)n_in, (long long)n_out);
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(t->type);
    size_t row_bytes;
    if (!tr || !tr->dot || !kvr_dtype_row_bytes(t->type, n_in, &row_bytes))
        return kvr_err_set(err, KVR_ENOTSUP, "model: tensor %s has unsupported type %d", name,
                           t->type);
    m->type = (enum kvr_dtype)t->type;
    m->n_in = n_in;
    m->n_out = n_out;
    m->row_bytes = row_bytes;
    m->data = t->data;
    return KVR_OK;
}

static int view_norm(const struct kvr_gguf *g, const char *name, int64_t n,
                     const float **out, struct kvr_err *err)
{
    const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, name);
    if (!t)
        return kvr_err_set(err, KVR_EFORMAT, "model: missing tensor %s", name);
    if (t->type != KVR_DTYPE_F32 || t->n_dims != 1 || t->ne[0] != n)
        return kvr_err_set(err, KVR_EFORMAT, "model: tensor %s must be f32 [%lld]", name,
                           (long long)n);
    if ((uintptr_t)t->data % sizeof(float))
        return kvr_err_set(err, KVR_EFORMAT, "model: tensor %s is not 4-byte aligned", name);
    *out = t->data;
    return KVR_OK;
}

static int view_layer(const struct kvr_gguf *g, const struct kvr_hparams *hp, uint32_t il,
                      struct layer *l, struct kvr_err *err)
{
    char name[96];
    int64_t d = hp->n_embd, kvd = (int64_t)hp->n_head_kv * hp->head_dim, ff = hp->n_ff;
    int rc;
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%u." suffix, il), name)
    if ((rc = view_norm(g, NAME("attn_norm.weight"), d, &l->attn_norm, err)) ||
        (rc = view_matrix(g, NAME("attn_q.weight"), d, d, &l->wq, err)) ||
        (rc = view_matrix(g, NAME("attn_k.weight"), d, kvd, &l->wk, err)) ||
        (rc = view_matrix(g, NAME("attn_v.weight"), d, kvd, &l->wv, err)) ||
        (rc = view_matrix(g, NAME("attn_output.weight"), d, d, &l->wo, err)) ||
        (rc = view_norm(g, NAME("ffn_norm.weight"), d, &l->ffn_norm, err)) ||
        (rc = view_matrix(g, NAME("ffn_gate.weight"), d, ff, &l->w_gate, err)) ||
        (rc = view_matrix(g, NAME("ffn_up.weight"), d, ff, &l->w_up, err)) ||
        (rc = view_matrix(g, NAME("ffn_down.weight"), ff, d, &l->w_down, err)))
        return rc;
#undef NAME
    return KVR_OK;
}

/* ---- the engine ------------------------------------------------------------------------ */

struct kvr_engine {
    struct kvr_hparams hp;
    struct kvr_engine_config cfg;
    uint32_t n_local;             /* layers in the slice */
    uint32_t kv_dim;              /* n_head_kv * head_dim */
    struct layer *layers;         /* [n_local] */
    struct kvr_matrix tok_embd;   /* head: [n_embd] x n_vocab rows */
    const float *output_norm;     /* tail: [n_embd] */
    struct kvr_matrix output;     /* tail: [n_embd] -> [n_vocab] (tok_embd when tied) */
    struct kvr_kv kv;
    struct kvr_pool *pool;
    struct kvr_attn_ops attn;     /* attention's inner loops, matching the kernel set */

    /* Scratch, all [max_rows x width] floats unless noted. */
    float *x;        /* residual stream, n_embd */
    float *xb;       /* normed input of a block, n_embd */
    float *q;        /* queries, n_embd */
    float *k;        /* keys of this batch, kv_dim */
    float *v;        /* values of this batch, kv_dim */
    float *att;      /* attention output, n_embd */
    float *gate;     /* n_ff */
    float *up;       /* n_ff */
    float *proj;     /* a matmul output added into x, n_embd */
    void *xq;        /* activation rows converted for the weights' dot type */
    float *scores;   /* per thread: n_ctx attention scores */
    uint32_t *row_seq; /* [max_rows] sequence of each row */
    uint32_t *row_pos; /* [max_rows] position of each row */
    uint32_t *logit_rows; /* [max_rows] rows whose logits the tail computes */
    /* Packed copies (kvr_matrix_pack) of the slice's Q8_0/Q4_0 matmul weights, read by the
     * batched kernels; NULL with KVR_NO_PACK=1. Costs about the slice's weight size again
     * (Q8_0 x 1.06, Q4_0 x 1.11), since decode still reads the mmapped weights. */
    void *packed;
};

const struct kvr_hparams *kvr_engine_hparams(const struct kvr_engine *e) { return &e->hp; }
bool kvr_engine_is_head(const struct kvr_engine *e) { return e->cfg.first_layer == 0; }
bool kvr_engine_is_tail(const struct kvr_engine *e)
{
    return e->cfg.last_layer + 1 == e->hp.n_layer;
}

static size_t max_act_row_bytes(const struct kvr_engine *e)
{
    size_t best = 0;
    for (uint32_t i = 0; i < e->n_local; i++) {
        const struct layer *l = &e->layers[i];
        const struct kvr_matrix *ms[] = {&l->wq, &l->wk, &l->wv, &l->wo,
                                         &l->w_gate, &l->w_up, &l->w_down};
        for (size_t j = 0; j < sizeof ms / sizeof ms[0]; j++) {
            size_t b = kvr_act_row_bytes(ms[j]->type, ms[j]->n_in);
            best = b > best ? b : best;
        }
    }
    if (kvr_engine_is_tail(e)) {
        size_t b = kvr_act_row_bytes(e->output.type, e->output.n_in);
        best = b > best ? b : best;
    }
    return best;
}

void kvr_engine_destroy(struct kvr_engine *e)
{
    if (!e)
        return;
    kvr_pool_destroy(e->pool);
    kvr_kv_fini(&e->kv);
    float *bufs[] = {e->x, e->xb, e->q, e->k, e->v, e->att, e->gate, e->up, e->proj,
                     e->scores};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        kvr_free(bufs[i]);
    kvr_free(e->xq);
    kvr_free(e->row_seq);
    kvr_free(e->row_pos);
    kvr_free(e->logit_rows);
    kvr_free(e->packed);
    kvr_free(e->layers);
    kvr_free(e);
}

/* Give every packable matmul weight of the slice a packed copy, all in one buffer. */
static int pack_weights(struct kvr_engine *e, struct kvr_err *err)
{
    const char *off = getenv("KVR_NO_PACK");
    if (off && strcmp(off, "1") == 0)
        return KVR_OK;
    size_t total = 0;
    for (int pass = 0; pass < 2; pass++) { /* 0: sum the sizes, 1: pack */
        size_t at = 0;
        for (uint32_t i = 0; i <= e->n_local; i++) {
            struct layer *l = &e->layers[i < e->n_local ? i : 0];
            struct kvr_matrix *layer_ms[] = {&l->wq, &l->wk, &l->wv, &l->wo,
                                             &l->w_gate, &l->w_up, &l->w_down};
            struct kvr_matrix *tail_ms[] = {&e->output};
            struct kvr_matrix **ms = i < e->n_local ? layer_ms : tail_ms;
            size_t n = i < e->n_local ? 7 : kvr_engine_is_tail(e) ? 1 : 0;
            for (size_t j = 0; j < n; j++) {
                size_t b = kvr_matrix_pack_bytes(ms[j]); /* a multiple of 32 */
                if (b && pass) {
                    kvr_matrix_pack(ms[j], (char *)e->packed + at);
                    ms[j]->packed = (char *)e->packed + at;
                }
                if (!kvr_add_size(at, b, &at))
                    return kvr_err_set(err, KVR_ENOMEM, "engine: packed weights too large");
            }
        }
        total = at;
        if (!total)
            return KVR_OK;
        if (!pass && !(e->packed = kvr_aligned_alloc(64, total)))
            return kvr_err_set(err, KVR_ENOMEM, "engine: cannot allocate %zu bytes of packed "
                               "weights", total);
    }
    return KVR_OK;
}

static float *alloc_rows(uint32_t rows, uint32_t width, int *failed)
{
    size_t n;
    if (!kvr_mul_size((size_t)rows, (size_t)width * sizeof(float), &n)) {
        *failed = 1;
        return NULL;
    }
    float *p = kvr_aligned_alloc(64, n);
    if (!p)
        *failed = 1;
    return p;
}

int kvr_engine_create(struct kvr_engine **out, const struct kvr_gguf *g,
                      const struct kvr_engine_config *cfg, struct kvr_err *err)
{
    *out = NULL;
    struct kvr_engine *e = kvr_calloc(1, sizeof *e);
    if (!e)
        return kvr_err_set(err, KVR_ENOMEM, "engine: out of memory");
    int rc = kvr_hparams_read(&e->hp, g, err);
    if (rc)
        goto fail;
    e->cfg = *cfg;
    const struct kvr_hparams *hp = &e->hp;
    if (cfg->first_layer > cfg->last_layer || cfg->last_layer >= hp->n_layer) {
        rc = kvr_err_set(err, KVR_ERANGE, "engine: layer range [%u, %u] outside the model's "
                         "%u layers", cfg->first_layer, cfg->last_layer, hp->n_layer);
        goto fail;
    }
    if (!cfg->max_rows || cfg->max_rows > 65536 || !cfg->max_seqs ||
        cfg->max_seqs > MAX_SEQS || !cfg->n_ctx ||
        !cfg->kv_block_tokens || !cfg->n_threads || cfg->n_threads > 256) {
        rc = kvr_err_set(err, KVR_EINVAL, "engine: row width, sequences, context, KV block "
                         "size and threads must be positive");
        goto fail;
    }
    e->n_local = cfg->last_layer - cfg->first_layer + 1;
    e->kv_dim = hp->n_head_kv * hp->head_dim;
    e->layers = kvr_calloc(e->n_local, sizeof *e->layers);
    if (!e->layers) {
        rc = kvr_err_set(err, KVR_ENOMEM, "engine: out of memory");
        goto fail;
    }
    for (uint32_t i = 0; i < e->n_local; i++)
        if ((rc = view_layer(g, hp, cfg->first_layer + i, &e->layers[i], err)))
            goto fail;
    if (kvr_engine_is_head(e) &&
        (rc = view_matrix(g, "token_embd.weight", hp->n_embd, hp->n_vocab, &e->tok_embd, err)))
        goto fail;
    if (kvr_engine_is_tail(e)) {
        if ((rc = view_norm(g, "output_norm.weight", hp->n_embd, &e->output_norm, err)))
            goto fail;
        const char *head = kvr_gguf_find_tensor(g, "output.weight") ? "output.weight"
                                                                     : "token_embd.weight";
        if ((rc = view_matrix(g, head, hp->n_embd, hp->n_vocab, &e->output, err)))
            goto fail;
    }
    if ((rc = pack_weights(e, err)))
        goto fail;

    uint32_t per_seq_blocks = (cfg->n_ctx + cfg->kv_block_tokens - 1) / cfg->kv_block_tokens;
    uint64_t n_blocks = cfg->kv_n_blocks ? cfg->kv_n_blocks
                                         : (uint64_t)per_seq_blocks * cfg->max_seqs;
    if (n_blocks > UINT32_MAX) {
        rc = kvr_err_set(err, KVR_ERANGE, "engine: too many KV blocks");
        goto fail;
    }
    if ((rc = kvr_kv_init(&e->kv, e->n_local, e->kv_dim, cfg->kv_block_tokens,
                          (uint32_t)n_blocks, cfg->max_seqs, cfg->n_ctx, err)))
        goto fail;

    int failed = 0;
    uint32_t R = cfg->max_rows;
    e->x = alloc_rows(R, hp->n_embd, &failed);
    e->xb = alloc_rows(R, hp->n_embd, &failed);
    e->q = alloc_rows(R, hp->n_embd, &failed);
    e->k = alloc_rows(R, e->kv_dim, &failed);
    e->v = alloc_rows(R, e->kv_dim, &failed);
    e->att = alloc_rows(R, hp->n_embd, &failed);
    e->gate = alloc_rows(R, hp->n_ff, &failed);
    e->up = alloc_rows(R, hp->n_ff, &failed);
    e->proj = alloc_rows(R, hp->n_embd, &failed);
    e->scores = alloc_rows(cfg->n_threads, cfg->n_ctx * (hp->n_head / hp->n_head_kv), &failed);
    size_t xq_bytes;
    if (!kvr_mul_size(R, max_act_row_bytes(e), &xq_bytes) ||
        !(e->xq = kvr_aligned_alloc(64, xq_bytes)))
        failed = 1;
    e->row_seq = kvr_calloc(R, sizeof *e->row_seq);
    e->row_pos = kvr_calloc(R, sizeof *e->row_pos);
    e->logit_rows = kvr_calloc(R, sizeof *e->logit_rows);
    if (failed || !e->row_seq || !e->row_pos || !e->logit_rows) {
        rc = kvr_err_set(err, KVR_ENOMEM, "engine: cannot allocate scratch for %u rows", R);
        goto fail;
    }
    const char *kernels = kvr_kernels_init();
    e->attn = strcmp(kernels, "avx2") == 0 ? kvr_attn_ops_avx2 : kvr_attn_ops_plain;
    if (!(e->pool = kvr_pool_create((int)cfg->n_threads))) {
        rc = kvr_err_set(err, KVR_ENOMEM, "engine: cannot start %u threads", cfg->n_threads);
        goto fail;
    }
    *out = e;
    return KVR_OK;

fail:
    kvr_engine_destroy(e);
    return rc;
}

void kvr_engine_seq_free(struct kvr_engine *e, uint32_t seq) { kvr_kv_free_seq(&e->kv, seq); }

void kvr_engine_kv_usage(const struct kvr_engine *e, uint32_t *used, uint32_t *total)
{
    *total = e->kv.n_blocks;
    *used = e->kv.n_blocks - e->kv.n_free;
}

int kvr_engine_check(const struct kvr_engine *e, const struct kvr_seg *segs, uint32_t n_segs,
                     uint32_t *n_rows, uint32_t *n_logit_rows, struct kvr_err *err)
{
    uint64_t rows = 0;
    uint32_t logits = 0;
    uint64_t seen[MAX_SEQS / 64] = {0}; /* one bit per sequence slot */
    for (uint32_t i = 0; i < n_segs; i++) {
        const struct kvr_seg *s = &segs[i];
        if (s->seq >= e->cfg.max_seqs)
            return kvr_err_set(err, KVR_ERANGE, "batch: segment %u names sequence %u, "
                               "beyond %u slots", i, s->seq, e->cfg.max_seqs);
        if (s->n_tokens == 0)
            return kvr_err_set(err, KVR_EINVAL, "batch: segment %u is empty", i);
        if ((uint64_t)s->pos0 + s->n_tokens > e->cfg.n_ctx)
            return kvr_err_set(err, KVR_ERANGE, "batch: segment %u ends at position %llu, "
                               "beyond the context of %u", i,
                               (unsigned long long)s->pos0 + s->n_tokens, e->cfg.n_ctx);
        if (s->flags >> KVR_SEG_FLAG_COUNT)
            return kvr_err_set(err, KVR_EINVAL, "batch: segment %u has unknown flags 0x%x", i,
                               s->flags);
        uint64_t bit = 1ull << (s->seq % 64);
        if (seen[s->seq / 64] & bit)
            return kvr_err_set(err, KVR_EINVAL, "batch: sequence %u appears twice", s->seq);
        seen[s->seq / 64] |= bit;
        rows += s->n_tokens;
        logits += (s->flags & KVR_SEG_WANTS_TOKEN) ? 1 : 0;
    }
    if (rows == 0 || rows > e->cfg.max_rows)
        return kvr_err_set(err, KVR_ERANGE, "batch: %llu rows, the row width is %u",
                           (unsigned long long)rows, e->cfg.max_rows);
    *n_rows = (uint32_t)rows;
    *n_logit_rows = logits;
    return KVR_OK;
}

/* ---- parallel matmul -------------------------------------------------------------------- */

enum { MAX_FUSED = 3 };

/* Multiply-adds below which a job runs on the calling thread alone (~20 us of work). */
#define SMALL_WORK (256.0 * 1024)

/* Up to three matmuls sharing one converted activation (Q/K/V, or gate/up), run in one
 * pool dispatch. Each thread takes the same fraction of every matrix's output rows. */
struct mm_job {
    int n;
    const struct kvr_matrix *w[MAX_FUSED];
    float *y[MAX_FUSED];
    const void *xq;
    int64_t n_rows;
};

/* Output rows are split in multiples of 16 so SIMD tiles stay whole. */
static void split_out(int64_t n_out, int ith, int nth, int64_t *b, int64_t *e)
{
    long chunks = (long)((n_out + 15) / 16), cb, ce;
    kvr_split_range(chunks, ith, nth, &cb, &ce);
    *b = cb * 16;
    *e = ce * 16 < n_out ? ce * 16 : n_out;
}

static void mm_worker(void *arg, int ith, int nth)
{
    const struct mm_job *job = arg;
    for (int i = 0; i < job->n; i++) {
        int64_t b, e;
        split_out(job->w[i]->n_out, ith, nth, &b, &e);
        if (b < e)
            kvr_matmul(job->w[i], job->xq, job->n_rows, job->y[i], job->w[i]->n_out, b, e);
    }
}

struct quant_job {
    enum kvr_dtype type;
    const float *x;
    int64_t n_in;
    int64_t n_rows;
    void *dst;
};

static void quant_worker(void *arg, int ith, int nth)
{
    const struct quant_job *job = arg;
    long b, e;
    kvr_split_range((long)job->n_rows, ith, nth, &b, &e);
    if (b < e)
        kvr_quantize_rows(job->type, job->x, job->n_in, b, e, job->dst);
}

/* y_i = x . W_i for the given matrices (all with the same input width and type). */
static void matmuls(struct kvr_engine *e, const float *x, uint32_t n_rows, int n,
                    const struct kvr_matrix *const *w, float *const *y)
{
    struct quant_job qj = {w[0]->type, x, w[0]->n_in, n_rows, e->xq};
    if ((double)n_rows * w[0]->n_in * 8 >= SMALL_WORK)
        kvr_pool_run(e->pool, quant_worker, &qj);
    else
        quant_worker(&qj, 0, 1);
    struct mm_job job = {.n = n, .xq = e->xq, .n_rows = n_rows};
    double work = 0;
    for (int i = 0; i < n; i++) {
        job.w[i] = w[i];
        job.y[i] = y[i];
        work += (double)w[i]->n_in * w[i]->n_out * n_rows;
    }
    /* Waking the pool costs microseconds; a small product is cheaper on one thread. */
    if (work < SMALL_WORK)
        mm_worker(&job, 0, 1);
    else /* several chunks per thread: a thread that stalls holds up only a small one */
        kvr_pool_run_chunks(e->pool, mm_worker, &job, 4 * kvr_pool_size(e->pool));
}

static void matmul1(struct kvr_engine *e, const float *x, uint32_t n_rows,
                    const struct kvr_matrix *w, float *y)
{
    matmuls(e, x, n_rows, 1, &w, &y);
}

/* ---- row operations --------------------------------------------------------------------- */

static void rmsnorm(float *out, const float *x, const float *w, uint32_t n, float eps)
{
    double ss = 0.0;
    for (uint32_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / n) + eps);
    for (uint32_t i = 0; i < n; i++)
        out[i] = x[i] * scale * w[i];
}

/* Rotary embedding of one head vector in place ("normal" llama mode: adjacent pairs). */
static void rope(float *vec, uint32_t n_rot, const float *cos_t, const float *sin_t)
{
    for (uint32_t i = 0; i < n_rot / 2; i++) {
        float x0 = vec[2 * i], x1 = vec[2 * i + 1];
        vec[2 * i] = x0 * cos_t[i] - x1 * sin_t[i];
        vec[2 * i + 1] = x0 * sin_t[i] + x1 * cos_t[i];
    }
}

static void rope_tables(float *cos_t, float *sin_t, uint32_t n_rot, uint32_t pos, float base)
{
    float theta_scale = powf(base, -2.0f / (float)n_rot);
    float theta = (float)pos;
    for (uint32_t i = 0; i < n_rot / 2; i++) {
        cos_t[i] = cosf(theta);
        sin_t[i] = sinf(theta);
        theta *= theta_scale;
    }
}

/* ---- attention ---------------------------------------------------------------------------- */

struct rope_job {
    struct kvr_engine *e;
    uint32_t n_rows;
    uint32_t layer; /* local layer index */
};

/* Apply rope to q and k of each row, then store k and v into the cache. */
static void rope_store_worker(void *arg, int ith, int nth)
{
    const struct rope_job *job = arg;
    struct kvr_engine *e = job->e;
    const struct kvr_hparams *hp = &e->hp;
    float cos_t[MAX_ROT / 2], sin_t[MAX_ROT / 2];
    long b, end;
    kvr_split_range((long)job->n_rows, ith, nth, &b, &end);
    for (long r = b; r < end; r++) {
        uint32_t pos = e->row_pos[r], seq = e->row_seq[r];
        rope_tables(cos_t, sin_t, hp->n_rot, pos, hp->rope_freq_base);
        for (uint32_t h = 0; h < hp->n_head; h++)
            rope(e->q + (size_t)r * hp->n_embd + h * hp->head_dim, hp->n_rot, cos_t, sin_t);
        float *k = e->k + (size_t)r * e->kv_dim;
        for (uint32_t h = 0; h < hp->n_head_kv; h++)
            rope(k + h * hp->head_dim, hp->n_rot, cos_t, sin_t);
        memcpy(kvr_kv_row(&e->kv, e->kv.k, job->layer, seq, pos), k,
               e->kv_dim * sizeof(float));
        memcpy(kvr_kv_row(&e->kv, e->kv.v, job->layer, seq, pos),
               e->v + (size_t)r * e->kv_dim, e->kv_dim * sizeof(float));
    }
}

/* Each (row, KV head) pair is one unit of work: causal attention of the row's query heads
 * that share that KV head, against its own sequence's cached keys and values at positions
 * 0..pos, walked block by block. Every query head's scores, softmax and weighted sum are
 * computed in the same order whatever the batch, so the result is batch invariant. */
static void attention_worker(void *arg, int ith, int nth)
{
    const struct rope_job *job = arg;
    struct kvr_engine *e = job->e;
    const struct kvr_hparams *hp = &e->hp;
    const struct kvr_kv *kv = &e->kv;
    const uint32_t hd = hp->head_dim, group = hp->n_head / hp->n_head_kv;
    const uint32_t bt = kv->block_tokens;
    const float scale = 1.0f / sqrtf((float)hd);
    float *scores = e->scores + (size_t)ith * e->cfg.n_ctx * group; /* [group][n_ctx] */
    long b, end;
    kvr_split_range((long)job->n_rows * hp->n_head_kv, ith, nth, &b, &end);
    for (long u = b; u < end; u++) {
        uint32_t r = (uint32_t)(u / hp->n_head_kv), kvh = (uint32_t)(u % hp->n_head_kv);
        uint32_t seq = e->row_seq[r], n_pos = e->row_pos[r] + 1;
        const uint32_t *table = kv->tables + (size_t)seq * kv->max_blocks_per_seq;
        const float *q0 = e->q + (size_t)r * hp->n_embd + (size_t)kvh * group * hd;
        const size_t stride = e->cfg.n_ctx;
        for (uint32_t t0 = 0; t0 < n_pos; t0 += bt) {
            size_t base = ((size_t)job->layer * kv->n_blocks + table[t0 / bt]) * bt;
            uint32_t n = n_pos - t0 < bt ? n_pos - t0 : bt;
            e->attn.scores(scores + t0, stride, q0, group, hd,
                           kv->k + base * kv->kv_dim + (size_t)kvh * hd, kv->kv_dim, n, scale);
        }
        for (uint32_t g = 0; g < group; g++)
            e->attn.softmax(scores + g * stride, n_pos);
        float *out0 = e->att + (size_t)r * hp->n_embd + (size_t)kvh * group * hd;
        memset(out0, 0, (size_t)group * hd * sizeof(float));
        for (uint32_t t0 = 0; t0 < n_pos; t0 += bt) {
            size_t base = ((size_t)job->layer * kv->n_blocks + table[t0 / bt]) * bt;
            uint32_t n = n_pos - t0 < bt ? n_pos - t0 : bt;
            e->attn.mix(out0, scores + t0, stride, group, hd,
                        kv->v + base * kv->kv_dim + (size_t)kvh * hd, kv->kv_dim, n);
        }
    }
}

/* ---- the forward pass --------------------------------------------------------------------- */

struct rows_job {
    struct kvr_engine *e;
    uint32_t n_rows;
    const float *norm_w; /* rmsnorm weights, or NULL for the SwiGLU step */
    const float *in;
    float *out;
};

static void rmsnorm_worker(void *arg, int ith, int nth)
{
    const struct rows_job *job = arg;
    uint32_t d = job->e->hp.n_embd;
    long b, end;
    kvr_split_range((long)job->n_rows, ith, nth, &b, &end);
    for (long r = b; r < end; r++)
        rmsnorm(job->out + (size_t)r * d, job->in + (size_t)r * d, job->norm_w, d,
                job->e->hp.norm_eps);
}

static void swiglu_worker(void *arg, int ith, int nth)
{
    const struct rows_job *job = arg;
    struct kvr_engine *e = job->e;
    size_t n = (size_t)job->n_rows * e->hp.n_ff;
    long b, end;
    kvr_split_range((long)n, ith, nth, &b, &end);
    e->attn.swiglu(e->gate + b, e->up + b, (size_t)(end - b));
}

static void add_rows(float *x, const float *y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] += y[i];
}

/* Row-wise jobs over n_values values in all: parallel only when large enough to pay for
 * waking the pool. */
static void run_rows(struct kvr_engine *e, kvr_pool_fn fn, void *job, double n_values)
{
    if (n_values * 8 >= SMALL_WORK)
        kvr_pool_run(e->pool, fn, job);
    else
        fn(job, 0, 1);
}

static void layer_forward(struct kvr_engine *e, uint32_t il, uint32_t n_rows)
{
    const struct kvr_hparams *hp = &e->hp;
    const struct layer *l = &e->layers[il];
    size_t n_x = (size_t)n_rows * hp->n_embd;

    struct rows_job norm = {e, n_rows, l->attn_norm, e->x, e->xb};
    run_rows(e, rmsnorm_worker, &norm, (double)n_x);
    const struct kvr_matrix *qkv_w[3] = {&l->wq, &l->wk, &l->wv};
    float *qkv_y[3] = {e->q, e->k, e->v};
    if (l->wq.type == l->wk.type && l->wq.type == l->wv.type) {
        matmuls(e, e->xb, n_rows, 3, qkv_w, qkv_y);
    } else {
        for (int i = 0; i < 3; i++)
            matmul1(e, e->xb, n_rows, qkv_w[i], qkv_y[i]);
    }

    struct rope_job aj = {e, n_rows, il};
    run_rows(e, rope_store_worker, &aj, (double)n_x);
    double att_work = 0;
    for (uint32_t r = 0; r < n_rows; r++)
        att_work += (double)(e->row_pos[r] + 1) * hp->n_embd * 2;
    if (att_work < SMALL_WORK)
        attention_worker(&aj, 0, 1);
    else
        kvr_pool_run(e->pool, attention_worker, &aj);
    matmul1(e, e->att, n_rows, &l->wo, e->proj);
    add_rows(e->x, e->proj, n_x);

    norm.norm_w = l->ffn_norm;
    run_rows(e, rmsnorm_worker, &norm, (double)n_x);
    const struct kvr_matrix *ffn_w[2] = {&l->w_gate, &l->w_up};
    float *ffn_y[2] = {e->gate, e->up};
    if (l->w_gate.type == l->w_up.type) {
        matmuls(e, e->xb, n_rows, 2, ffn_w, ffn_y);
    } else {
        matmul1(e, e->xb, n_rows, ffn_w[0], ffn_y[0]);
        matmul1(e, e->xb, n_rows, ffn_w[1], ffn_y[1]);
    }
    struct rows_job act = {e, n_rows, NULL, NULL, NULL};
    run_rows(e, swiglu_worker, &act, (double)n_rows * hp->n_ff);
    matmul1(e, e->gate, n_rows, &l->w_down, e->proj);
    add_rows(e->x, e->proj, n_x);
}

int kvr_engine_forward(struct kvr_engine *e, const struct kvr_seg *segs, uint32_t n_segs,
                       const int32_t *tokens, const float *hidden_in, float *out,
                       struct kvr_err *err)
{
    const struct kvr_hparams *hp = &e->hp;
    uint32_t n_rows, n_logits;
    int rc = kvr_engine_check(e, segs, n_segs, &n_rows, &n_logits, err);
    if (rc)
        return rc;
    if (kvr_engine_is_head(e)) {
        for (uint32_t r = 0; r < n_rows; r++)
            if (tokens[r] < 0 || (uint32_t)tokens[r] >= hp->n_vocab)
                return kvr_err_set(err, KVR_ERANGE, "batch: token id %d at row %u outside "
                                   "the vocabulary of %u", tokens[r], r, hp->n_vocab);
    }
    /* Reserve KV for every segment before computing anything, so a full cache fails the
     * batch cleanly instead of half-way through. Earlier segments' reservations stay (the
     * caller frees or retries those sequences). */
    for (uint32_t i = 0; i < n_segs; i++)
        if ((rc = kvr_kv_prepare(&e->kv, segs[i].seq, segs[i].pos0, segs[i].n_tokens, err)))
            return rc;

    uint32_t r = 0, n_want = 0;
    for (uint32_t i = 0; i < n_segs; i++) {
        for (uint32_t t = 0; t < segs[i].n_tokens; t++, r++) {
            e->row_seq[r] = segs[i].seq;
            e->row_pos[r] = segs[i].pos0 + t;
        }
        if (segs[i].flags & KVR_SEG_WANTS_TOKEN)
            e->logit_rows[n_want++] = r - 1;
    }

    size_t n_x = (size_t)n_rows * hp->n_embd;
    if (kvr_engine_is_head(e)) {
        for (r = 0; r < n_rows; r++)
            kvr_matrix_get_row(&e->tok_embd, tokens[r], e->x + (size_t)r * hp->n_embd);
    } else {
        memcpy(e->x, hidden_in, n_x * sizeof(float));
    }

    for (uint32_t il = 0; il < e->n_local; il++)
        layer_forward(e, il, n_rows);

    if (!kvr_engine_is_tail(e)) {
        memcpy(out, e->x, n_x * sizeof(float));
        return KVR_OK;
    }
    if (n_want == 0)
        return KVR_OK;
    for (uint32_t i = 0; i < n_want; i++)
        rmsnorm(e->xb + (size_t)i * hp->n_embd, e->x + (size_t)e->logit_rows[i] * hp->n_embd,
                e->output_norm, hp->n_embd, hp->norm_eps);
    matmul1(e, e->xb, n_want, &e->output, out);
    return KVR_OK;
}
