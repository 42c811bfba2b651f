/* engine.c - the forward pass of a layer slice over a micro-batch of rows, for every
 * architecture of arch.h's table.
 *
 * Reading order: weight views, create/destroy, then the forward pass in the order the data
 * flows (embed -> per layer: attention block, feed-forward block -> final norm and output
 * head). The architecture only switches steps on and off (a bias, a q/k norm, a post-norm,
 * the window of a sliding layer) and picks the activation and RoPE pairing; there is one
 * pass for all. Every tensor scratch buffer is sized at create from the row width; the
 * forward pass allocates nothing.
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
#include "model/matmul_pool.h"
#include "model/mla.h"
#include "model/moe.h"
#include "model/nextn.h"

#include <math.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

enum {
    MAX_SEQS = 65536, /* most sequence slots an engine serves */
    MAX_ROT = 1024,   /* most rotary dimensions per head (arch.c checks it) */
};

/* ---- weight views ---------------------------------------------------------------------- */

/* A layer's weights; vectors are NULL and matrices have data NULL when the architecture
 * has no such tensor. A fused tensor (phi3's attn_qkv and ffn_up) is viewed as its parts:
 * row ranges of one matrix are matrices themselves, so the pass never sees the fusion. */
struct layer {
    const float *attn_norm;         /* [n_embd] */
    struct kvr_matrix wq;           /* [n_embd] -> [q_dim] */
    struct kvr_matrix wk, wv;       /* [n_embd] -> [kv_dim] */
    const float *bq, *bk, *bv;      /* biases [q_dim], [kv_dim], [kv_dim] */
    const float *q_norm, *k_norm;   /* per-head RMSNorm weights [head_dim] */
    struct kvr_matrix wo;           /* [q_dim] -> [n_embd] */
    const float *attn_post_norm;    /* [n_embd], applied to the block's output */
    const float *ffn_norm;          /* [n_embd] */
    struct kvr_matrix w_gate, w_up; /* [n_embd] -> [n_ff] */
    struct kvr_matrix w_down;       /* [n_ff] -> [n_embd] */
    const float *ffn_post_norm;     /* [n_embd] */
    struct kvr_moe_layer moe;       /* router and experts, when hp.moe.n_expert > 0 */
    struct kvr_mla_layer mla;       /* latent attention, when hp.mla.kv_lora_rank > 0 */
    bool swa;                       /* attends to the last n_swa positions only */
    float rope_base;                /* this layer's RoPE base */
    float rope_scale;               /* and position scale (1 on sliding layers) */
};

static int view_matrix(const struct kvr_gguf *g, const char *name, int64_t n_in, int64_t n_out,
                       struct kvr_matrix *m, struct kvr_err *err)
{
    const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, name);
    if (!t)
        return kvr_err_set(err, KVR_EFORMAT, "model: missing tensor %s", name);
    if (t->n_dims != 2 || t->ne[0] != n_in || t->ne[1] != n_out)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: tensor %s has shape [%lld, %lld], "
                           "expected [%lld, %lld]",
                           name, (long long)t->ne[0], (long long)t->ne[1], (long long)n_in,
                           (long long)n_out);
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(t->type);
    size_t row_bytes;
    if (!tr || !tr->dot || !kvr_dtype_is_weight(t->type) ||
        !kvr_dtype_row_bytes(t->type, n_in, &row_bytes))
        return kvr_err_set(err, KVR_ENOTSUP, "model: tensor %s has unsupported type %d", name,
                           t->type);
    m->type = (enum kvr_dtype)t->type;
    m->n_in = n_in;
    m->n_out = n_out;
    m->row_bytes = row_bytes;
    m->data = t->data;
    return KVR_OK;
}

static int view_norm(const struct kvr_gguf *g, const char *name, int64_t n, const float **out,
                     struct kvr_err *err)
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

/* Rows [first, first + n) of a matrix, as a matrix. */
static struct kvr_matrix sub_rows(const struct kvr_matrix *m, int64_t first, int64_t n)
{
    struct kvr_matrix s = *m;
    s.n_out = n;
    s.data = (const char *)m->data + (size_t)first * m->row_bytes;
    return s;
}

static int view_layer(const struct kvr_gguf *g, const struct kvr_hparams *hp, uint32_t il,
                      struct layer *l, struct kvr_err *err)
{
    const struct kvr_arch *a = hp->arch;
    struct kvr_matrix qkv = {0}, up = {0};
    /* Where each of the table's tensors goes: matrices and vectors (norms, biases). */
    struct kvr_matrix *mats[KVR_LT_COUNT] = {
        [KVR_LT_ATTN_Q] = &l->wq, [KVR_LT_ATTN_K] = &l->wk,      [KVR_LT_ATTN_V] = &l->wv,
        [KVR_LT_ATTN_QKV] = &qkv, [KVR_LT_ATTN_OUT] = &l->wo,    [KVR_LT_FFN_GATE] = &l->w_gate,
        [KVR_LT_FFN_UP] = &up,    [KVR_LT_FFN_DOWN] = &l->w_down};
    const float **vecs[KVR_LT_COUNT] = {[KVR_LT_ATTN_NORM] = &l->attn_norm,
                                        [KVR_LT_ATTN_Q_BIAS] = &l->bq,
                                        [KVR_LT_ATTN_K_BIAS] = &l->bk,
                                        [KVR_LT_ATTN_V_BIAS] = &l->bv,
                                        [KVR_LT_ATTN_Q_NORM] = &l->q_norm,
                                        [KVR_LT_ATTN_K_NORM] = &l->k_norm,
                                        [KVR_LT_ATTN_POST_NORM] = &l->attn_post_norm,
                                        [KVR_LT_FFN_NORM] = &l->ffn_norm,
                                        [KVR_LT_FFN_POST_NORM] = &l->ffn_post_norm};
    char name[96];
    for (int t = 0; t < KVR_LT_COUNT; t++) {
        if (!kvr_hparams_layer_has(hp, il, (enum kvr_lt)t))
            continue;
        snprintf(name, sizeof name, "blk.%u.%s", il, kvr_arch_lt_name(a, (enum kvr_lt)t));
        if ((a->optional & KVR_LT_BIT(t)) && !kvr_gguf_find_tensor(g, name))
            continue;
        int64_t ne0, ne1;
        kvr_lt_shape(hp, (enum kvr_lt)t, &ne0, &ne1);
        int rc = ne1 ? view_matrix(g, name, ne0, ne1, mats[t], err)
                     : view_norm(g, name, ne0, vecs[t], err);
        if (rc)
            return rc;
    }
    if (!l->q_norm != !l->k_norm) /* optional (glm4moe), but as a pair */
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: layer %u has only one of attn_q_norm and "
                           "attn_k_norm",
                           il);
    if (qkv.data) {
        l->wq = sub_rows(&qkv, 0, hp->q_dim);
        l->wk = sub_rows(&qkv, hp->q_dim, hp->kv_dim);
        l->wv = sub_rows(&qkv, hp->q_dim + hp->kv_dim, hp->kv_dim);
    }
    if (a->fused_gate_up) {
        l->w_gate = sub_rows(&up, 0, hp->n_ff);
        l->w_up = sub_rows(&up, hp->n_ff, hp->n_ff);
    } else {
        l->w_up = up;
    }
    int rc;
    if (kvr_hparams_layer_moe(hp, il) &&
        (rc = kvr_moe_layer_view(&l->moe, g, il, hp->n_embd, &hp->moe, err)))
        return rc;
    if (hp->mla.kv_lora_rank && (rc = kvr_mla_layer_view(&l->mla, g, hp, il, err)))
        return rc;
    l->swa = kvr_hparams_layer_swa(hp, il);
    l->rope_base = l->swa ? hp->rope_base_swa : hp->rope_freq_base;
    l->rope_scale = l->swa ? 1.0f : hp->rope_freq_scale;
    return KVR_OK;
}

/* ---- the engine ------------------------------------------------------------------------ */

struct kvr_engine {
    struct kvr_hparams hp;
    struct kvr_engine_config cfg;
    uint32_t n_local;           /* layers in the slice */
    struct layer *layers;       /* [n_local] */
    struct kvr_matrix tok_embd; /* head: [n_embd] x n_vocab rows */
    const float *output_norm;   /* tail: [n_embd] */
    struct kvr_matrix output;   /* tail: [n_embd] -> [n_vocab] (tok_embd when tied) */
    struct kvr_kv kv;
    struct kvr_pool *pool;
    struct kvr_attn_ops attn;         /* attention's inner loops, matching the kernel set */
    struct kvr_moe_work *moe;         /* the expert feed-forward's scratch (MoE models) */
    kvr_moe_dispatch_fn moe_dispatch; /* NULL: every expert computed here */
    void *moe_dispatch_ctx;
    struct kvr_mla_work *mla; /* latent attention's scratch (deepseek2) */

    /* Scratch, all [max_rows x width] floats unless noted. */
    float *x;             /* residual stream, n_embd */
    float *xb;            /* normed input of a block, n_embd */
    float *q;             /* queries, q_dim */
    float *k;             /* keys of this batch, kv_dim */
    float *v;             /* values of this batch, kv_dim */
    float *att;           /* attention output, q_dim */
    float *gate;          /* n_ff */
    float *up;            /* n_ff */
    float *proj;          /* a matmul output added into x, n_embd */
    void *xq;             /* activation rows converted for the weights' dot type */
    float *scores;        /* per thread: n_ctx attention scores */
    float *kv_f32;        /* per thread: block_tokens x head_dim values of one KV head read
                           * back from a q8_0 cache (NULL for f32 and f16, read in place) */
    uint32_t *row_seq;    /* [max_rows] sequence of each row */
    uint32_t *row_pos;    /* [max_rows] position of each row */
    uint32_t *logit_rows; /* [max_rows] rows whose logits the tail computes */
    /* Packed copies (kvr_matrix_pack) of the slice's matmul weights; NULL with the no_pack
     * option. They serve every path, so the mapped pages are released (kvr_gguf_release) and
     * the copy replaces them (as many bytes as the file's, the last tile padded). */
    void *packed;
};

const struct kvr_hparams *kvr_engine_hparams(const struct kvr_engine *e)
{
    return &e->hp;
}
bool kvr_engine_is_head(const struct kvr_engine *e)
{
    return e->cfg.first_layer == 0;
}
bool kvr_engine_is_tail(const struct kvr_engine *e)
{
    return e->cfg.last_layer + 1 == e->hp.n_layer;
}

static size_t max_act_row_bytes(const struct kvr_engine *e)
{
    size_t best = 0;
    for (uint32_t i = 0; i < e->n_local; i++) {
        const struct layer *l = &e->layers[i];
        const struct kvr_matrix *ms[] = {&l->wq,     &l->wk,   &l->wv,    &l->wo,
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
    kvr_moe_work_destroy(e->moe);
    kvr_mla_work_destroy(e->mla);
    for (uint32_t i = 0; e->layers && i < e->n_local; i++)
        kvr_mla_layer_fini(&e->layers[i].mla);
    kvr_kv_fini(&e->kv);
    float *bufs[] = {e->x,    e->xb, e->q,    e->k,      e->v,     e->att,
                     e->gate, e->up, e->proj, e->scores, e->kv_f32};
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

/* Written by kvr_model_configure at start-up, before any engine exists. */
static bool g_no_pack;

void kvr_model_configure(const struct kvr_model_options *opt)
{
    kvr_kernels_configure(opt ? &opt->kernels : NULL);
    g_no_pack = opt && opt->no_pack;
}

static bool packing_on(void)
{
    return !g_no_pack;
}

/* The buffer of the packed copies. A large one is 2 MiB aligned and advised
 * MADV_HUGEPAGE before its first touch (kvr_matrix_pack writes it), so that where
 * transparent huge pages are enabled ("madvise" or "always") decode streams its weights
 * through 2 MiB pages: fewer TLB misses (bench_bandwidth --huge 1 measures the gain). The
 * rounding up to whole 2 MiB pages adds at most 2 MiB, so copies under 64 MiB keep ordinary
 * pages. Without THP the advice is a no-op; bench_forward prints AnonHugePages. */
static void *alloc_packed(size_t bytes)
{
    const size_t huge = (size_t)2 << 20;
    if (bytes < 32 * huge)
        return kvr_aligned_alloc(64, bytes);
    size_t rounded = (bytes + huge - 1) & ~(huge - 1);
    void *p = kvr_aligned_alloc(huge, rounded);
    if (p)
        (void)madvise(p, rounded, MADV_HUGEPAGE); /* advice: failure changes nothing */
    return p;
}

/* Give every packable matmul weight of the slice a packed copy, all in one buffer. */
static int pack_weights(struct kvr_engine *e, const struct kvr_gguf *g, struct kvr_err *err)
{
    if (!packing_on())
        return KVR_OK;
    size_t total = 0;
    for (int pass = 0; pass < 2; pass++) { /* 0: sum the sizes, 1: pack */
        size_t at = 0;
        for (uint32_t i = 0; i <= e->n_local; i++) {
            struct layer *l = &e->layers[i < e->n_local ? i : 0];
            struct kvr_matrix *layer_ms[] = {&l->wq,       &l->wk,     &l->wv,       &l->wo,
                                             &l->w_gate,   &l->w_up,   &l->w_down,   &l->mla.wq_a,
                                             &l->mla.wq_b, &l->mla.wq, &l->mla.wkv_a};
            struct kvr_matrix *tail_ms[] = {&e->output};
            struct kvr_matrix **ms = i < e->n_local ? layer_ms : tail_ms;
            size_t n = i < e->n_local ? 11 : kvr_engine_is_tail(e) ? 1 : 0;
            for (size_t j = 0; j < n; j++) {
                size_t b = kvr_matrix_pack_bytes(ms[j]); /* a multiple of 32 */
                if (b && pass) {
                    kvr_matrix_pack(ms[j], (char *)e->packed + at);
                    ms[j]->packed = (char *)e->packed + at;
                    if (kvr_matrix_packed_only(ms[j]))
                        kvr_gguf_release(g, ms[j]->data, (size_t)ms[j]->n_out * ms[j]->row_bytes);
                }
                if (!kvr_add_size(at, b, &at))
                    return kvr_err_set(err, KVR_ENOMEM, "engine: packed weights too large");
            }
        }
        total = at;
        if (!total)
            return KVR_OK;
        if (!pass && !(e->packed = alloc_packed(total)))
            return kvr_err_set(err, KVR_ENOMEM,
                               "engine: cannot allocate %zu bytes of packed "
                               "weights",
                               total);
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

/* The configuration checks and the views of the slice's tensors (no allocation beyond the
 * engine struct and its layer table). */
static int engine_views(struct kvr_engine **out, const struct kvr_gguf *g,
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
        rc = kvr_err_set(err, KVR_ERANGE,
                         "engine: layer range [%u, %u] outside the model's "
                         "%u layers",
                         cfg->first_layer, cfg->last_layer, hp->n_layer);
        goto fail;
    }
    if (!cfg->max_rows || cfg->max_rows > 65536 || !cfg->max_seqs || cfg->max_seqs > MAX_SEQS ||
        !cfg->n_ctx || !cfg->kv_block_tokens || !cfg->n_threads || cfg->n_threads > 256) {
        rc = kvr_err_set(err, KVR_EINVAL,
                         "engine: row width, sequences, context, KV block "
                         "size and threads must be positive");
        goto fail;
    }
    e->n_local = cfg->last_layer - cfg->first_layer + 1;
    e->layers = kvr_calloc(e->n_local, sizeof *e->layers);
    if (!e->layers) {
        rc = kvr_err_set(err, KVR_ENOMEM, "engine: out of memory");
        goto fail;
    }
    for (uint32_t i = 0; i < e->n_local; i++)
        if ((rc = view_layer(g, hp, cfg->first_layer + i, &e->layers[i], err)))
            goto fail;
    for (uint32_t j = 0; j < hp->n_nextn; j++) { /* checked as llama.cpp does, never run */
        struct layer nextn = {0};
        if ((rc = view_layer(g, hp, hp->n_layer + j, &nextn, err)) ||
            (rc = kvr_nextn_check(g, hp, hp->n_layer + j, err)))
            goto fail;
    }
    if (kvr_engine_is_head(e) &&
        (rc = view_matrix(g, "token_embd.weight", hp->n_embd, hp->n_vocab, &e->tok_embd, err)))
        goto fail;
    if (kvr_engine_is_tail(e)) {
        if ((rc = view_norm(g, "output_norm.weight", hp->n_embd, &e->output_norm, err)))
            goto fail;
        const char *head =
            kvr_gguf_find_tensor(g, "output.weight") ? "output.weight" : "token_embd.weight";
        if ((rc = view_matrix(g, head, hp->n_embd, hp->n_vocab, &e->output, err)))
            goto fail;
    }
    *out = e;
    return KVR_OK;

fail:
    kvr_engine_destroy(e);
    return rc;
}

/* Bytes of the activation scratch kvr_engine_create allocates (MoE work excluded). */
static size_t scratch_bytes(const struct kvr_engine *e)
{
    const struct kvr_hparams *hp = &e->hp;
    const struct kvr_engine_config *cfg = &e->cfg;
    uint64_t R = cfg->max_rows, f = sizeof(float);
    uint64_t n =
        R * f * (3ull * hp->n_embd + 2ull * hp->q_dim + 2ull * hp->kv_dim + 2ull * hp->n_ff);
    n += (uint64_t)cfg->n_threads * cfg->n_ctx * (hp->n_head / hp->n_head_kv) * f;
    if (cfg->kv_type != KVR_DTYPE_F32)
        n += (uint64_t)cfg->n_threads * cfg->kv_block_tokens * hp->head_dim * f;
    n += R * max_act_row_bytes(e) + 3 * R * sizeof(uint32_t);
    return (size_t)n;
}

/* The latent attention's scratch, sized for the slice's layers. */
static int mla_create(struct kvr_engine *e, struct kvr_err *err)
{
    struct kvr_mla_layer *ml = kvr_calloc(e->n_local, sizeof *ml);
    if (!ml)
        return kvr_err_set(err, KVR_ENOMEM, "engine: out of memory");
    for (uint32_t i = 0; i < e->n_local; i++)
        ml[i] = e->layers[i].mla;
    int rc = kvr_mla_work_create(&e->mla, &e->hp, ml, e->n_local, e->cfg.max_rows, e->cfg.n_threads,
                                 e->cfg.n_ctx, e->cfg.kv_block_tokens, err);
    kvr_free(ml);
    return rc;
}

int kvr_engine_create(struct kvr_engine **out, const struct kvr_gguf *g,
                      const struct kvr_engine_config *cfg, struct kvr_err *err)
{
    *out = NULL;
    struct kvr_engine *e;
    int rc = engine_views(&e, g, cfg, err);
    if (rc)
        return rc;
    const struct kvr_hparams *hp = &e->hp;
    if ((rc = pack_weights(e, g, err)))
        goto fail;
    if (hp->moe.n_expert) {
        struct kvr_moe_layer *ml = kvr_calloc(e->n_local, sizeof *ml);
        if (!ml) {
            rc = kvr_err_set(err, KVR_ENOMEM, "engine: out of memory");
            goto fail;
        }
        for (uint32_t i = 0; i < e->n_local; i++)
            ml[i] = e->layers[i].moe;
        rc = kvr_moe_work_create(&e->moe, hp->n_embd, &hp->moe, ml, e->n_local, cfg->max_rows, err);
        kvr_free(ml);
        if (rc)
            goto fail;
    }

    uint32_t per_seq_blocks = (cfg->n_ctx + cfg->kv_block_tokens - 1) / cfg->kv_block_tokens;
    uint64_t n_blocks =
        cfg->kv_n_blocks ? cfg->kv_n_blocks : (uint64_t)per_seq_blocks * cfg->max_seqs;
    if (n_blocks > UINT32_MAX) {
        rc = kvr_err_set(err, KVR_ERANGE, "engine: too many KV blocks");
        goto fail;
    }
    if (cfg->kv_type == KVR_DTYPE_Q8_0 && hp->head_dim % 32) {
        rc = kvr_err_set(err, KVR_EINVAL,
                         "engine: a q8_0 KV cache needs a head width that is a multiple of 32 "
                         "(this model's is %u); use f16 or f32",
                         hp->head_dim);
        goto fail;
    }
    if ((rc = (hp->mla.kv_lora_rank ? kvr_kv_init_keys : kvr_kv_init)(
             &e->kv, cfg->kv_type, e->n_local, e->hp.kv_dim, cfg->kv_block_tokens,
             (uint32_t)n_blocks, cfg->max_seqs, cfg->n_ctx, err)))
        goto fail;
    if (hp->mla.kv_lora_rank && (rc = mla_create(e, err)))
        goto fail;

    int failed = 0;
    uint32_t R = cfg->max_rows;
    e->x = alloc_rows(R, hp->n_embd, &failed);
    e->xb = alloc_rows(R, hp->n_embd, &failed);
    e->q = alloc_rows(R, hp->q_dim, &failed);
    e->k = alloc_rows(R, e->hp.kv_dim, &failed);
    e->v = alloc_rows(R, e->hp.kv_dim, &failed);
    e->att = alloc_rows(R, hp->q_dim, &failed);
    e->gate = alloc_rows(R, hp->n_ff, &failed);
    e->up = alloc_rows(R, hp->n_ff, &failed);
    e->proj = alloc_rows(R, hp->n_embd, &failed);
    e->scores = alloc_rows(cfg->n_threads, cfg->n_ctx * (hp->n_head / hp->n_head_kv), &failed);
    if (cfg->kv_type != KVR_DTYPE_F32 && cfg->kv_type != KVR_DTYPE_F16)
        e->kv_f32 = alloc_rows(cfg->n_threads, cfg->kv_block_tokens * hp->head_dim, &failed);
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
    if ((rc = kvr_kernels_setup((int)cfg->n_threads, err)))
        goto fail;
    e->attn = kvr_kernels_avx2_ok() ? kvr_attn_ops_avx2 : kvr_attn_ops_plain;
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

int kvr_engine_expected_bytes(const struct kvr_gguf *g, const struct kvr_engine_config *cfg,
                              struct kvr_engine_bytes *out, struct kvr_err *err)
{
    memset(out, 0, sizeof *out);
    struct kvr_engine *e;
    int rc = engine_views(&e, g, cfg, err);
    if (rc)
        return rc;
    const struct kvr_hparams *hp = &e->hp;
    /* The file's bytes the slice reads: the header (metadata, vocabulary) and every tensor
     * of its layers, plus the embedding at the head and the final norm at the tail. */
    uint64_t w = kvr_gguf_data_offset(g);
    char prefix[32];
    for (int64_t i = 0; i < kvr_gguf_n_tensors(g); i++) {
        const struct kvr_gguf_tensor *t = kvr_gguf_tensor(g, i);
        unsigned il;
        int n = 0;
        if (sscanf(t->name, "blk.%u.%n", &il, &n) == 1 && n > 0 && il >= cfg->first_layer &&
            il <= cfg->last_layer) {
            snprintf(prefix, sizeof prefix, "blk.%u.", il);
            if (!strncmp(t->name, prefix, strlen(prefix)))
                w += t->n_bytes;
        }
    }
    if (kvr_engine_is_head(e))
        w += (uint64_t)e->tok_embd.n_out * e->tok_embd.row_bytes;
    if (kvr_engine_is_tail(e))
        w += (uint64_t)hp->n_embd * sizeof(float);
    /* A packed matrix's copy replaces its released file pages (pack_weights). */
    bool pack = packing_on();
    for (uint32_t i = 0; i <= e->n_local; i++) {
        struct layer *l = &e->layers[i < e->n_local ? i : 0];
        const struct kvr_matrix *layer_ms[] = {&l->wq,       &l->wk,     &l->wv,       &l->wo,
                                               &l->w_gate,   &l->w_up,   &l->w_down,   &l->mla.wq_a,
                                               &l->mla.wq_b, &l->mla.wq, &l->mla.wkv_a};
        const struct kvr_matrix *tail_ms[] = {&e->output};
        const struct kvr_matrix **ms = i < e->n_local ? layer_ms : tail_ms;
        size_t n = i < e->n_local ? 11 : kvr_engine_is_tail(e) ? 1 : 0;
        for (size_t j = 0; j < n; j++) {
            uint64_t raw = (uint64_t)ms[j]->n_out * ms[j]->row_bytes;
            size_t b = pack ? kvr_matrix_pack_bytes(ms[j]) : 0;
            if (i < e->n_local)
                w = w - (b ? raw : 0) + b; /* raw is among the layer's tensors */
            else
                w += b ? b : raw;
        }
    }
    out->weights = (size_t)w;
    uint32_t per_seq = (cfg->n_ctx + cfg->kv_block_tokens - 1) / cfg->kv_block_tokens;
    uint64_t n_blocks = cfg->kv_n_blocks ? cfg->kv_n_blocks : (uint64_t)per_seq * cfg->max_seqs;
    out->kv = (size_t)((hp->mla.kv_lora_rank ? 1ull : 2ull) * e->n_local * n_blocks *
                       cfg->kv_block_tokens * kvr_kv_bytes(cfg->kv_type, hp->kv_dim));
    out->scratch = scratch_bytes(e);
    if (hp->mla.kv_lora_rank) {
        out->scratch +=
            kvr_mla_work_bytes(hp, cfg->max_rows, cfg->n_threads, cfg->n_ctx, cfg->kv_block_tokens);
        for (uint32_t i = 0; i < e->n_local; i++)
            out->weights += kvr_mla_layer_owned_bytes(&e->layers[i].mla, hp->n_head);
    }
    kvr_engine_destroy(e);
    return KVR_OK;
}

void kvr_engine_seq_free(struct kvr_engine *e, uint32_t seq)
{
    kvr_kv_free_seq(&e->kv, seq);
}

void kvr_engine_kv_usage(const struct kvr_engine *e, uint32_t *used, uint32_t *total)
{
    *total = e->kv.n_blocks;
    *used = kvr_kv_used(&e->kv);
}

int kvr_engine_seq_map(struct kvr_engine *e, uint32_t seq, uint32_t n_cached, uint32_t first,
                       const uint32_t *ids, uint32_t n, struct kvr_err *err)
{
    return kvr_kv_map(&e->kv, seq, n_cached, first, ids, n, err);
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
            return kvr_err_set(err, KVR_ERANGE,
                               "batch: segment %u names sequence %u, "
                               "beyond %u slots",
                               i, s->seq, e->cfg.max_seqs);
        if (s->n_tokens == 0)
            return kvr_err_set(err, KVR_EINVAL, "batch: segment %u is empty", i);
        if ((uint64_t)s->pos0 + s->n_tokens > e->cfg.n_ctx)
            return kvr_err_set(err, KVR_ERANGE,
                               "batch: segment %u ends at position %llu, "
                               "beyond the context of %u",
                               i, (unsigned long long)s->pos0 + s->n_tokens, e->cfg.n_ctx);
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

/* y_i = x . W_i for the given matrices (all with the same input width and type), over the
 * engine's pool (matmul_pool.h), converting x into the engine's activation scratch. */
static void matmuls(struct kvr_engine *e, const float *x, uint32_t n_rows, int n,
                    const struct kvr_matrix *const *w, float *const *y)
{
    kvr_matmul_pool(e->pool, e->xq, x, n_rows, n, w, y);
}

static void matmul1(struct kvr_engine *e, const float *x, uint32_t n_rows,
                    const struct kvr_matrix *w, float *y)
{
    matmuls(e, x, n_rows, 1, &w, &y);
}

/* ---- row operations --------------------------------------------------------------------- */

static void add_rows(float *x, const float *y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] += y[i];
}

static void rmsnorm(float *out, const float *x, const float *w, uint32_t n, float eps)
{
    double ss = 0.0;
    for (uint32_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / n) + eps);
    for (uint32_t i = 0; i < n; i++)
        out[i] = x[i] * scale * w[i];
}

static void softcap(float *x, size_t n, float cap)
{
    for (size_t i = 0; i < n; i++)
        x[i] = cap * tanhf(x[i] / cap);
}

/* Rotary embedding of one head vector in place. Normal (llama) style rotates adjacent pairs
 * (2i, 2i+1), NeoX style the pairs (i, i + n_rot/2); pair i turns by angle i. */
static void rope(float *vec, uint32_t n_rot, enum kvr_rope_style style, const float *cos_t,
                 const float *sin_t)
{
    uint32_t half = n_rot / 2, stride = style == KVR_ROPE_NEOX ? half : 1;
    uint32_t step = style == KVR_ROPE_NEOX ? 1 : 2;
    for (uint32_t i = 0; i < half; i++) {
        float *p0 = vec + i * step, *p1 = p0 + stride;
        float x0 = *p0, x1 = *p1;
        *p0 = x0 * cos_t[i] - x1 * sin_t[i];
        *p1 = x0 * sin_t[i] + x1 * cos_t[i];
    }
}

/* Angle of pair i at position pos: pos * scale * base^(-2i / n_rot) / freqs[i] (freqs:
 * Llama 3's per-pair factors, or NULL). */
static void rope_tables(float *cos_t, float *sin_t, uint32_t n_rot, uint32_t pos, float base,
                        float scale, const float *freqs)
{
    float theta_scale = powf(base, -2.0f / (float)n_rot);
    float theta = (float)pos;
    for (uint32_t i = 0; i < n_rot / 2; i++) {
        float t = theta * scale;
        if (freqs)
            t /= freqs[i];
        cos_t[i] = cosf(t);
        sin_t[i] = sinf(t);
        theta *= theta_scale;
    }
}

/* ---- attention ---------------------------------------------------------------------------- */

struct rope_job {
    struct kvr_engine *e;
    uint32_t n_rows;
    uint32_t layer; /* local layer index */
};

/* Per row: the biases, the per-head q/k norms and RoPE on q and k (each when the layer has
 * them), then store k and v into the cache. */
static void qk_store_worker(void *arg, int ith, int nth)
{
    const struct rope_job *job = arg;
    struct kvr_engine *e = job->e;
    const struct kvr_hparams *hp = &e->hp;
    const struct layer *l = &e->layers[job->layer];
    const uint32_t hd = hp->head_dim;
    float cos_t[MAX_ROT / 2], sin_t[MAX_ROT / 2];
    long b, end;
    kvr_split_range((long)job->n_rows, ith, nth, &b, &end);
    for (long r = b; r < end; r++) {
        uint32_t pos = e->row_pos[r], seq = e->row_seq[r];
        float *q = e->q + (size_t)r * hp->q_dim;
        float *k = e->k + (size_t)r * hp->kv_dim;
        float *v = e->v + (size_t)r * hp->kv_dim;
        if (l->bq) {
            add_rows(q, l->bq, hp->q_dim);
            add_rows(k, l->bk, hp->kv_dim);
            add_rows(v, l->bv, hp->kv_dim);
        }
        if (l->q_norm) {
            for (uint32_t h = 0; h < hp->n_head; h++)
                rmsnorm(q + h * hd, q + h * hd, l->q_norm, hd, hp->norm_eps);
            for (uint32_t h = 0; h < hp->n_head_kv; h++)
                rmsnorm(k + h * hd, k + h * hd, l->k_norm, hd, hp->norm_eps);
        }
        rope_tables(cos_t, sin_t, hp->n_rot, pos, l->rope_base, l->rope_scale, hp->rope_freqs);
        for (uint32_t h = 0; h < hp->n_head; h++)
            rope(q + h * hd, hp->n_rot, hp->arch->rope, cos_t, sin_t);
        for (uint32_t h = 0; h < hp->n_head_kv; h++)
            rope(k + h * hd, hp->n_rot, hp->arch->rope, cos_t, sin_t);
        kvr_kv_store(e->kv.type, kvr_kv_row(&e->kv, e->kv.k, job->layer, seq, pos), k, hp->kv_dim);
        kvr_kv_store(e->kv.type, kvr_kv_row(&e->kv, e->kv.v, job->layer, seq, pos), v, hp->kv_dim);
    }
}

/* KV head `kvh` of n positions of the cache from row `base` (of layer x block x position),
 * as floats with `*step` between positions: the cache itself for f32, else (q8_0) converted
 * into thread ith's scratch. The conversion of a value depends on nothing else, so
 * attention keeps its bits whatever the batch. An f16 cache is read in place (kv_head_f16). */
static const float *kv_head(const struct kvr_engine *e, const uint8_t *cache, size_t base,
                            uint32_t kvh, uint32_t n, int ith, size_t *step)
{
    const struct kvr_kv *kv = &e->kv;
    const uint32_t hd = e->hp.head_dim;
    const size_t head_bytes = kvr_kv_bytes(kv->type, hd);
    const uint8_t *src = cache + base * kv->row_bytes + (size_t)kvh * head_bytes;
    if (kv->type == KVR_DTYPE_F32) {
        *step = kv->kv_dim;
        return (const float *)(const void *)src;
    }
    float *dst = e->kv_f32 + (size_t)ith * kv->block_tokens * hd;
    for (uint32_t j = 0; j < n; j++)
        kvr_kv_load(kv->type, dst + (size_t)j * hd, src + (size_t)j * kv->row_bytes, hd);
    *step = hd;
    return dst;
}

/* KV head `kvh` of the f16 cache from row `base`: halves, kv_dim of them between positions. */
static const uint16_t *kv_head_f16(const struct kvr_engine *e, const uint8_t *cache, size_t base,
                                   uint32_t kvh)
{
    const struct kvr_kv *kv = &e->kv;
    return (const uint16_t *)(const void *)(cache + base * kv->row_bytes) +
           (size_t)kvh * e->hp.head_dim;
}

/* Heads whose half-precision accumulators online_f16 holds at once (on its stack). */
#define ONLINE_ACC_HALVES 4096

/* out[g * hd + i] = the softmax of scores[g * stride + lo..n_pos) weighting the values of KV
 * head kvh, for the group's heads g < group, summed as llama.cpp sums its f16 cache
 * (online, a half-precision accumulator: mix_online_f16), block by block. */
static void online_f16(const struct kvr_engine *e, uint32_t layer, const uint32_t *table,
                       uint32_t lo, uint32_t n_pos, uint32_t kvh, const float *scores,
                       size_t stride, uint32_t group, float *out)
{
    const struct kvr_kv *kv = &e->kv;
    const uint32_t hd = e->hp.head_dim, bt = kv->block_tokens;
    const uint32_t per_call = ONLINE_ACC_HALVES / hd < 64 ? ONLINE_ACC_HALVES / hd : 64;
    uint16_t acc[ONLINE_ACC_HALVES]; /* head_dim <= 4096 (arch.c) */
    float st[2 * 64];
    for (uint32_t g0 = 0; g0 < group; g0 += per_call) {
        uint32_t ng = group - g0 < per_call ? group - g0 : per_call;
        memset(acc, 0, (size_t)ng * hd * sizeof acc[0]);
        for (uint32_t g = 0; g < ng; g++) {
            st[2 * g] = -INFINITY;
            st[2 * g + 1] = 0.0f;
        }
        for (uint32_t t0 = lo; t0 < n_pos;) {
            uint32_t in_block = t0 % bt, n = bt - in_block;
            size_t base = ((size_t)layer * kv->n_blocks + table[t0 / bt]) * bt + in_block;
            n = n_pos - t0 < n ? n_pos - t0 : n;
            e->attn.mix_online_f16(acc, st, scores + g0 * stride + t0, stride, ng, hd,
                                   kv_head_f16(e, kv->v, base, kvh), kv->kv_dim, n);
            t0 += n;
        }
        for (uint32_t g = 0; g < ng; g++) {
            float *o = out + (size_t)(g0 + g) * hd, inv = 1.0f / st[2 * g + 1];
            kvr_kv_load(KVR_DTYPE_F16, o, acc + (size_t)g * hd, hd);
            for (uint32_t i = 0; i < hd; i++)
                o[i] *= inv;
        }
    }
}

/* Each (row, KV head) pair is one unit of work: causal attention of the row's query heads
 * that share that KV head, against its own sequence's cached keys and values at positions
 * lo..pos (lo = 0, or pos + 1 - n_swa on a sliding layer: the cache keeps every position,
 * the window only chooses which are read), walked block by block. Every query head's
 * scores, softmax and weighted sum are computed in the same order whatever the batch, so
 * the result is batch invariant. */
static void attention_worker(void *arg, int ith, int nth)
{
    const struct rope_job *job = arg;
    struct kvr_engine *e = job->e;
    const struct kvr_hparams *hp = &e->hp;
    const struct kvr_kv *kv = &e->kv;
    const bool swa = e->layers[job->layer].swa;
    const uint32_t hd = hp->head_dim, group = hp->n_head / hp->n_head_kv;
    const uint32_t bt = kv->block_tokens;
    float *scores = e->scores + (size_t)ith * e->cfg.n_ctx * group; /* [group][n_ctx] */
    long b, end;
    kvr_split_range((long)job->n_rows * hp->n_head_kv, ith, nth, &b, &end);
    for (long u = b; u < end; u++) {
        uint32_t r = (uint32_t)(u / hp->n_head_kv), kvh = (uint32_t)(u % hp->n_head_kv);
        uint32_t seq = e->row_seq[r], n_pos = e->row_pos[r] + 1;
        uint32_t lo = swa && n_pos > hp->n_swa ? n_pos - hp->n_swa : 0;
        const uint32_t *table = kv->tables + (size_t)seq * kv->max_blocks_per_seq;
        float *q0 = e->q + (size_t)r * hp->q_dim + (size_t)kvh * group * hd;
        const size_t stride = e->cfg.n_ctx;
        /* A half-precision cache dots half-precision keys with a query rounded to half
         * (f32 sums), as llama.cpp's f16 cache does, so greedy tokens match llama.cpp's most
         * often. The slice is this unit's own; q is not read again. */
        const bool f16 = kv->type == KVR_DTYPE_F16;
        if (f16)
            e->attn.round_half(q0, (size_t)group * hd);
        for (uint32_t t0 = lo; t0 < n_pos;) {
            uint32_t in_block = t0 % bt, n = bt - in_block;
            size_t base = ((size_t)job->layer * kv->n_blocks + table[t0 / bt]) * bt + in_block;
            n = n_pos - t0 < n ? n_pos - t0 : n;
            if (f16) {
                e->attn.scores_f16(scores + t0, stride, q0, group, hd,
                                   kv_head_f16(e, kv->k, base, kvh), kv->kv_dim, n, hp->attn_scale);
            } else {
                size_t step;
                const float *keys = kv_head(e, kv->k, base, kvh, n, ith, &step);
                e->attn.scores(scores + t0, stride, q0, group, hd, keys, step, n, hp->attn_scale);
            }
            t0 += n;
        }
        float *out0 = e->att + (size_t)r * hp->q_dim + (size_t)kvh * group * hd;
        for (uint32_t g = 0; g < group; g++) {
            if (hp->attn_softcap > 0.0f)
                softcap(scores + g * stride + lo, n_pos - lo, hp->attn_softcap);
            if (!f16)
                e->attn.softmax(scores + g * stride + lo, n_pos - lo);
        }
        if (f16) {
            online_f16(e, job->layer, table, lo, n_pos, kvh, scores, stride, group, out0);
            continue;
        }
        memset(out0, 0, (size_t)group * hd * sizeof(float));
        for (uint32_t t0 = lo; t0 < n_pos;) {
            uint32_t in_block = t0 % bt, n = bt - in_block;
            size_t base = ((size_t)job->layer * kv->n_blocks + table[t0 / bt]) * bt + in_block;
            n = n_pos - t0 < n ? n_pos - t0 : n;
            size_t step;
            const float *values = kv_head(e, kv->v, base, kvh, n, ith, &step);
            e->attn.mix(out0, scores + t0, stride, group, hd, values, step, n);
            t0 += n;
        }
    }
}

/* ---- the forward pass --------------------------------------------------------------------- */

struct rows_job {
    struct kvr_engine *e;
    uint32_t n_rows;
    const float *norm_w; /* rmsnorm weights, or NULL for the activation step */
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

/* gate = act(gate) * up, element by element. */
static void glu_worker(void *arg, int ith, int nth)
{
    const struct rows_job *job = arg;
    struct kvr_engine *e = job->e;
    size_t n = (size_t)job->n_rows * e->hp.n_ff;
    long b, end;
    kvr_split_range((long)n, ith, nth, &b, &end);
    if (e->hp.arch->act == KVR_ACT_GELU_TANH)
        e->attn.geglu(e->gate + b, e->up + b, (size_t)(end - b));
    else
        e->attn.swiglu(e->gate + b, e->up + b, (size_t)(end - b));
}

/* Row-wise jobs over n_values values in all: parallel only when large enough to pay for
 * waking the pool. */
static void run_rows(struct kvr_engine *e, kvr_pool_fn fn, void *job, double n_values)
{
    if (n_values * 8 >= KVR_SMALL_WORK)
        kvr_pool_run(e->pool, fn, job);
    else
        fn(job, 0, 1);
}

/* Matrices sharing one input, in one dispatch when their types agree. */
static void matmuls_any(struct kvr_engine *e, const float *x, uint32_t n_rows, int n,
                        const struct kvr_matrix *const *w, float *const *y)
{
    bool same = true;
    for (int i = 1; i < n; i++)
        same = same && w[i]->type == w[0]->type;
    if (same) {
        matmuls(e, x, n_rows, n, w, y);
        return;
    }
    for (int i = 0; i < n; i++)
        matmul1(e, x, n_rows, w[i], y[i]);
}

/* proj = the attention block's output for xb (the normed residual). */
static void attention_block(struct kvr_engine *e, uint32_t il, uint32_t n_rows)
{
    const struct kvr_hparams *hp = &e->hp;
    const struct layer *l = &e->layers[il];
    if (e->mla) { /* latent attention (model/mla.h) */
        kvr_mla_attention(e->mla, &l->mla, &e->kv, il, e->xb, n_rows, e->row_seq, e->row_pos,
                          e->att, e->pool);
        matmul1(e, e->att, n_rows, &l->wo, e->proj);
        return;
    }
    const struct kvr_matrix *qkv_w[3] = {&l->wq, &l->wk, &l->wv};
    float *qkv_y[3] = {e->q, e->k, e->v};
    matmuls_any(e, e->xb, n_rows, 3, qkv_w, qkv_y);

    struct rope_job aj = {e, n_rows, il};
    run_rows(e, qk_store_worker, &aj, (double)n_rows * hp->q_dim);
    double att_work = 0;
    for (uint32_t r = 0; r < n_rows; r++) {
        uint32_t n_pos = e->row_pos[r] + 1;
        if (l->swa && n_pos > hp->n_swa)
            n_pos = hp->n_swa;
        att_work += (double)n_pos * hp->q_dim * 2;
    }
    /* Heads split across the pool from a few positions on: at decode the workers spin
     * between the layer's jobs, so a dispatch is cheap. */
    if (att_work < KVR_SMALL_WORK / 8)
        attention_worker(&aj, 0, 1);
    else
        kvr_pool_run(e->pool, attention_worker, &aj);
    matmul1(e, e->att, n_rows, &l->wo, e->proj);
}

/* proj = the feed-forward block's output for xb: the gated FFN down(act(gate) * up), or in
 * a mixture-of-experts model the experts the router picks per row, their outputs summed in
 * a fixed order (model/moe.h). */
static void ffn_block(struct kvr_engine *e, uint32_t il, uint32_t n_rows)
{
    const struct layer *l = &e->layers[il];
    if (e->moe && l->moe.router.data) { /* router, experts, fixed-order combine (moe.h) */
        if (e->moe_dispatch)
            kvr_moe_forward_dispatch(e->moe, &l->moe, e->cfg.first_layer + il, e->xb, n_rows,
                                     e->proj, e->pool, e->moe_dispatch, e->moe_dispatch_ctx);
        else
            kvr_moe_forward(e->moe, &l->moe, e->xb, n_rows, e->proj, e->pool);
        return;
    }
    const struct kvr_matrix *ffn_w[2] = {&l->w_gate, &l->w_up};
    float *ffn_y[2] = {e->gate, e->up};
    matmuls_any(e, e->xb, n_rows, 2, ffn_w, ffn_y);
    struct rows_job act = {e, n_rows, NULL, NULL, NULL};
    run_rows(e, glu_worker, &act, (double)n_rows * e->hp.n_ff);
    matmul1(e, e->gate, n_rows, &l->w_down, e->proj);
}

/* x += post_norm(block(pre_norm(x))) for both blocks; a missing post-norm is the identity. */
static void layer_forward(struct kvr_engine *e, uint32_t il, uint32_t n_rows)
{
    const struct layer *l = &e->layers[il];
    size_t n_x = (size_t)n_rows * e->hp.n_embd;

    struct rows_job norm = {e, n_rows, l->attn_norm, e->x, e->xb};
    run_rows(e, rmsnorm_worker, &norm, (double)n_x);
    attention_block(e, il, n_rows);
    struct rows_job post = {e, n_rows, l->attn_post_norm, e->proj, e->proj};
    if (l->attn_post_norm)
        run_rows(e, rmsnorm_worker, &post, (double)n_x);
    add_rows(e->x, e->proj, n_x);

    norm.norm_w = l->ffn_norm;
    run_rows(e, rmsnorm_worker, &norm, (double)n_x);
    ffn_block(e, il, n_rows);
    post.norm_w = l->ffn_post_norm;
    if (l->ffn_post_norm)
        run_rows(e, rmsnorm_worker, &post, (double)n_x);
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
                return kvr_err_set(err, KVR_ERANGE,
                                   "batch: token id %d at row %u outside "
                                   "the vocabulary of %u",
                                   tokens[r], r, hp->n_vocab);
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
        if (hp->arch->embd_scale) {
            float s = sqrtf((float)hp->n_embd);
            for (size_t i = 0; i < n_x; i++)
                e->x[i] *= s;
        }
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
    if (hp->final_softcap > 0.0f)
        softcap(out, (size_t)n_want * hp->n_vocab, hp->final_softcap);
    return KVR_OK;
}

void kvr_engine_set_expert_dispatch(struct kvr_engine *e, kvr_moe_dispatch_fn fn, void *ctx)
{
    e->moe_dispatch = fn;
    e->moe_dispatch_ctx = ctx;
}
