/* mla.c - multi-head latent attention over a batch of rows (see mla.h).
 *
 * Reading order: hyperparameters (with YaRN), tensor views, the scratch, then the block in
 * the order the data flows: query and latent projections -> norms, RoPE and the cache store
 * -> the key projection absorbed into the queries -> attention over the latent cache -> the
 * value projection. Then the plain reference the unit test compares with. */
#include "model/mla.h"

#include "core/alloc.h"
#include "model/arch.h"
#include "model/attn.h"
#include "model/kv.h"
#include "model/matmul_pool.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

enum {
    MAX_ROPE = 1024,   /* most rotary dimensions per head (tables on the stack) */
    MAX_LATENT = 4096, /* most values of a cache row, latent and rope: attention's plain
                          f16 scores keep one on the stack (attn.c) */
    HEAD_CHUNK = 8,    /* heads of one unit of attention work: a fixed group, so the split
                          never depends on the thread count */
};

/* ---- hyperparameters --------------------------------------------------------------- */

static int get_u32(const struct kvr_gguf *g, const char *arch, const char *suffix, uint32_t *out,
                   bool required, struct kvr_err *err)
{
    char k[96];
    snprintf(k, sizeof k, "%s.%s", arch, suffix);
    int rc = kvr_gguf_get_u32(g, k, out, err);
    if (rc == KVR_ENOTFOUND)
        return required ? kvr_err_set(err, KVR_EFORMAT, "model: missing metadata key %s", k)
                        : KVR_OK;
    return rc;
}

/* The attention scale: mscale^2 / sqrt(nope + rope), mscale = 1 + log_mul ln(factor) under
 * YaRN (1 without); the rope runs at YaRN's interpolated frequency scale. */
static int read_scale(struct kvr_hparams *hp)
{
    struct kvr_mla_hparams *m = &hp->mla;
    float mscale = 1.0f;
    if (hp->yarn.factor > 0.0f) {
        hp->rope_freq_scale = 1.0f / hp->yarn.factor;
        mscale = 1.0f + hp->yarn.log_mul * logf(1.0f / hp->rope_freq_scale);
    }
    m->kq_scale = mscale * mscale / sqrtf((float)(m->n_nope + m->n_rope));
    return KVR_OK;
}

int kvr_mla_hparams_read(struct kvr_hparams *hp, const struct kvr_gguf *g, struct kvr_err *err)
{
    struct kvr_mla_hparams *m = &hp->mla;
    memset(m, 0, sizeof *m);
    const char *a = hp->arch->name;
    uint32_t k_len = 0, v_len = 0, k_mla = 0, v_mla = 0, rope = 0;
    int rc;
    if ((rc = get_u32(g, a, "attention.q_lora_rank", &m->q_lora_rank, false, err)) ||
        (rc = get_u32(g, a, "attention.kv_lora_rank", &m->kv_lora_rank, true, err)) ||
        (rc = get_u32(g, a, "attention.key_length", &k_len, false, err)) ||
        (rc = get_u32(g, a, "attention.value_length", &v_len, false, err)) ||
        (rc = get_u32(g, a, "attention.key_length_mla", &k_mla, false, err)) ||
        (rc = get_u32(g, a, "attention.value_length_mla", &v_mla, false, err)) ||
        (rc = get_u32(g, a, "rope.dimension_count", &rope, true, err)))
        return rc;
    uint32_t k_head = k_mla ? k_mla : k_len, v_head = v_mla ? v_mla : v_len;
    if (!m->kv_lora_rank || m->kv_lora_rank + (uint64_t)rope > MAX_LATENT ||
        m->q_lora_rank > 65536 || !k_head || k_head > 4096 || !v_head || v_head > 4096 || !rope ||
        rope % 2 || rope >= k_head || rope > MAX_ROPE)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: implausible latent attention (q rank %u, kv rank %u, key "
                           "%u, value %u, rope %u)",
                           m->q_lora_rank, m->kv_lora_rank, k_head, v_head, rope);
    m->n_rope = rope;
    m->n_nope = k_head - rope;
    m->n_v = v_head;
    hp->n_head_kv = 1;
    hp->head_dim = m->kv_lora_rank + rope;
    hp->kv_dim = hp->head_dim;
    hp->q_dim = hp->n_head * v_head;
    hp->n_rot = rope;
    return read_scale(hp);
}

/* ---- tensor views -------------------------------------------------------------------- */

static int find(const struct kvr_gguf *g, uint32_t il, const char *suffix,
                const struct kvr_gguf_tensor **t, char *name, size_t cap, struct kvr_err *err)
{
    snprintf(name, cap, "blk.%u.%s", il, suffix);
    *t = kvr_gguf_find_tensor(g, name);
    return *t ? KVR_OK : kvr_err_set(err, KVR_EFORMAT, "model: missing tensor %s", name);
}

/* Matrix 0 of tensor blk.il.suffix, shape [n_in, n_out] or [n_in, n_out, n_mat]. */
static int view(const struct kvr_gguf *g, uint32_t il, const char *suffix, int64_t n_in,
                int64_t n_out, int64_t n_mat, struct kvr_matrix *m, struct kvr_err *err)
{
    char name[96];
    const struct kvr_gguf_tensor *t;
    int rc = find(g, il, suffix, &t, name, sizeof name, err);
    if (rc)
        return rc;
    uint32_t dims = n_mat ? 3 : 2;
    if (t->n_dims != dims || t->ne[0] != n_in || t->ne[1] != n_out || (n_mat && t->ne[2] != n_mat))
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: tensor %s has shape [%lld, %lld, %lld], expected [%lld, "
                           "%lld, %lld]",
                           name, (long long)t->ne[0], (long long)t->ne[1],
                           (long long)(t->n_dims > 2 ? t->ne[2] : 1), (long long)n_in,
                           (long long)n_out, (long long)(n_mat ? n_mat : 1));
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(t->type);
    size_t row_bytes;
    if (!tr || !tr->dot || !kvr_dtype_is_weight(t->type) ||
        !kvr_dtype_row_bytes(t->type, n_in, &row_bytes))
        return kvr_err_set(err, KVR_ENOTSUP, "model: tensor %s has unsupported type %d", name,
                           t->type);
    *m = (struct kvr_matrix){.type = (enum kvr_dtype)t->type,
                             .n_in = n_in,
                             .n_out = n_out,
                             .row_bytes = row_bytes,
                             .data = t->data};
    return KVR_OK;
}

static int view_vec(const struct kvr_gguf *g, uint32_t il, const char *suffix, int64_t n,
                    const float **out, struct kvr_err *err)
{
    char name[96];
    const struct kvr_gguf_tensor *t;
    int rc = find(g, il, suffix, &t, name, sizeof name, err);
    if (rc)
        return rc;
    if (t->type != KVR_DTYPE_F32 || t->n_dims != 1 || t->ne[0] != n ||
        (uintptr_t)t->data % sizeof(float))
        return kvr_err_set(err, KVR_EFORMAT, "model: tensor %s must be f32 [%lld], aligned", name,
                           (long long)n);
    *out = t->data;
    return KVR_OK;
}

/* A fused attn_kv_b: the value rows are views (head h's v rows follow its nope key rows);
 * the key rows are transposed into an owned f32 [nope] -> [L] matrix per head. */
static int view_fused(struct kvr_mla_layer *l, const struct kvr_gguf *g,
                      const struct kvr_hparams *hp, uint32_t il, struct kvr_err *err)
{
    const struct kvr_mla_hparams *m = &hp->mla;
    const uint32_t H = hp->n_head, L = m->kv_lora_rank, nope = m->n_nope, per = nope + m->n_v;
    struct kvr_matrix kvb;
    int rc = view(g, il, "attn_kv_b.weight", L, (int64_t)H * per, 0, &kvb, err);
    if (rc)
        return rc;
    l->fused = true;
    l->wv_b = kvb;
    l->wv_b.n_out = m->n_v;
    l->wv_b.data = (const char *)kvb.data + (size_t)nope * kvb.row_bytes;
    l->v_b_stride = (size_t)per * kvb.row_bytes;
    size_t n;
    float *row = kvr_malloc((size_t)L * sizeof *row);
    if (!kvr_mul_size((size_t)H * nope, (size_t)L * sizeof(float), &n) ||
        !(l->k_b_owned = kvr_aligned_alloc(64, n)) || !row) {
        kvr_free(row);
        return kvr_err_set(err, KVR_ENOMEM, "model: layer %u: no memory for attn_kv_b's keys", il);
    }
    for (uint32_t h = 0; h < H; h++)
        for (uint32_t i = 0; i < nope; i++) {
            kvr_matrix_get_row(&kvb, (int64_t)h * per + i, row);
            for (uint32_t j = 0; j < L; j++)
                l->k_b_owned[((size_t)h * L + j) * nope + i] = row[j];
        }
    kvr_free(row);
    l->wk_b = (struct kvr_matrix){.type = KVR_DTYPE_F32,
                                  .n_in = nope,
                                  .n_out = L,
                                  .row_bytes = (size_t)nope * sizeof(float),
                                  .data = l->k_b_owned};
    l->k_b_stride = (size_t)L * nope * sizeof(float);
    return KVR_OK;
}

int kvr_mla_layer_view(struct kvr_mla_layer *l, const struct kvr_gguf *g,
                       const struct kvr_hparams *hp, uint32_t il, struct kvr_err *err)
{
    const struct kvr_mla_hparams *m = &hp->mla;
    const int64_t H = hp->n_head, L = m->kv_lora_rank, qk = m->n_nope + m->n_rope;
    memset(l, 0, sizeof *l);
    int rc;
    if (m->q_lora_rank) {
        if ((rc = view(g, il, "attn_q_a.weight", hp->n_embd, m->q_lora_rank, 0, &l->wq_a, err)) ||
            (rc = view_vec(g, il, "attn_q_a_norm.weight", m->q_lora_rank, &l->q_a_norm, err)) ||
            (rc = view(g, il, "attn_q_b.weight", m->q_lora_rank, H * qk, 0, &l->wq_b, err)))
            return rc;
    } else if ((rc = view(g, il, "attn_q.weight", hp->n_embd, H * qk, 0, &l->wq, err))) {
        return rc;
    }
    if ((rc = view(g, il, "attn_kv_a_mqa.weight", hp->n_embd, L + m->n_rope, 0, &l->wkv_a, err)) ||
        (rc = view_vec(g, il, "attn_kv_a_norm.weight", L, &l->kv_a_norm, err)))
        return rc;
    char name[96];
    snprintf(name, sizeof name, "blk.%u.attn_kv_b.weight", il);
    if (kvr_gguf_find_tensor(g, name))
        return view_fused(l, g, hp, il, err);
    if ((rc = view(g, il, "attn_k_b.weight", m->n_nope, L, H, &l->wk_b, err)) ||
        (rc = view(g, il, "attn_v_b.weight", L, m->n_v, H, &l->wv_b, err)))
        return rc;
    l->k_b_stride = (size_t)L * l->wk_b.row_bytes;
    l->v_b_stride = (size_t)m->n_v * l->wv_b.row_bytes;
    return KVR_OK;
}

void kvr_mla_layer_fini(struct kvr_mla_layer *l)
{
    kvr_free(l->k_b_owned);
    l->k_b_owned = NULL;
}

size_t kvr_mla_layer_owned_bytes(const struct kvr_mla_layer *l, uint32_t n_head)
{
    return l->k_b_owned ? (size_t)n_head * l->k_b_stride : 0;
}

double kvr_mla_layer_file_bytes(const struct kvr_gguf *g, uint32_t il)
{
    static const char *const names[] = {"attn_q_a", "attn_q_a_norm", "attn_q_b",
                                        "attn_q",   "attn_kv_a_mqa", "attn_kv_a_norm",
                                        "attn_k_b", "attn_v_b",      "attn_kv_b"};
    double sum = 0;
    char name[96];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(name, sizeof name, "blk.%u.%s.weight", il, names[i]);
        const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, name);
        sum += t ? (double)t->n_bytes : 0.0;
    }
    return sum;
}

/* Head h's matrix of a per-head stack. */
static struct kvr_matrix head_matrix(const struct kvr_matrix *m0, size_t stride, uint32_t h)
{
    struct kvr_matrix m = *m0;
    m.data = (const char *)m0->data + (size_t)h * stride;
    m.packed = NULL;
    return m;
}

/* ---- the scratch ------------------------------------------------------------------- */

struct kvr_mla_work {
    const struct kvr_hparams *hp; /* the engine's, outlives the work */
    uint32_t max_rows, n_threads, n_ctx, bt;
    struct kvr_attn_ops attn;
    float *qa;     /* R x q_lora */
    float *q;      /* R x H (nope + rope) */
    float *kva;    /* R x (L + rope) */
    float *qf;     /* R x H x (rope + L): RoPE'd q_pe then the absorbed q_nope, per head */
    float *lat;    /* R x H x L: each head's attention output in the latent */
    void *xq;      /* R converted rows for the projections of x and of qa */
    float *gather; /* per thread: R x max(nope, L), one head's input rows */
    void *xq_head; /* per thread: R converted rows of one head's input */
    size_t xq_head_bytes;
    float *scores; /* per thread: HEAD_CHUNK x n_ctx */
    uint16_t *acc; /* per thread: HEAD_CHUNK x L halves (f16 cache) */
    float *kv_f32; /* per thread: bt x (L + rope), a q8_0 cache's rows as floats */
};

static size_t act_bytes(const struct kvr_matrix *m)
{
    return m->data ? kvr_act_row_bytes(m->type, m->n_in) : 0;
}

static size_t max_size(size_t a, size_t b)
{
    return a > b ? a : b;
}

/* Floats (or bytes) of each buffer, in the order of the struct; the per-thread ones for
 * one thread. Without layers (an estimate), converted rows are taken as f32 rows. */
struct sizes {
    size_t qa, q, kva, qf, lat, xq, gather, xq_head, scores, acc, kv_f32;
};

static struct sizes sizes_of(const struct kvr_hparams *hp, const struct kvr_mla_layer *layers,
                             uint32_t n_layers, uint32_t R, uint32_t n_ctx, uint32_t bt)
{
    const struct kvr_mla_hparams *m = &hp->mla;
    const size_t H = hp->n_head, L = m->kv_lora_rank, D = L + m->n_rope;
    struct sizes s = {0};
    s.qa = (size_t)R * (m->q_lora_rank ? m->q_lora_rank : 1);
    s.q = (size_t)R * H * (m->n_nope + m->n_rope);
    s.kva = (size_t)R * D;
    s.qf = (size_t)R * H * D;
    s.lat = (size_t)R * H * L;
    size_t xq = 0, xh = 0;
    for (uint32_t i = 0; i < n_layers; i++) {
        const struct kvr_mla_layer *l = &layers[i];
        xq = max_size(xq, max_size(act_bytes(&l->wq_a), act_bytes(&l->wq)));
        xq = max_size(xq, max_size(act_bytes(&l->wq_b), act_bytes(&l->wkv_a)));
        xh = max_size(xh, max_size(act_bytes(&l->wk_b), act_bytes(&l->wv_b)));
    }
    if (!layers) { /* an estimate without views: f32 rows of the widest input */
        xq = (hp->n_embd > m->q_lora_rank ? hp->n_embd : m->q_lora_rank) * sizeof(float);
        xh = L * sizeof(float);
    }
    s.xq = (size_t)R * xq;
    s.xq_head = (size_t)R * xh;
    s.gather = (size_t)R * (L > m->n_nope ? L : m->n_nope);
    s.scores = (size_t)HEAD_CHUNK * n_ctx;
    s.acc = (size_t)HEAD_CHUNK * L;
    s.kv_f32 = (size_t)bt * D;
    return s;
}

size_t kvr_mla_work_bytes(const struct kvr_hparams *hp, uint32_t max_rows, uint32_t n_threads,
                          uint32_t n_ctx, uint32_t kv_block_tokens)
{
    struct sizes s = sizes_of(hp, NULL, 0, max_rows, n_ctx, kv_block_tokens);
    size_t f = sizeof(float);
    return (s.qa + s.q + s.kva + s.qf + s.lat) * f + s.xq +
           n_threads * ((s.gather + s.scores + s.kv_f32) * f + s.xq_head + s.acc * 2);
}

void kvr_mla_work_destroy(struct kvr_mla_work *w)
{
    if (!w)
        return;
    void *bufs[] = {w->qa,     w->q,       w->kva,    w->qf,  w->lat,   w->xq,
                    w->gather, w->xq_head, w->scores, w->acc, w->kv_f32};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        kvr_free(bufs[i]);
    kvr_free(w);
}

static void *alloc_n(size_t n, size_t elem, int *failed)
{
    size_t bytes;
    void *p = NULL;
    if (!kvr_mul_size(n ? n : 1, elem, &bytes) || !(p = kvr_aligned_alloc(64, bytes)))
        *failed = 1;
    return p;
}

int kvr_mla_work_create(struct kvr_mla_work **out, const struct kvr_hparams *hp,
                        const struct kvr_mla_layer *layers, uint32_t n_layers, uint32_t max_rows,
                        uint32_t n_threads, uint32_t n_ctx, uint32_t kv_block_tokens,
                        struct kvr_err *err)
{
    *out = NULL;
    struct kvr_mla_work *w = kvr_calloc(1, sizeof *w);
    if (!w)
        return kvr_err_set(err, KVR_ENOMEM, "mla: out of memory");
    struct sizes s = sizes_of(hp, layers, n_layers, max_rows, n_ctx, kv_block_tokens);
    *w = (struct kvr_mla_work){.hp = hp,
                               .max_rows = max_rows,
                               .n_threads = n_threads,
                               .n_ctx = n_ctx,
                               .bt = kv_block_tokens,
                               .xq_head_bytes = s.xq_head};
    w->attn = kvr_kernels_avx2_ok() ? kvr_attn_ops_avx2 : kvr_attn_ops_plain;
    int failed = 0;
    const size_t f = sizeof(float), T = n_threads;
    w->qa = alloc_n(s.qa, f, &failed);
    w->q = alloc_n(s.q, f, &failed);
    w->kva = alloc_n(s.kva, f, &failed);
    w->qf = alloc_n(s.qf, f, &failed);
    w->lat = alloc_n(s.lat, f, &failed);
    w->xq = alloc_n(s.xq, 1, &failed);
    w->gather = alloc_n(T * s.gather, f, &failed);
    w->xq_head = alloc_n(T * s.xq_head, 1, &failed);
    w->scores = alloc_n(T * s.scores, f, &failed);
    w->acc = alloc_n(T * s.acc, sizeof(uint16_t), &failed);
    w->kv_f32 = alloc_n(T * s.kv_f32, f, &failed);
    if (failed) {
        kvr_mla_work_destroy(w);
        return kvr_err_set(err, KVR_ENOMEM, "mla: cannot allocate scratch for %u rows", max_rows);
    }
    *out = w;
    return KVR_OK;
}

/* ---- row operations ---------------------------------------------------------------- */

static void rmsnorm(float *x, const float *wt, uint32_t n, float eps)
{
    double ss = 0.0;
    for (uint32_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / n) + eps);
    for (uint32_t i = 0; i < n; i++)
        x[i] = x[i] * scale * wt[i];
}

/* cos and sin of each rope pair at position pos: YaRN's tables (model/yarn.h) with an
 * attention factor that cancels their magnitude correction (DeepSeek's own mscale ratio is
 * 1; the correction goes into kq_scale instead), computed in llama.cpp's order of
 * operations; without YaRN, the plain (possibly linearly scaled) angles. */
static void rope_tables(const struct kvr_hparams *hp, uint32_t pos, float *cos_t, float *sin_t)
{
    const struct kvr_mla_hparams *m = &hp->mla;
    if (hp->yarn.factor > 0.0f) {
        struct kvr_yarn y = hp->yarn;
        y.attn_factor = 1.0f / (1.0f + 0.1f * logf(1.0f / (1.0f / y.factor)));
        kvr_yarn_tables(cos_t, sin_t, m->n_rope, pos, hp->rope_freq_base, &y);
        return;
    }
    const float fs = hp->rope_freq_scale;
    const float theta_scale = powf(hp->rope_freq_base, -2.0f / (float)m->n_rope);
    float theta = (float)pos;
    for (uint32_t i = 0; i < m->n_rope / 2; i++) {
        cos_t[i] = cosf(fs * theta);
        sin_t[i] = sinf(fs * theta);
        theta *= theta_scale;
    }
}

/* Rotate adjacent pairs (2i, 2i + 1) of n values by the tables' angles. */
static void rope(float *v, uint32_t n, const float *cos_t, const float *sin_t)
{
    for (uint32_t i = 0; i < n / 2; i++) {
        float x0 = v[2 * i], x1 = v[2 * i + 1];
        v[2 * i] = x0 * cos_t[i] - x1 * sin_t[i];
        v[2 * i + 1] = x0 * sin_t[i] + x1 * cos_t[i];
    }
}

/* ---- the block --------------------------------------------------------------------- */

struct job {
    struct kvr_mla_work *w;
    const struct kvr_mla_layer *l;
    struct kvr_kv *kv;
    uint32_t layer, n_rows;
    const uint32_t *row_seq, *row_pos;
    /* a per-head matmul: y[r][h] = M_h x[r][h] */
    const struct kvr_matrix *m0;
    size_t m_stride;
    const float *x;
    size_t x_row, x_head; /* floats between rows, and between heads of a row */
    float *y;
    size_t y_row, y_head;
};

static void run(struct kvr_pool *pool, kvr_pool_fn fn, struct job *j, double work)
{
    if (work * 8 >= KVR_SMALL_WORK)
        kvr_pool_run(pool, fn, j);
    else
        fn(j, 0, 1);
}

/* Per row: the norms of q_a (already done) and of the latent, RoPE on the query heads'
 * rope slices (into qf) and on the shared key, and the cache row [k_pe | c]. */
static void rope_store_worker(void *arg, int ith, int nth)
{
    const struct job *j = arg;
    const struct kvr_hparams *hp = j->w->hp;
    const struct kvr_mla_hparams *m = &hp->mla;
    const uint32_t H = hp->n_head, L = m->kv_lora_rank, R = m->n_rope, D = L + R;
    const uint32_t qk = m->n_nope + R;
    float cos_t[MAX_ROPE / 2], sin_t[MAX_ROPE / 2], row[MAX_LATENT];
    long b, e;
    kvr_split_range((long)j->n_rows, ith, nth, &b, &e);
    for (long r = b; r < e; r++) {
        rope_tables(hp, j->row_pos[r], cos_t, sin_t);
        float *kva = j->w->kva + (size_t)r * D;
        rmsnorm(kva, j->l->kv_a_norm, L, hp->norm_eps);
        rope(kva + L, R, cos_t, sin_t);
        memcpy(row, kva + L, R * sizeof(float));
        memcpy(row + R, kva, L * sizeof(float));
        kvr_kv_store(j->kv->type,
                     kvr_kv_row(j->kv, j->kv->k, j->layer, j->row_seq[r], j->row_pos[r]), row, D);
        for (uint32_t h = 0; h < H; h++) {
            float *qf = j->w->qf + ((size_t)r * H + h) * D;
            memcpy(qf, j->w->q + (size_t)r * H * qk + (size_t)h * qk + m->n_nope,
                   R * sizeof(float));
            rope(qf, R, cos_t, sin_t);
        }
    }
}

/* y[r][h] = M_h x[r][h] for every row, heads split among threads: each thread gathers a
 * head's input rows, converts them and runs the head's matrix. */
static void head_matmul_worker(void *arg, int ith, int nth)
{
    const struct job *j = arg;
    struct kvr_mla_work *w = j->w;
    const uint32_t H = w->hp->n_head, n_in = (uint32_t)j->m0->n_in;
    const struct sizes s = sizes_of(w->hp, NULL, 0, w->max_rows, w->n_ctx, w->bt);
    float *g = w->gather + (size_t)ith * s.gather;
    void *xq = (char *)w->xq_head + (size_t)ith * w->xq_head_bytes;
    long b, e;
    kvr_split_range((long)H, ith, nth, &b, &e);
    for (long h = b; h < e; h++) {
        for (uint32_t r = 0; r < j->n_rows; r++)
            memcpy(g + (size_t)r * n_in, j->x + r * j->x_row + (size_t)h * j->x_head,
                   n_in * sizeof(float));
        struct kvr_matrix mh = head_matrix(j->m0, j->m_stride, (uint32_t)h);
        kvr_quantize_rows(mh.type, g, n_in, 0, j->n_rows, xq);
        kvr_matmul(&mh, xq, j->n_rows, j->y + (size_t)h * j->y_head, (int64_t)j->y_row, 0,
                   mh.n_out);
    }
}

/* n cache rows of layer `layer` from row `base` as floats D apart: the cache itself (f32),
 * or converted into the thread's scratch (q8_0). */
static const float *rows_f32(const struct job *j, size_t base, uint32_t n, int ith)
{
    const struct kvr_kv *kv = j->kv;
    const uint32_t D = kv->kv_dim;
    const uint8_t *src = kv->k + base * kv->row_bytes;
    if (kv->type == KVR_DTYPE_F32)
        return (const float *)(const void *)src;
    float *dst = j->w->kv_f32 + (size_t)ith * j->w->bt * D;
    for (uint32_t t = 0; t < n; t++)
        kvr_kv_load(kv->type, dst + (size_t)t * D, src + (size_t)t * kv->row_bytes, D);
    return dst;
}

/* One unit: row r's heads [h0, h0 + ng) against its sequence's cached rows 0..pos, block
 * by block: scores over [k_pe | c], softmax, and the weighted sum of the latents c (the
 * cache row from its rope offset on). An f16 cache is read in place with the query
 * rounded to half and the online half-precision sum, as the engine's other layers do. */
static void attend(const struct job *j, uint32_t r, uint32_t h0, uint32_t ng, int ith)
{
    struct kvr_mla_work *w = j->w;
    const struct kvr_kv *kv = j->kv;
    const struct kvr_mla_hparams *m = &w->hp->mla;
    const uint32_t H = w->hp->n_head, L = m->kv_lora_rank, R = m->n_rope, D = L + R;
    const uint32_t bt = kv->block_tokens, n_pos = j->row_pos[r] + 1;
    const uint32_t *table = kv->tables + (size_t)j->row_seq[r] * kv->max_blocks_per_seq;
    const size_t stride = w->n_ctx;
    const bool f16 = kv->type == KVR_DTYPE_F16;
    float *scores = w->scores + (size_t)ith * HEAD_CHUNK * w->n_ctx;
    float *q0 = w->qf + ((size_t)r * H + h0) * D;
    float *out0 = w->lat + ((size_t)r * H + h0) * L;
    if (f16)
        w->attn.round_half(q0, (size_t)ng * D);
    for (int pass = 0; pass < 2; pass++) { /* 0: scores, 1: the weighted sum */
        uint16_t *acc = w->acc + (size_t)ith * HEAD_CHUNK * L;
        float st[2 * HEAD_CHUNK];
        if (pass == 1 && f16) {
            memset(acc, 0, (size_t)ng * L * sizeof *acc);
            for (uint32_t g = 0; g < ng; g++)
                st[2 * g] = -INFINITY, st[2 * g + 1] = 0.0f;
        } else if (pass == 1) {
            for (uint32_t g = 0; g < ng; g++)
                w->attn.softmax(scores + g * stride, n_pos);
            memset(out0, 0, (size_t)ng * L * sizeof(float));
        }
        for (uint32_t t0 = 0; t0 < n_pos;) {
            uint32_t in_block = t0 % bt, n = bt - in_block;
            size_t base = ((size_t)j->layer * kv->n_blocks + table[t0 / bt]) * bt + in_block;
            n = n_pos - t0 < n ? n_pos - t0 : n;
            const uint16_t *halves = (const uint16_t *)(const void *)(kv->k + base * kv->row_bytes);
            if (f16 && pass == 0)
                w->attn.scores_f16(scores + t0, stride, q0, ng, D, halves, D, n, m->kq_scale);
            else if (f16)
                w->attn.mix_online_f16(acc, st, scores + t0, stride, ng, L, halves + R, D, n);
            else if (pass == 0)
                w->attn.scores(scores + t0, stride, q0, ng, D, rows_f32(j, base, n, ith), D, n,
                               m->kq_scale);
            else
                w->attn.mix(out0, scores + t0, stride, ng, L, rows_f32(j, base, n, ith) + R, D, n);
            t0 += n;
        }
        if (pass == 1 && f16)
            for (uint32_t g = 0; g < ng; g++) {
                float *o = out0 + (size_t)g * L, inv = 1.0f / st[2 * g + 1];
                kvr_kv_load(KVR_DTYPE_F16, o, acc + (size_t)g * L, L);
                for (uint32_t i = 0; i < L; i++)
                    o[i] *= inv;
            }
    }
}

static void attention_worker(void *arg, int ith, int nth)
{
    const struct job *j = arg;
    const uint32_t H = j->w->hp->n_head, chunks = (H + HEAD_CHUNK - 1) / HEAD_CHUNK;
    long b, e;
    kvr_split_range((long)j->n_rows * chunks, ith, nth, &b, &e);
    for (long u = b; u < e; u++) {
        uint32_t r = (uint32_t)(u / chunks), h0 = (uint32_t)(u % chunks) * HEAD_CHUNK;
        attend(j, r, h0, H - h0 < HEAD_CHUNK ? H - h0 : HEAD_CHUNK, ith);
    }
}

/* y[r][h] = M_h x[r][h] over the pool (or this thread for small work). */
static void head_matmul(struct job *j, struct kvr_pool *pool, const struct kvr_matrix *m0,
                        size_t stride, const float *x, size_t x_row, size_t x_head, float *y,
                        size_t y_row, size_t y_head)
{
    j->m0 = m0, j->m_stride = stride, j->x = x, j->x_row = x_row, j->x_head = x_head;
    j->y = y, j->y_row = y_row, j->y_head = y_head;
    run(pool, head_matmul_worker, j,
        (double)j->n_rows * j->w->hp->n_head * (double)m0->n_in * (double)m0->n_out);
}

void kvr_mla_attention(struct kvr_mla_work *w, const struct kvr_mla_layer *l, struct kvr_kv *kv,
                       uint32_t layer, const float *x, uint32_t n_rows, const uint32_t *row_seq,
                       const uint32_t *row_pos, float *out, struct kvr_pool *pool)
{
    const struct kvr_hparams *hp = w->hp;
    const struct kvr_mla_hparams *m = &hp->mla;
    const size_t H = hp->n_head, L = m->kv_lora_rank, R = m->n_rope, D = L + R;
    const size_t qk = m->n_nope + R;
    if (m->q_lora_rank) {
        const struct kvr_matrix *ws[2] = {&l->wq_a, &l->wkv_a};
        float *ys[2] = {w->qa, w->kva};
        if (l->wq_a.type == l->wkv_a.type) {
            kvr_matmul_pool(pool, w->xq, x, n_rows, 2, ws, ys);
        } else {
            kvr_matmul_pool(pool, w->xq, x, n_rows, 1, &ws[0], &ys[0]);
            kvr_matmul_pool(pool, w->xq, x, n_rows, 1, &ws[1], &ys[1]);
        }
        for (uint32_t r = 0; r < n_rows; r++)
            rmsnorm(w->qa + (size_t)r * m->q_lora_rank, l->q_a_norm, m->q_lora_rank, hp->norm_eps);
        const struct kvr_matrix *wb = &l->wq_b;
        kvr_matmul_pool(pool, w->xq, w->qa, n_rows, 1, &wb, &w->q);
    } else {
        const struct kvr_matrix *ws[2] = {&l->wq, &l->wkv_a};
        float *ys[2] = {w->q, w->kva};
        bool same = l->wq.type == l->wkv_a.type;
        kvr_matmul_pool(pool, w->xq, x, n_rows, same ? 2 : 1, ws, ys);
        if (!same)
            kvr_matmul_pool(pool, w->xq, x, n_rows, 1, &ws[1], &ys[1]);
    }
    struct job j = {.w = w,
                    .l = l,
                    .kv = kv,
                    .layer = layer,
                    .n_rows = n_rows,
                    .row_seq = row_seq,
                    .row_pos = row_pos};
    run(pool, rope_store_worker, &j, (double)n_rows * H * qk);
    /* q_nope of head h (n_nope values at q[r][h qk]) through K_h, into qf[r][h] after its
     * rope slice. */
    head_matmul(&j, pool, &l->wk_b, l->k_b_stride, w->q, H * qk, qk, w->qf + R, H * D, D);
    double att = 0;
    for (uint32_t r = 0; r < n_rows; r++)
        att += (double)(row_pos[r] + 1) * H * D * 2;
    run(pool, attention_worker, &j, att);
    head_matmul(&j, pool, &l->wv_b, l->v_b_stride, w->lat, H * L, L, out, H * m->n_v, m->n_v);
}

/* ---- the plain reference ------------------------------------------------------------ */

/* y = M x in double over rows dequantized to floats (row: M's n_in floats of scratch). */
static void ref_matvec(const struct kvr_matrix *mt, const double *x, double *y, float *row)
{
    for (int64_t o = 0; o < mt->n_out; o++) {
        kvr_matrix_get_row(mt, o, row);
        double s = 0;
        for (int64_t i = 0; i < mt->n_in; i++)
            s += (double)row[i] * x[i];
        y[o] = s;
    }
}

static void ref_norm(double *x, const float *wt, uint32_t n, float eps)
{
    double ss = 0;
    for (uint32_t i = 0; i < n; i++)
        ss += x[i] * x[i];
    double scale = 1.0 / sqrt(ss / n + eps);
    for (uint32_t i = 0; i < n; i++)
        x[i] = x[i] * scale * wt[i];
}

static void ref_rope(const struct kvr_hparams *hp, uint32_t pos, double *v)
{
    float cos_t[MAX_ROPE / 2], sin_t[MAX_ROPE / 2];
    rope_tables(hp, pos, cos_t, sin_t);
    for (uint32_t i = 0; i < hp->mla.n_rope / 2; i++) {
        double x0 = v[2 * i], x1 = v[2 * i + 1];
        v[2 * i] = x0 * cos_t[i] - x1 * sin_t[i];
        v[2 * i + 1] = x0 * sin_t[i] + x1 * cos_t[i];
    }
}

int kvr_mla_attention_ref(const struct kvr_hparams *hp, const struct kvr_mla_layer *l,
                          const float *x, uint32_t n_pos, float *out)
{
    const struct kvr_mla_hparams *m = &hp->mla;
    const uint32_t H = hp->n_head, L = m->kv_lora_rank, R = m->n_rope, N = m->n_nope;
    const uint32_t qk = N + R, E = hp->n_embd, ql = m->q_lora_rank;
    size_t wide = E > L ? E : L;
    wide = wide > ql ? wide : ql;
    wide = wide > (size_t)H * qk ? wide : (size_t)H * qk;
    double *xd = kvr_calloc(wide, sizeof *xd), *q = kvr_calloc((size_t)H * qk, sizeof *q);
    double *qa = kvr_calloc(ql + 1, sizeof *qa),
           *kv = kvr_calloc((size_t)n_pos * (L + R), sizeof *kv);
    double *kn = kvr_calloc((size_t)n_pos * H * N, sizeof *kn);
    double *vv = kvr_calloc((size_t)n_pos * H * m->n_v, sizeof *vv);
    double *p = kvr_calloc(n_pos, sizeof *p), *tmp = kvr_calloc(wide, sizeof *tmp);
    float *row = kvr_calloc(wide, sizeof *row);
    int rc = KVR_ENOMEM;
    if (!xd || !q || !qa || !kv || !kn || !vv || !p || !tmp || !row)
        goto done;
    for (uint32_t t = 0; t < n_pos; t++) {
        double *c = kv + (size_t)t * (L + R);
        for (uint32_t i = 0; i < E; i++)
            xd[i] = x[(size_t)t * E + i];
        ref_matvec(&l->wkv_a, xd, c, row);
        ref_norm(c, l->kv_a_norm, L, hp->norm_eps);
        ref_rope(hp, t, c + L);
        for (uint32_t h = 0; h < H; h++) {
            struct kvr_matrix kb = head_matrix(&l->wk_b, l->k_b_stride, h);
            struct kvr_matrix vb = head_matrix(&l->wv_b, l->v_b_stride, h);
            for (uint32_t i = 0; i < N; i++)
                kn[((size_t)t * H + h) * N + i] = 0;
            for (uint32_t jj = 0; jj < L; jj++) { /* k_nope = K_h c: K_h^T is k_b's rows */
                kvr_matrix_get_row(&kb, jj, row);
                for (uint32_t i = 0; i < N; i++)
                    kn[((size_t)t * H + h) * N + i] += (double)row[i] * c[jj];
            }
            ref_matvec(&vb, c, vv + ((size_t)t * H + h) * m->n_v, row);
        }
        if (t + 1 < n_pos)
            continue;
        if (ql) {
            ref_matvec(&l->wq_a, xd, qa, row);
            ref_norm(qa, l->q_a_norm, ql, hp->norm_eps);
            ref_matvec(&l->wq_b, qa, q, row);
        } else {
            ref_matvec(&l->wq, xd, q, row);
        }
    }
    for (uint32_t h = 0; h < H; h++) {
        double *qh = q + (size_t)h * qk, mx = -INFINITY, sum = 0;
        ref_rope(hp, n_pos - 1, qh + N);
        for (uint32_t t = 0; t < n_pos; t++) {
            const double *c = kv + (size_t)t * (L + R), *k = kn + ((size_t)t * H + h) * N;
            double s = 0;
            for (uint32_t i = 0; i < N; i++)
                s += qh[i] * k[i];
            for (uint32_t i = 0; i < R; i++)
                s += qh[N + i] * c[L + i];
            p[t] = s * m->kq_scale;
            mx = p[t] > mx ? p[t] : mx;
        }
        for (uint32_t t = 0; t < n_pos; t++)
            sum += (p[t] = exp(p[t] - mx));
        for (uint32_t i = 0; i < m->n_v; i++) {
            double o = 0;
            for (uint32_t t = 0; t < n_pos; t++)
                o += p[t] / sum * vv[((size_t)t * H + h) * m->n_v + i];
            out[(size_t)h * m->n_v + i] = (float)o;
        }
    }
    rc = KVR_OK;
done:
    kvr_free(xd), kvr_free(q), kvr_free(qa), kvr_free(kv), kvr_free(kn);
    kvr_free(vv), kvr_free(p), kvr_free(tmp), kvr_free(row);
    return rc;
}
