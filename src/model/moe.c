/* moe.c - mixture-of-experts feed-forward over a batch of rows (see moe.h).
 *
 * Reading order: hyperparameters and tensor views, routing (select), the scratch, the
 * batched path (route -> group pairs per expert -> gate/up matmuls -> SwiGLU -> down
 * matmuls -> weight and scatter -> combine), the shared expert, then the plain reference.
 *
 * Parallel work is a list of matmul tasks (one weight matrix times a block of converted
 * activation rows); their output rows are cut into tiles of 16 and the flat list of tiles
 * is split among the pool's chunks. Since kvr_matmul gives each output element the same
 * bits whatever slice or row block computes it, how tiles fall into chunks, and which rows
 * share an expert's block, never changes a result. */
#include "model/moe.h"

#include "core/alloc.h"
#include "model/attn.h"
#include "model/moe_route.h"
#include "model/gptoss.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Multiply-adds below which a job runs on the calling thread alone (as in engine.c). */
#define SMALL_WORK (256.0 * 1024)
#define TILE 16 /* output rows per unit of matmul work */

/* ---- hyperparameters --------------------------------------------------------------- */

static int opt_u32(const struct kvr_gguf *g, const char *arch, const char *suffix, uint32_t *out,
                   bool *found, struct kvr_err *err)
{
    char key[96];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = kvr_gguf_get_u32(g, key, out, err);
    *found = rc == KVR_OK;
    return rc == KVR_ENOTFOUND ? KVR_OK : rc;
}

int kvr_moe_hparams_read(struct kvr_moe_hparams *mp, const struct kvr_gguf *g, const char *arch,
                         enum kvr_moe_gating gating, bool norm_default, bool shared, uint32_t n_ff,
                         struct kvr_err *err)
{
    memset(mp, 0, sizeof *mp);
    bool found;
    int rc;
    if (strlen(arch) > 32 || (unsigned)gating >= KVR_MOE_GATING_COUNT)
        return kvr_err_set(err, KVR_EINVAL, "moe: bad architecture description");
    if ((rc = opt_u32(g, arch, "expert_count", &mp->n_expert, &found, err)))
        return rc;
    if (!found || mp->n_expert == 0) {
        mp->n_expert = 0;
        return KVR_OK;
    }
    if ((rc = opt_u32(g, arch, "expert_used_count", &mp->n_used, &found, err)))
        return rc;
    if (!found)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: %s.expert_count is set but %s."
                           "expert_used_count is missing",
                           arch, arch);
    mp->n_ff_exp = n_ff;
    if ((rc = opt_u32(g, arch, "expert_feed_forward_length", &mp->n_ff_exp, &found, err)))
        return rc;
    if (shared) {
        if ((rc = opt_u32(g, arch, "expert_shared_feed_forward_length", &mp->n_ff_shexp, &found,
                          err)))
            return rc;
        if (!found || mp->n_ff_shexp == 0)
            return kvr_err_set(err, KVR_EFORMAT,
                               "model: %s needs %s."
                               "expert_shared_feed_forward_length",
                               arch, arch);
    }
    mp->gating = gating;
    mp->norm_topk = norm_default;
    if (mp->n_expert > KVR_MOE_MAX_EXPERTS || mp->n_used == 0 || mp->n_used > mp->n_expert ||
        mp->n_used > KVR_MOE_MAX_USED || mp->n_ff_exp == 0 || mp->n_ff_exp > 262144 ||
        mp->n_ff_shexp > 262144)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: implausible experts (%u experts, %u "
                           "used, width %u, shared %u; at most %d experts, %d used)",
                           mp->n_expert, mp->n_used, mp->n_ff_exp, mp->n_ff_shexp,
                           KVR_MOE_MAX_EXPERTS, KVR_MOE_MAX_USED);
    return KVR_OK;
}

/* ---- tensor views -------------------------------------------------------------------- */

/* View tensor `name` of shape [n_in, n_out, n_mat] (n_mat = 0: a 2D tensor; n_out = 1 also
 * accepts the 1D [n_in]) as matrix 0 of the stack; *stride = bytes per matrix. */
static int view_stack(const struct kvr_gguf *g, const char *name, int64_t n_in, int64_t n_out,
                      int64_t n_mat, struct kvr_matrix *m, size_t *stride, struct kvr_err *err)
{
    const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, name);
    if (!t)
        return kvr_err_set(err, KVR_EFORMAT, "model: missing tensor %s", name);
    uint32_t want_dims = n_mat ? 3 : 2;
    bool one_d = !n_mat && n_out == 1 && t->n_dims == 1;
    if ((!one_d && t->n_dims != want_dims) || t->ne[0] != n_in || t->ne[1] != n_out ||
        (n_mat && t->ne[2] != n_mat))
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: tensor %s has shape [%lld, %lld, %lld] "
                           "(%u dims), expected [%lld, %lld, %lld]",
                           name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                           t->n_dims, (long long)n_in, (long long)n_out,
                           (long long)(n_mat ? n_mat : 1));
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(t->type);
    size_t row_bytes, mat_bytes, all_bytes;
    if (!tr || !tr->dot || !kvr_dtype_is_weight(t->type) ||
        !kvr_dtype_row_bytes(t->type, n_in, &row_bytes))
        return kvr_err_set(err, KVR_ENOTSUP, "model: tensor %s has unsupported type %d", name,
                           t->type);
    if (!kvr_mul_size(row_bytes, (size_t)n_out, &mat_bytes) ||
        !kvr_mul_size(mat_bytes, (size_t)(n_mat ? n_mat : 1), &all_bytes) ||
        all_bytes != t->n_bytes)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: tensor %s holds %zu bytes, its shape "
                           "needs another size",
                           name, t->n_bytes);
    if (t->type == KVR_DTYPE_F32 && (uintptr_t)t->data % sizeof(float))
        return kvr_err_set(err, KVR_EFORMAT, "model: tensor %s is not 4-byte aligned", name);
    *m = (struct kvr_matrix){.type = (enum kvr_dtype)t->type,
                             .n_in = n_in,
                             .n_out = n_out,
                             .row_bytes = row_bytes,
                             .data = t->data};
    if (stride)
        *stride = mat_bytes;
    return KVR_OK;
}

/* An f32 vector [n] (a missing optional one leaves *out NULL). */
static int view_bias(const struct kvr_gguf *g, const char *name, int64_t n, bool required,
                     const float **out, struct kvr_err *err)
{
    const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, name);
    if (!t)
        return required ? kvr_err_set(err, KVR_EFORMAT, "model: missing tensor %s", name) : KVR_OK;
    if (t->type != KVR_DTYPE_F32 || t->n_dims != 1 || t->ne[0] != n ||
        (uintptr_t)t->data % sizeof(float))
        return kvr_err_set(err, KVR_EFORMAT, "model: tensor %s must be f32 [%lld], 4-aligned", name,
                           (long long)n);
    *out = t->data;
    return KVR_OK;
}

int kvr_moe_layer_view(struct kvr_moe_layer *l, const struct kvr_gguf *g, uint32_t il,
                       uint32_t n_embd, const struct kvr_moe_hparams *mp, struct kvr_err *err)
{
    memset(l, 0, sizeof *l);
    char name[96];
    int64_t d = n_embd, ff = mp->n_ff_exp, ne = mp->n_expert, sh = mp->n_ff_shexp;
    int rc;
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%u." suffix, il), name)
    if ((rc = view_stack(g, NAME("ffn_gate_inp.weight"), d, ne, 0, &l->router, NULL, err)) ||
        (rc = view_stack(g, NAME("ffn_gate_exps.weight"), d, ff, ne, &l->gate, &l->gate_stride,
                         err)) ||
        (rc = view_stack(g, NAME("ffn_up_exps.weight"), d, ff, ne, &l->up, &l->up_stride, err)) ||
        (rc = view_stack(g, NAME("ffn_down_exps.weight"), ff, d, ne, &l->down, &l->down_stride,
                         err)))
        return rc;
    if (sh &&
        ((!mp->shared_plain && (rc = view_stack(g, NAME("ffn_gate_inp_shexp.weight"), d, 1, 0,
                                                &l->sh_gate_inp, NULL, err))) ||
         (rc = view_stack(g, NAME("ffn_gate_shexp.weight"), d, sh, 0, &l->sh_gate, NULL, err)) ||
         (rc = view_stack(g, NAME("ffn_up_shexp.weight"), d, sh, 0, &l->sh_up, NULL, err)) ||
         (rc = view_stack(g, NAME("ffn_down_shexp.weight"), sh, d, 0, &l->sh_down, NULL, err))))
        return rc;
    if (mp->probs_bias && (rc = view_bias(g, NAME("exp_probs_b.bias"), ne, mp->probs_bias_required,
                                          &l->probs_b, err)))
        return rc;
#undef NAME
    if (mp->biases && (rc = kvr_moe_view_biases(l, g, il, n_embd, mp, err)))
        return rc;
    return KVR_OK;
}

struct kvr_matrix kvr_moe_expert_matrix(const struct kvr_moe_layer *l, int which, uint32_t e)
{
    const struct kvr_matrix *base = which == 0 ? &l->gate : which == 1 ? &l->up : &l->down;
    size_t stride = which == 0 ? l->gate_stride : which == 1 ? l->up_stride : l->down_stride;
    struct kvr_matrix m = *base;
    m.data = (const char *)base->data + (size_t)e * stride;
    m.packed = NULL;
    return m;
}

static double matrix_bytes(const struct kvr_matrix *m)
{
    return (double)m->row_bytes * (double)m->n_out;
}

double kvr_moe_layer_bytes_per_token(const struct kvr_moe_layer *l,
                                     const struct kvr_moe_hparams *mp)
{
    double experts = (double)l->gate_stride + (double)l->up_stride + (double)l->down_stride;
    double shared = mp->n_ff_shexp ? matrix_bytes(&l->sh_gate_inp) + matrix_bytes(&l->sh_gate) +
                                         matrix_bytes(&l->sh_up) + matrix_bytes(&l->sh_down)
                                   : 0.0;
    return matrix_bytes(&l->router) + (double)mp->n_used * experts + shared;
}

/* ---- routing ------------------------------------------------------------------------- */

void kvr_moe_select_b(const struct kvr_moe_hparams *mp, const float *logits, const float *probs_b,
                      uint32_t *ids, float *weights)
{
    if (kvr_moe_route_scored(mp, probs_b)) {
        kvr_moe_select_scored(mp, logits, probs_b, ids, weights);
        return;
    }
    kvr_moe_select(mp, logits, ids, weights);
}

void kvr_moe_select(const struct kvr_moe_hparams *mp, const float *logits, uint32_t *ids,
                    float *weights)
{
    if (kvr_moe_route_scored(mp, NULL)) {
        kvr_moe_select_scored(mp, logits, NULL, ids, weights);
        return;
    }
    const uint32_t n = mp->n_expert, k = mp->n_used;
    kvr_moe_top_k(logits, n, k, ids);
    float max = logits[ids[0]];
    if (!isfinite(max)) { /* no usable logit: spread the weight evenly */
        for (uint32_t s = 0; s < k; s++)
            weights[s] = 1.0f / (float)k;
        return;
    }
    double sum = 0.0;
    if (mp->gating == KVR_MOE_GATING_SOFTMAX_TOPK) {
        for (uint32_t s = 0; s < k; s++) {
            float l = logits[ids[s]];
            weights[s] = isnan(l) ? 0.0f : expf(l - max);
            sum += weights[s];
        }
    } else {
        for (uint32_t e = 0; e < n; e++)
            sum += isnan(logits[e]) ? 0.0 : (double)expf(logits[e] - max);
        for (uint32_t s = 0; s < k; s++) {
            float l = logits[ids[s]];
            weights[s] = isnan(l) ? 0.0f : expf(l - max);
        }
    }
    float inv = (float)(1.0 / sum);
    for (uint32_t s = 0; s < k; s++)
        weights[s] *= inv;
    if (mp->gating == KVR_MOE_GATING_SOFTMAX && mp->norm_topk) {
        double sel = 0.0;
        for (uint32_t s = 0; s < k; s++)
            sel += weights[s];
        float inv_sel = (float)(1.0 / sel);
        for (uint32_t s = 0; s < k; s++)
            weights[s] *= inv_sel;
    }
    if (mp->w_scale != 0.0f && mp->w_scale != 1.0f) /* DeepSeek V2's softmax routing */
        for (uint32_t s = 0; s < k; s++)
            weights[s] *= mp->w_scale;
}

/* ---- scratch --------------------------------------------------------------------------- */

/* One matmul of the parallel phases: y (n_rows x m.n_out, row stride m.n_out) = xq . m. */
struct mm_task {
    struct kvr_matrix m;
    const void *xq;
    uint32_t n_rows;
    float *y;
};

struct kvr_moe_work {
    struct kvr_moe_hparams mp;
    uint32_t n_embd;
    uint32_t max_rows;
    size_t max_pairs;        /* max_rows * n_used */
    struct kvr_attn_ops act; /* for its SwiGLU (the engine's choice of kernel set) */

    float *logits;  /* [max_rows x n_expert] router logits */
    uint32_t *ids;  /* [max_pairs] routing of kvr_moe_forward */
    float *weights; /* [max_pairs] */
    float *pairs;   /* [max_pairs x n_embd] per-pair outputs of kvr_moe_forward */

    /* Pairs grouped by expert: group g (0..n_group) holds pair_of[first[e] .. first[e] +
     * count[e]) for expert active[g]; rows in each group in pair order. */
    uint32_t *count;  /* [n_expert] */
    uint32_t *first;  /* [n_expert] */
    uint32_t *active; /* [n_expert] experts with pairs, ascending */
    uint32_t n_active;
    uint32_t *pair_of;     /* [max_pairs] grouped index -> pair index */
    struct mm_task *tasks; /* [2 * n_expert + 2] */

    void *xq;         /* [max_rows] rows of x converted (router, shared expert) */
    void *xg, *xg_up; /* [max_pairs] gathered rows for gate and up (up: only when
                         its type differs from gate's) */
    float *g, *u;     /* [max_pairs x max(n_ff_exp, n_ff_shexp)] */
    void *hq;         /* [max_pairs] SwiGLU rows converted for down */
    float *d;         /* [max_pairs x n_embd] down outputs, grouped order */
    float *sh_gl;     /* [max_rows] shared-expert gate logits */
};

static size_t max_act(size_t best, const struct kvr_matrix *m)
{
    if (!m->data)
        return best;
    size_t b = kvr_act_row_bytes(m->type, m->n_in);
    return b > best ? b : best;
}

void kvr_moe_work_destroy(struct kvr_moe_work *w)
{
    if (!w)
        return;
    void *bufs[] = {w->logits, w->ids,     w->weights, w->pairs, w->count, w->first,
                    w->active, w->pair_of, w->tasks,   w->xq,    w->xg,    w->xg_up,
                    w->g,      w->u,       w->hq,      w->d,     w->sh_gl};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        kvr_free(bufs[i]);
    kvr_free(w);
}

static void *alloc_n(size_t n, size_t elem, int *failed)
{
    size_t bytes;
    if (!kvr_mul_size(n, elem, &bytes) || !kvr_add_size(bytes, 64, &bytes)) {
        *failed = 1;
        return NULL;
    }
    void *p = kvr_aligned_alloc(64, bytes);
    if (!p)
        *failed = 1;
    return p;
}

int kvr_moe_work_create(struct kvr_moe_work **out, uint32_t n_embd,
                        const struct kvr_moe_hparams *mp, const struct kvr_moe_layer *layers,
                        uint32_t n_layers, uint32_t max_rows, struct kvr_err *err)
{
    *out = NULL;
    if (!mp->n_expert || !mp->n_used || mp->n_used > mp->n_expert ||
        mp->n_expert > KVR_MOE_MAX_EXPERTS || mp->n_used > KVR_MOE_MAX_USED || !max_rows || !n_embd)
        return kvr_err_set(err, KVR_EINVAL, "moe: bad expert shape or row width");
    struct kvr_moe_work *w = kvr_calloc(1, sizeof *w);
    if (!w)
        return kvr_err_set(err, KVR_ENOMEM, "moe: out of memory");
    w->mp = *mp;
    w->n_embd = n_embd;
    w->max_rows = max_rows;
    w->max_pairs = (size_t)max_rows * mp->n_used;
    kvr_kernels_init();
    w->act = kvr_kernels_avx2_ok() ? kvr_attn_ops_avx2 : kvr_attn_ops_plain; /* as the engine */

    size_t act_x = 0, act_pair = 0, act_h = 0;
    for (uint32_t i = 0; i < n_layers; i++) {
        const struct kvr_moe_layer *l = &layers[i];
        act_x = max_act(max_act(max_act(act_x, &l->router), &l->sh_gate), &l->sh_up);
        act_x = max_act(act_x, &l->sh_gate_inp);
        act_pair = max_act(max_act(act_pair, &l->gate), &l->up);
        act_h = max_act(max_act(act_h, &l->down), &l->sh_down);
    }
    size_t ff = mp->n_ff_exp > mp->n_ff_shexp ? mp->n_ff_exp : mp->n_ff_shexp;
    size_t P = w->max_pairs, R = max_rows, E = mp->n_expert;
    int failed = 0;
    w->logits = alloc_n(R * E, sizeof(float), &failed);
    w->ids = alloc_n(P, sizeof *w->ids, &failed);
    w->weights = alloc_n(P, sizeof *w->weights, &failed);
    w->pairs = alloc_n(P * n_embd, sizeof(float), &failed);
    w->count = alloc_n(E, sizeof *w->count, &failed);
    w->first = alloc_n(E, sizeof *w->first, &failed);
    w->active = alloc_n(E, sizeof *w->active, &failed);
    w->pair_of = alloc_n(P, sizeof *w->pair_of, &failed);
    w->tasks = alloc_n(2 * E + 2, sizeof *w->tasks, &failed);
    w->xq = alloc_n(R, act_x ? act_x : 1, &failed);
    w->xg = alloc_n(P, act_pair ? act_pair : 1, &failed);
    w->xg_up = alloc_n(P, act_pair ? act_pair : 1, &failed);
    w->g = alloc_n(P, ff * sizeof(float), &failed);
    w->u = alloc_n(P, ff * sizeof(float), &failed);
    w->hq = alloc_n(P, act_h ? act_h : 1, &failed);
    w->d = alloc_n(P * n_embd, sizeof(float), &failed);
    w->sh_gl = alloc_n(R, sizeof(float), &failed);
    if (failed) {
        kvr_moe_work_destroy(w);
        return kvr_err_set(err, KVR_ENOMEM,
                           "moe: cannot allocate scratch for %u rows x %u "
                           "experts",
                           max_rows, mp->n_used);
    }
    *out = w;
    return KVR_OK;
}

/* ---- parallel helpers ------------------------------------------------------------------ */

struct mm_job {
    const struct mm_task *tasks;
    uint32_t n_tasks;
    uint64_t n_tiles; /* sum over tasks of ceil(n_out / TILE) */
};

static uint64_t tiles_of(const struct mm_task *t)
{
    return t->n_rows ? ((uint64_t)t->m.n_out + TILE - 1) / TILE : 0;
}

/* Chunk c of n takes tiles [n_tiles * c / n, n_tiles * (c + 1) / n) of the flat list. */
static void mm_worker(void *arg, int c, int n)
{
    const struct mm_job *job = arg;
    uint64_t tb = job->n_tiles * (uint64_t)c / (uint64_t)n;
    uint64_t te = job->n_tiles * (uint64_t)(c + 1) / (uint64_t)n;
    uint64_t at = 0;
    for (uint32_t i = 0; i < job->n_tasks && at < te; i++) {
        const struct mm_task *t = &job->tasks[i];
        uint64_t nt = tiles_of(t);
        if (at + nt > tb) {
            uint64_t b = tb > at ? tb - at : 0, e = te - at < nt ? te - at : nt;
            int64_t ob = (int64_t)(b * TILE), oe = (int64_t)(e * TILE);
            if (oe > t->m.n_out)
                oe = t->m.n_out;
            kvr_matmul(&t->m, t->xq, t->n_rows, t->y, t->m.n_out, ob, oe);
        }
        at += nt;
    }
}

static void run_tasks(const struct mm_task *tasks, uint32_t n_tasks, struct kvr_pool *pool)
{
    struct mm_job job = {tasks, n_tasks, 0};
    double work = 0;
    for (uint32_t i = 0; i < n_tasks; i++) {
        job.n_tiles += tiles_of(&tasks[i]);
        work += (double)tasks[i].m.n_in * (double)tasks[i].m.n_out * tasks[i].n_rows;
    }
    if (!job.n_tiles)
        return;
    if (!pool || work < SMALL_WORK) {
        mm_worker(&job, 0, 1);
        return;
    }
    uint64_t n_chunks = 4 * (uint64_t)kvr_pool_size(pool);
    kvr_pool_run_chunks(pool, mm_worker, &job,
                        (int)(n_chunks < job.n_tiles ? n_chunks : job.n_tiles));
}

/* Row-wise jobs over n_values values in all: on the pool only when large enough. */
static void run_rows(struct kvr_pool *pool, kvr_pool_fn fn, void *job, double n_values)
{
    if (pool && n_values * 8 >= SMALL_WORK)
        kvr_pool_run(pool, fn, job);
    else
        fn(job, 0, 1);
}

struct quant_job {
    enum kvr_dtype type;
    const float *x;
    int64_t n_in;
    uint32_t n_rows;
    void *dst;
};

static void quant_worker(void *arg, int ith, int nth)
{
    const struct quant_job *j = arg;
    long b, e;
    kvr_split_range((long)j->n_rows, ith, nth, &b, &e);
    if (b < e)
        kvr_quantize_rows(j->type, j->x, j->n_in, b, e, j->dst);
}

static void quantize(struct kvr_pool *pool, enum kvr_dtype type, const float *x, int64_t n_in,
                     uint32_t n_rows, void *dst)
{
    struct quant_job j = {type, x, n_in, n_rows, dst};
    run_rows(pool, quant_worker, &j, (double)n_rows * (double)n_in);
}

/* ---- step 1: route ---------------------------------------------------------------------- */

void kvr_moe_route(struct kvr_moe_work *w, const struct kvr_moe_layer *l, const float *x,
                   uint32_t n_rows, uint32_t *ids, float *weights, struct kvr_pool *pool)
{
    quantize(pool, l->router.type, x, w->n_embd, n_rows, w->xq);
    struct mm_task t = {l->router, w->xq, n_rows, w->logits};
    run_tasks(&t, 1, pool);
    if (l->router_b)
        kvr_moe_add_bias(w->logits, n_rows, w->mp.n_expert, l->router_b);
    for (uint32_t r = 0; r < n_rows; r++)
        kvr_moe_select_b(&w->mp, w->logits + (size_t)r * w->mp.n_expert, l->probs_b,
                         ids + (size_t)r * w->mp.n_used, weights + (size_t)r * w->mp.n_used);
}

/* ---- step 2: experts -------------------------------------------------------------------- */

/* Group the held pairs by expert (a counting sort: groups in expert order, pairs in pair
 * order within a group). Returns the number of grouped pairs. */
static uint32_t group_pairs(struct kvr_moe_work *w, uint32_t n_pairs, const uint32_t *ids,
                            const uint8_t *held)
{
    const uint32_t E = w->mp.n_expert;
    memset(w->count, 0, E * sizeof *w->count);
    for (uint32_t p = 0; p < n_pairs; p++)
        if (!held || held[ids[p]])
            w->count[ids[p]]++;
    uint32_t at = 0;
    w->n_active = 0;
    for (uint32_t e = 0; e < E; e++) {
        w->first[e] = at;
        at += w->count[e];
        if (w->count[e])
            w->active[w->n_active++] = e;
        w->count[e] = 0; /* reused as the fill cursor below */
    }
    for (uint32_t p = 0; p < n_pairs; p++)
        if (!held || held[ids[p]]) {
            uint32_t e = ids[p];
            w->pair_of[w->first[e] + w->count[e]++] = p;
        }
    return at;
}

struct pair_job {
    struct kvr_moe_work *w;
    const struct kvr_moe_layer *l;
    const float *x;
    const float *weights;
    const uint32_t *ids; /* routing of the pairs (NULL: the shared expert's rows) */
    float *out;
    uint32_t n_grouped;
    uint32_t ff;           /* hidden width of the rows in g/u */
    enum kvr_dtype h_type; /* the down matrix's type */
};

/* Gather: pair g's row of x, converted for gate (and up), into xg[g]. Converting a row once
 * per pair instead of once per row costs n_embd per pair against the expert's n_embd x
 * n_ff, and a row's conversion never depends on where it is written. */
static void gather_worker(void *arg, int ith, int nth)
{
    const struct pair_job *j = arg;
    struct kvr_moe_work *w = j->w;
    const struct kvr_moe_layer *l = j->l;
    size_t sg = kvr_act_row_bytes(l->gate.type, w->n_embd);
    size_t su = kvr_act_row_bytes(l->up.type, w->n_embd);
    long b, e;
    kvr_split_range((long)j->n_grouped, ith, nth, &b, &e);
    for (long g = b; g < e; g++) {
        const float *row = j->x + (size_t)(w->pair_of[g] / w->mp.n_used) * w->n_embd;
        kvr_quantize_rows(l->gate.type, row, w->n_embd, 0, 1, (char *)w->xg + (size_t)g * sg);
        if (l->up.type != l->gate.type)
            kvr_quantize_rows(l->up.type, row, w->n_embd, 0, 1, (char *)w->xg_up + (size_t)g * su);
    }
}

/* SwiGLU of grouped rows, each converted for the down matrix. */
static void act_worker(void *arg, int ith, int nth)
{
    const struct pair_job *j = arg;
    struct kvr_moe_work *w = j->w;
    long b, e;
    kvr_split_range((long)j->n_grouped, ith, nth, &b, &e);
    for (long g = b; g < e; g++) {
        float *gr = w->g + (size_t)g * j->ff, *ur = w->u + (size_t)g * j->ff;
        if (j->ids && j->l->gate_b) { /* gpt-oss: the expert's biases, then its SwiGLU */
            size_t at = (size_t)j->ids[w->pair_of[g]] * j->ff;
            kvr_moe_add_bias(gr, 1, j->ff, j->l->gate_b + at);
            kvr_moe_add_bias(ur, 1, j->ff, j->l->up_b + at);
        }
        if (j->ids && w->mp.swiglu_oai)
            kvr_swiglu_oai(gr, ur, j->ff);
        else
            w->act.swiglu(gr, ur, j->ff);
    }
    if (b < e)
        kvr_quantize_rows(j->h_type, w->g, j->ff, b, e, w->hq);
}

/* out[pair] = weight * down output, for the grouped rows. */
static void scatter_worker(void *arg, int ith, int nth)
{
    const struct pair_job *j = arg;
    struct kvr_moe_work *w = j->w;
    const uint32_t d = w->n_embd;
    long b, e;
    kvr_split_range((long)j->n_grouped, ith, nth, &b, &e);
    for (long g = b; g < e; g++) {
        uint32_t p = w->pair_of[g];
        const float *src = w->d + (size_t)g * d;
        float *dst = j->out + (size_t)p * d, wt = j->weights[p];
        if (j->l->down_b) { /* the bias comes before the routing weight */
            const float *db = j->l->down_b + (size_t)j->ids[p] * d;
            for (uint32_t i = 0; i < d; i++)
                dst[i] = wt * (src[i] + db[i]);
            continue;
        }
        for (uint32_t i = 0; i < d; i++)
            dst[i] = wt * src[i];
    }
}

void kvr_moe_experts(struct kvr_moe_work *w, const struct kvr_moe_layer *l, const float *x,
                     uint32_t n_rows, const uint32_t *ids, const float *weights,
                     const uint8_t *held, float *out, struct kvr_pool *pool)
{
    const uint32_t d = w->n_embd, ff = w->mp.n_ff_exp;
    uint32_t n = group_pairs(w, n_rows * w->mp.n_used, ids, held);
    if (!n)
        return;
    struct pair_job j = {w, l, x, weights, ids, out, n, ff, l->down.type};
    run_rows(pool, gather_worker, &j, (double)n * d);

    size_t sg = kvr_act_row_bytes(l->gate.type, d), su = kvr_act_row_bytes(l->up.type, d);
    const void *xu = l->up.type == l->gate.type ? w->xg : w->xg_up;
    uint32_t nt = 0;
    for (uint32_t i = 0; i < w->n_active; i++) {
        uint32_t e = w->active[i], f = w->first[e], m = w->count[e];
        w->tasks[nt++] =
            (struct mm_task){kvr_moe_expert_matrix(l, 0, e), (const char *)w->xg + (size_t)f * sg,
                             m, w->g + (size_t)f * ff};
        w->tasks[nt++] =
            (struct mm_task){kvr_moe_expert_matrix(l, 1, e), (const char *)xu + (size_t)f * su, m,
                             w->u + (size_t)f * ff};
    }
    run_tasks(w->tasks, nt, pool);
    run_rows(pool, act_worker, &j, (double)n * ff * 4);

    size_t sh = kvr_act_row_bytes(l->down.type, ff);
    nt = 0;
    for (uint32_t i = 0; i < w->n_active; i++) {
        uint32_t e = w->active[i], f = w->first[e], m = w->count[e];
        w->tasks[nt++] =
            (struct mm_task){kvr_moe_expert_matrix(l, 2, e), (const char *)w->hq + (size_t)f * sh,
                             m, w->d + (size_t)f * d};
    }
    run_tasks(w->tasks, nt, pool);
    run_rows(pool, scatter_worker, &j, (double)n * d);
}

/* ---- step 3: combine, and the shared expert ---------------------------------------------- */

void kvr_moe_combine(const float *pairs, uint32_t n_rows, uint32_t n_used, uint32_t n_embd,
                     float *y)
{
    for (uint32_t r = 0; r < n_rows; r++) {
        float *dst = y + (size_t)r * n_embd;
        const float *p = pairs + (size_t)r * n_used * n_embd;
        memcpy(dst, p, n_embd * sizeof(float));
        for (uint32_t s = 1; s < n_used; s++) {
            const float *src = p + (size_t)s * n_embd;
            for (uint32_t i = 0; i < n_embd; i++)
                dst[i] += src[i];
        }
    }
}

static float sigmoidf(float v)
{
    return 1.0f / (1.0f + expf(-v));
}

void kvr_moe_shared(struct kvr_moe_work *w, const struct kvr_moe_layer *l, const float *x,
                    uint32_t n_rows, float *y, struct kvr_pool *pool)
{
    const uint32_t d = w->n_embd, ff = w->mp.n_ff_shexp;
    if (!ff)
        return;
    /* g, u and d are free between kvr_moe_experts calls; n_rows <= max_pairs fits them. */
    struct mm_task t[2];
    quantize(pool, l->sh_gate.type, x, d, n_rows, w->xq);
    t[0] = (struct mm_task){l->sh_gate, w->xq, n_rows, w->g};
    uint32_t nt = 1;
    if (l->sh_up.type == l->sh_gate.type)
        t[nt++] = (struct mm_task){l->sh_up, w->xq, n_rows, w->u};
    run_tasks(t, nt, pool);
    if (nt == 1) {
        quantize(pool, l->sh_up.type, x, d, n_rows, w->xq);
        t[0] = (struct mm_task){l->sh_up, w->xq, n_rows, w->u};
        run_tasks(t, 1, pool);
    }
    if (l->sh_gate_inp.data) {
        quantize(pool, l->sh_gate_inp.type, x, d, n_rows, w->xq);
        t[0] = (struct mm_task){l->sh_gate_inp, w->xq, n_rows, w->sh_gl};
        run_tasks(t, 1, pool);
    }
    struct pair_job j = {w, l, x, NULL, NULL, NULL, n_rows, ff, l->sh_down.type};
    run_rows(pool, act_worker, &j, (double)n_rows * ff * 4);
    t[0] = (struct mm_task){l->sh_down, w->hq, n_rows, w->d};
    run_tasks(t, 1, pool);
    for (uint32_t r = 0; r < n_rows; r++) {
        float gate = l->sh_gate_inp.data ? sigmoidf(w->sh_gl[r]) : 1.0f; /* 1 x: exact */
        float *dst = y + (size_t)r * d;
        const float *src = w->d + (size_t)r * d;
        for (uint32_t i = 0; i < d; i++)
            dst[i] += gate * src[i];
    }
}

void kvr_moe_forward(struct kvr_moe_work *w, const struct kvr_moe_layer *l, const float *x,
                     uint32_t n_rows, float *y, struct kvr_pool *pool)
{
    kvr_moe_route(w, l, x, n_rows, w->ids, w->weights, pool);
    kvr_moe_experts(w, l, x, n_rows, w->ids, w->weights, NULL, w->pairs, pool);
    kvr_moe_combine(w->pairs, n_rows, w->mp.n_used, w->n_embd, y);
    kvr_moe_shared(w, l, x, n_rows, y, pool);
}

void kvr_moe_forward_dispatch(struct kvr_moe_work *w, const struct kvr_moe_layer *l, uint32_t layer,
                              const float *x, uint32_t n_rows, float *y, struct kvr_pool *pool,
                              kvr_moe_dispatch_fn fn, void *ctx)
{
    kvr_moe_route(w, l, x, n_rows, w->ids, w->weights, pool);
    fn(ctx, layer, w, l, x, n_rows, w->ids, w->weights, w->pairs, pool);
    kvr_moe_combine(w->pairs, n_rows, w->mp.n_used, w->n_embd, y);
    kvr_moe_shared(w, l, x, n_rows, y, pool);
}

/* ---- the plain reference ---------------------------------------------------------------- */

size_t kvr_moe_ref_scratch_floats(uint32_t n_embd, const struct kvr_moe_hparams *mp)
{
    size_t ff = mp->n_ff_exp > mp->n_ff_shexp ? mp->n_ff_exp : mp->n_ff_shexp;
    size_t wide = ff > n_embd ? ff : n_embd;
    return (size_t)mp->n_expert + wide + ff + n_embd;
}

/* dot of x with row o of m, the row dequantized to floats, summed in double */
static float ref_dot(const struct kvr_matrix *m, int64_t o, const float *x, float *row)
{
    kvr_matrix_get_row(m, o, row);
    double s = 0.0;
    for (int64_t i = 0; i < m->n_in; i++)
        s += (double)row[i] * x[i];
    return (float)s;
}

/* The biases of one expert's three matrices (gpt-oss), or all NULL. */
struct ref_bias {
    const float *gate, *up, *down;
    bool oai; /* gptoss.h's clamped SwiGLU instead of SiLU */
};

/* out = down(SiLU(gate x) * up x), one row, with the biases of b when it has them */
static void ref_ffn(const struct kvr_matrix *gate, const struct kvr_matrix *up,
                    const struct kvr_matrix *down, const float *x, float *out, float *row, float *h,
                    const struct ref_bias *b)
{
    for (int64_t o = 0; o < gate->n_out; o++) {
        float gv = ref_dot(gate, o, x, row), uv = ref_dot(up, o, x, row);
        gv += b->gate ? b->gate[o] : 0.0f;
        uv += b->up ? b->up[o] : 0.0f;
        h[o] = gv / (1.0f + expf(-gv)) * uv;
        if (b->oai) {
            h[o] = gv;
            kvr_swiglu_oai(&h[o], &uv, 1);
        }
    }
    for (int64_t o = 0; o < down->n_out; o++)
        out[o] = ref_dot(down, o, h, row) + (b->down ? b->down[o] : 0.0f);
}

void kvr_moe_forward_ref(const struct kvr_moe_layer *l, const struct kvr_moe_hparams *mp,
                         uint32_t n_embd, const float *x, float *y, uint32_t *ids, float *scratch)
{
    size_t ff = mp->n_ff_exp > mp->n_ff_shexp ? mp->n_ff_exp : mp->n_ff_shexp;
    size_t wide = ff > n_embd ? ff : n_embd;
    float *logits = scratch, *row = logits + mp->n_expert, *h = row + wide, *o = h + ff;
    for (uint32_t e = 0; e < mp->n_expert; e++)
        logits[e] = ref_dot(&l->router, e, x, row) + (l->router_b ? l->router_b[e] : 0.0f);
    uint32_t sel[KVR_MOE_MAX_USED];
    float wt[KVR_MOE_MAX_USED];
    kvr_moe_select_b(mp, logits, l->probs_b, sel, wt);
    memset(y, 0, n_embd * sizeof(float));
    for (uint32_t s = 0; s < mp->n_used; s++) {
        struct kvr_matrix g = kvr_moe_expert_matrix(l, 0, sel[s]);
        struct kvr_matrix u = kvr_moe_expert_matrix(l, 1, sel[s]);
        struct kvr_matrix dn = kvr_moe_expert_matrix(l, 2, sel[s]);
        size_t fe = mp->n_ff_exp, at = (size_t)sel[s];
        struct ref_bias b = {l->gate_b ? l->gate_b + at * fe : NULL,
                             l->up_b ? l->up_b + at * fe : NULL,
                             l->down_b ? l->down_b + at * n_embd : NULL, mp->swiglu_oai};
        ref_ffn(&g, &u, &dn, x, o, row, h, &b);
        for (uint32_t i = 0; i < n_embd; i++)
            y[i] += wt[s] * o[i];
        if (ids)
            ids[s] = sel[s];
    }
    if (mp->n_ff_shexp) {
        float gate = l->sh_gate_inp.data ? sigmoidf(ref_dot(&l->sh_gate_inp, 0, x, row)) : 1.0f;
        const struct ref_bias none = {NULL, NULL, NULL, false};
        ref_ffn(&l->sh_gate, &l->sh_up, &l->sh_down, x, o, row, h, &none);
        for (uint32_t i = 0; i < n_embd; i++)
            y[i] += gate * o[i];
    }
}
