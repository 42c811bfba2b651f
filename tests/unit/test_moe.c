/* test_moe.c - the expert feed-forward (model/moe.h): the selection rule and gating, the
 * GGUF keys and tensor views, the batched path against the plain reference, and batch,
 * thread and placement invariance (a row's bits alone vs batched, 1 vs 2 threads, all
 * experts at once vs split over two "agents").
 *
 * Models are small GGUF images built in memory: 64-wide rows, 8 or 16 experts of width 96,
 * in F32, F16 and Q8_0, with the three gatings (Mixtral, Qwen3-MoE, Qwen2-MoE with its
 * shared expert). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "core/alloc.h"
#include "core/pool.h"
#include "core/rng.h"
#include "model/arch.h"
#include "model/dtype.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "model/gguf_write.h"
#include "model/moe.h"
#include "model/synth.h"
#include "ring/propose.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define D 64  /* n_embd */
#define FF 96 /* expert width */
#define SH 64 /* shared expert width */
#define MAX_ROWS 40

/* ---- building a model image ---------------------------------------------------------- */

enum style { STYLE_MIXTRAL, STYLE_QWEN3, STYLE_QWEN2, STYLE_OSS };

struct model {
    enum style style;
    int type;
    struct kvr_moe_hparams mp;
    char *buf;
    size_t len;
    struct kvr_gguf *g;
    struct kvr_moe_layer layer;
    void *data[12]; /* tensor data handed to the writer */
    int n_data;
};

static void fill_uniform(float *dst, size_t n, float scale, uint64_t seed)
{
    uint64_t st = seed;
    for (size_t i = 0; i < n; i++)
        dst[i] = scale * ((float)(kvr_splitmix64(&st) >> 40) * 0x1p-23f - 1.0f);
}

/* A tensor of `rows` rows of n_in values in `type`, uniform in [-scale, scale). */
static void *make_tensor(struct model *m, int type, int64_t n_in, int64_t rows, float scale,
                         uint64_t seed)
{
    float *f = malloc((size_t)(n_in * rows) * sizeof(float));
    assert_non_null(f);
    fill_uniform(f, (size_t)(n_in * rows), scale, seed);
    size_t row_bytes;
    assert_true(kvr_dtype_row_bytes(type, n_in, &row_bytes));
    uint8_t *out = malloc(row_bytes * (size_t)rows);
    assert_non_null(out);
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(type);
    for (int64_t r = 0; r < rows; r++)
        tr->from_float(f + r * n_in, out + (size_t)r * row_bytes, n_in);
    free(f);
    m->data[m->n_data++] = out;
    return out;
}

/* arch "llama" (Mixtral: 8 experts, top-2), "qwen3moe" (16 experts, top-4, normalised) or
 * "qwen2moe" (8 experts, top-2, a shared expert). The router's weights are larger than the
 * experts' so routing logits are spread out (as in synth). */
static void build(struct model *m, enum style style, int type, const char *bad_tensor)
{
    memset(m, 0, sizeof *m);
    m->style = style;
    m->type = type;
    const char *arch = style == STYLE_MIXTRAL ? "llama"
                       : style == STYLE_QWEN3 ? "qwen3moe"
                       : style == STYLE_OSS   ? "gpt-oss"
                                              : "qwen2moe";
    uint32_t n_expert = style == STYLE_QWEN3 ? 16 : 8, n_used = style == STYLE_QWEN3 ? 4 : 2;
    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    assert_non_null(w);
    char key[64];
    kvr_gguf_writer_add_str(w, "general.architecture", arch);
#define KEY(s) (snprintf(key, sizeof key, "%s." s, arch), key)
    kvr_gguf_writer_add_u32(w, KEY("expert_count"), n_expert);
    kvr_gguf_writer_add_u32(w, KEY("expert_used_count"), n_used);
    if (style != STYLE_MIXTRAL)
        kvr_gguf_writer_add_u32(w, KEY("expert_feed_forward_length"), FF);
    if (style == STYLE_QWEN2)
        kvr_gguf_writer_add_u32(w, KEY("expert_shared_feed_forward_length"), SH);
#undef KEY
    int64_t ne_router[2] = {D, n_expert};
    int64_t ne_gu[3] = {D, FF, n_expert}, ne_dn[3] = {FF, D, n_expert};
    float s_d = 1.0f / sqrtf((float)D), s_ff = 1.0f / sqrtf((float)FF);
    kvr_gguf_writer_add_tensor(w, "blk.0.ffn_gate_inp.weight", 2, ne_router, KVR_DTYPE_F32,
                               make_tensor(m, KVR_DTYPE_F32, D, n_expert, 4.0f * s_d, 11));
    kvr_gguf_writer_add_tensor(w, "blk.0.ffn_gate_exps.weight", 3, ne_gu, type,
                               make_tensor(m, type, D, FF * n_expert, 1.7f * s_d, 12));
    if (!bad_tensor || strcmp(bad_tensor, "up")) {
        kvr_gguf_writer_add_tensor(w, "blk.0.ffn_up_exps.weight", 3, ne_gu, type,
                                   make_tensor(m, type, D, FF * n_expert, 1.7f * s_d, 13));
    } else { /* the up experts with their last two dims swapped: a wrong shape */
        int64_t ne_bad[3] = {D, n_expert, FF};
        kvr_gguf_writer_add_tensor(w, "blk.0.ffn_up_exps.weight", 3, ne_bad, type,
                                   make_tensor(m, type, D, FF * n_expert, 1.7f * s_d, 13));
    }
    kvr_gguf_writer_add_tensor(w, "blk.0.ffn_down_exps.weight", 3, ne_dn, type,
                               make_tensor(m, type, FF, D * n_expert, 1.7f * s_ff, 14));
    if (style == STYLE_OSS) { /* biases; the gate's and up's wide, so the SwiGLU clamps */
        int64_t ne_rb[1] = {n_expert}, ne_gb[2] = {FF, n_expert}, ne_db[2] = {D, n_expert};
        kvr_gguf_writer_add_tensor(w, "blk.0.ffn_gate_inp.bias", 1, ne_rb, KVR_DTYPE_F32,
                                   make_tensor(m, KVR_DTYPE_F32, n_expert, 1, 0.5f, 21));
        kvr_gguf_writer_add_tensor(w, "blk.0.ffn_gate_exps.bias", 2, ne_gb, KVR_DTYPE_F32,
                                   make_tensor(m, KVR_DTYPE_F32, FF, n_expert, 9.0f, 22));
        kvr_gguf_writer_add_tensor(w, "blk.0.ffn_up_exps.bias", 2, ne_gb, KVR_DTYPE_F32,
                                   make_tensor(m, KVR_DTYPE_F32, FF, n_expert, 9.0f, 23));
        kvr_gguf_writer_add_tensor(w, "blk.0.ffn_down_exps.bias", 2, ne_db, KVR_DTYPE_F32,
                                   make_tensor(m, KVR_DTYPE_F32, D, n_expert, 0.5f, 24));
    }
    if (style == STYLE_QWEN2) {
        int64_t ne_gi[1] = {D}, ne_sgu[2] = {D, SH}, ne_sdn[2] = {SH, D};
        kvr_gguf_writer_add_tensor(w, "blk.0.ffn_gate_inp_shexp.weight", 1, ne_gi, KVR_DTYPE_F32,
                                   make_tensor(m, KVR_DTYPE_F32, D, 1, s_d, 15));
        kvr_gguf_writer_add_tensor(w, "blk.0.ffn_gate_shexp.weight", 2, ne_sgu, type,
                                   make_tensor(m, type, D, SH, 1.7f * s_d, 16));
        kvr_gguf_writer_add_tensor(w, "blk.0.ffn_up_shexp.weight", 2, ne_sgu, type,
                                   make_tensor(m, type, D, SH, 1.7f * s_d, 17));
        kvr_gguf_writer_add_tensor(w, "blk.0.ffn_down_shexp.weight", 2, ne_sdn, type,
                                   make_tensor(m, type, SH, D, 1.7f / sqrtf((float)SH), 18));
    }
    FILE *f = open_memstream(&m->buf, &m->len);
    assert_non_null(f);
    struct kvr_err err = {0};
    assert_int_equal(kvr_gguf_writer_write(w, f, &err), 0);
    assert_int_equal(fclose(f), 0);
    kvr_gguf_writer_destroy(w);
    assert_int_equal(kvr_gguf_open_mem(&m->g, m->buf, m->len, &err), 0);
    bool topk = style == STYLE_MIXTRAL || style == STYLE_OSS;
    int rc = kvr_moe_hparams_read(&m->mp, m->g, arch,
                                  topk ? KVR_MOE_GATING_SOFTMAX_TOPK : KVR_MOE_GATING_SOFTMAX,
                                  style == STYLE_QWEN3, style == STYLE_QWEN2, FF, &err);
    assert_int_equal(rc, 0);
    m->mp.biases = m->mp.swiglu_oai = style == STYLE_OSS; /* as arch.c sets them */
    assert_int_equal(m->mp.n_expert, n_expert);
    assert_int_equal(m->mp.n_used, n_used);
    assert_int_equal(m->mp.n_ff_exp, FF);
    assert_int_equal(m->mp.n_ff_shexp, style == STYLE_QWEN2 ? SH : 0);
    if (!bad_tensor) {
        rc = kvr_moe_layer_view(&m->layer, m->g, 0, D, &m->mp, &err);
        if (rc)
            fail_msg("view: %s", err.msg);
    }
}

static void destroy(struct model *m)
{
    kvr_gguf_close(m->g);
    free(m->buf);
    for (int i = 0; i < m->n_data; i++)
        free(m->data[i]);
}

static void rows_of(float *x, uint32_t n_rows, uint64_t seed)
{
    fill_uniform(x, (size_t)n_rows * D, 1.0f, seed);
}

/* ---- selection and gating -------------------------------------------------------------- */

static void test_select_rule(void **state)
{
    (void)state;
    struct kvr_moe_hparams mp = {
        .n_expert = 6, .n_used = 3, .n_ff_exp = 8, .gating = KVR_MOE_GATING_SOFTMAX_TOPK};
    uint32_t ids[3];
    float w[3];
    /* ties: equal logits go to the lower expert id; NaN ranks below -inf */
    const float ties[6] = {0.5f, 2.0f, NAN, 2.0f, -INFINITY, 0.5f};
    kvr_moe_select(&mp, ties, ids, w);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 3);
    assert_int_equal(ids[2], 0);
    /* softmax over the three selected logits */
    double e0 = 1.0, e2 = exp(0.5 - 2.0), sum = 2 * e0 + e2;
    assert_float_equal(w[0], e0 / sum, 1e-6);
    assert_float_equal(w[1], e0 / sum, 1e-6);
    assert_float_equal(w[2], e2 / sum, 1e-6);

    const float nan_first[6] = {NAN, -INFINITY, -1.0f, NAN, -2.0f, -3.0f};
    kvr_moe_select(&mp, nan_first, ids, w);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 4);
    assert_int_equal(ids[2], 5);

    /* softmax over all six, kept as is (qwen2moe) or renormalised (qwen3moe) */
    const float l[6] = {1.0f, -0.5f, 3.0f, 0.0f, 2.5f, -2.0f};
    mp.gating = KVR_MOE_GATING_SOFTMAX;
    kvr_moe_select(&mp, l, ids, w);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 4);
    assert_int_equal(ids[2], 0);
    double all = 0;
    for (int i = 0; i < 6; i++)
        all += exp(l[i]);
    assert_float_equal(w[0], exp(3.0) / all, 1e-6);
    assert_float_equal(w[2], exp(1.0) / all, 1e-6);
    mp.norm_topk = true;
    kvr_moe_select(&mp, l, ids, w);
    double top = exp(3.0) + exp(2.5) + exp(1.0);
    assert_float_equal(w[0], exp(3.0) / top, 1e-6);
    assert_float_equal(w[1], exp(2.5) / top, 1e-6);
    assert_float_equal(w[0] + w[1] + w[2], 1.0, 1e-6);

    /* no finite logit at all: an even split, never NaN weights */
    const float none[6] = {NAN, NAN, NAN, NAN, NAN, NAN};
    kvr_moe_select(&mp, none, ids, w);
    assert_int_equal(ids[0], 0);
    assert_float_equal(w[1], 1.0 / 3.0, 1e-6);
}

/* ---- keys and views -------------------------------------------------------------------- */

static struct kvr_gguf *keys_only(const char **keys, const uint32_t *vals, int n, char **buf,
                                  size_t *len)
{
    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    kvr_gguf_writer_add_str(w, "general.architecture", "qwen3moe");
    for (int i = 0; i < n; i++)
        kvr_gguf_writer_add_u32(w, keys[i], vals[i]);
    FILE *f = open_memstream(buf, len);
    struct kvr_err err = {0};
    assert_int_equal(kvr_gguf_writer_write(w, f, &err), 0);
    fclose(f);
    kvr_gguf_writer_destroy(w);
    struct kvr_gguf *g = NULL;
    assert_int_equal(kvr_gguf_open_mem(&g, *buf, *len, &err), 0);
    return g;
}

static void test_hparams(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    struct kvr_moe_hparams mp;
    char *buf;
    size_t len;
    /* no expert keys: a dense model */
    struct kvr_gguf *g = keys_only(NULL, NULL, 0, &buf, &len);
    assert_int_equal(
        kvr_moe_hparams_read(&mp, g, "qwen3moe", KVR_MOE_GATING_SOFTMAX, true, false, 128, &err),
        0);
    assert_int_equal(mp.n_expert, 0);
    kvr_gguf_close(g);
    free(buf);

    const char *k1[] = {"qwen3moe.expert_count", "qwen3moe.expert_used_count"};
    uint32_t v1[] = {8, 9}; /* more used than there are */
    g = keys_only(k1, v1, 2, &buf, &len);
    assert_int_equal(
        kvr_moe_hparams_read(&mp, g, "qwen3moe", KVR_MOE_GATING_SOFTMAX, true, false, 128, &err),
        KVR_EFORMAT);
    assert_non_null(strstr(err.msg, "implausible experts"));
    kvr_gguf_close(g);
    free(buf);

    g = keys_only(k1, v1, 1, &buf, &len); /* the used count missing */
    assert_int_equal(
        kvr_moe_hparams_read(&mp, g, "qwen3moe", KVR_MOE_GATING_SOFTMAX, true, false, 128, &err),
        KVR_EFORMAT);
    assert_non_null(strstr(err.msg, "expert_used_count"));
    kvr_gguf_close(g);
    free(buf);

    v1[1] = 2; /* a shared expert needs its width */
    g = keys_only(k1, v1, 2, &buf, &len);
    assert_int_equal(
        kvr_moe_hparams_read(&mp, g, "qwen3moe", KVR_MOE_GATING_SOFTMAX, true, true, 128, &err),
        KVR_EFORMAT);
    assert_non_null(strstr(err.msg, "expert_shared_feed_forward_length"));
    /* without one: the width defaults to feed_forward_length */
    assert_int_equal(
        kvr_moe_hparams_read(&mp, g, "qwen3moe", KVR_MOE_GATING_SOFTMAX, true, false, 128, &err),
        0);
    assert_int_equal(mp.n_ff_exp, 128);
    assert_true(mp.norm_topk);
    kvr_gguf_close(g);
    free(buf);
}

static void test_view_checks(void **state)
{
    (void)state;
    struct model m;
    build(&m, STYLE_MIXTRAL, KVR_DTYPE_F32, "up");
    struct kvr_moe_layer l;
    struct kvr_err err = {0};
    assert_int_equal(kvr_moe_layer_view(&l, m.g, 0, D, &m.mp, &err), KVR_EFORMAT);
    assert_non_null(strstr(err.msg, "blk.0.ffn_up_exps.weight has shape"));
    assert_int_equal(kvr_moe_layer_view(&l, m.g, 1, D, &m.mp, &err), KVR_EFORMAT);
    assert_non_null(strstr(err.msg, "missing tensor blk.1.ffn_gate_inp.weight"));
    destroy(&m);
    build(&m, STYLE_MIXTRAL, KVR_DTYPE_F32, NULL); /* biases wanted, none in the file */
    m.mp.biases = true;
    assert_int_equal(kvr_moe_layer_view(&l, m.g, 0, D, &m.mp, &err), KVR_EFORMAT);
    assert_non_null(strstr(err.msg, "missing tensor blk.0.ffn_gate_inp.bias"));
    destroy(&m);

    build(&m, STYLE_QWEN3, KVR_DTYPE_Q8_0, NULL);
    struct kvr_matrix e5 = kvr_moe_expert_matrix(&m.layer, 2, 5);
    assert_int_equal(e5.n_in, FF);
    assert_int_equal(e5.n_out, D);
    assert_ptr_equal(e5.data, (const char *)m.layer.down.data + 5 * D * (FF / 32 * 34));
    /* a token reads the router and 4 of the 16 experts */
    double expect = D * 16 * 4.0 + 4.0 * 3 * (FF * (D / 32 * 34));
    assert_float_equal(kvr_moe_layer_bytes_per_token(&m.layer, &m.mp), expect, 0.5);
    destroy(&m);
}

/* ---- the batched path -------------------------------------------------------------------- */

static float max_abs(const float *x, size_t n)
{
    float m = 0;
    for (size_t i = 0; i < n; i++)
        m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
    return m;
}

/* The router's k-th and (k+1)-th best logits of row x are this far apart (dequantized). */
static float selection_gap(const struct model *m, const float *x)
{
    float logits[16], row[D];
    for (uint32_t e = 0; e < m->mp.n_expert; e++) {
        kvr_matrix_get_row(&m->layer.router, e, row);
        double s = 0;
        for (int i = 0; i < D; i++)
            s += (double)row[i] * x[i];
        logits[e] = (float)s + (m->layer.router_b ? m->layer.router_b[e] : 0.0f);
    }
    for (uint32_t a = 0; a < m->mp.n_expert; a++) /* sort descending */
        for (uint32_t b = a + 1; b < m->mp.n_expert; b++)
            if (logits[b] > logits[a]) {
                float t = logits[a];
                logits[a] = logits[b];
                logits[b] = t;
            }
    return logits[m->mp.n_used - 1] - logits[m->mp.n_used];
}

/* The batched path against the plain reference, row by row. Quantized weights: the batched
 * path converts activations to Q8_0 (as the engine does), the reference keeps floats, so the
 * tolerance is that of 8-bit activations. */
static void check_against_reference(enum style style, int type, float tol)
{
    struct model m;
    build(&m, style, type, NULL);
    struct kvr_moe_work *w = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_moe_work_create(&w, D, &m.mp, &m.layer, 1, MAX_ROWS, &err), 0);
    float *x = malloc(MAX_ROWS * D * sizeof(float)), *y = malloc(MAX_ROWS * D * sizeof(float));
    float yr[D];
    float *scratch = malloc(kvr_moe_ref_scratch_floats(D, &m.mp) * sizeof(float));
    uint32_t *ids = malloc(MAX_ROWS * m.mp.n_used * sizeof *ids);
    float *wts = malloc(MAX_ROWS * m.mp.n_used * sizeof *wts);
    rows_of(x, MAX_ROWS, 99 + (uint64_t)style);
    kvr_moe_forward(w, &m.layer, x, MAX_ROWS, y, NULL);
    kvr_moe_route(w, &m.layer, x, MAX_ROWS, ids, wts, NULL);
    int checked = 0, used[16] = {0};
    double worst = 0;
    for (uint32_t r = 0; r < MAX_ROWS; r++) {
        /* A router near-tie may legitimately pick differently under quantized arithmetic:
         * such rows are not compared (and counted). */
        if (selection_gap(&m, x + r * D) < 1e-2f)
            continue;
        uint32_t ref_ids[KVR_MOE_MAX_USED];
        kvr_moe_forward_ref(&m.layer, &m.mp, D, x + r * D, yr, ref_ids, scratch);
        for (uint32_t s = 0; s < m.mp.n_used; s++) {
            assert_int_equal(ids[r * m.mp.n_used + s], ref_ids[s]);
            used[ref_ids[s]]++;
        }
        float scale = max_abs(yr, D);
        assert_true(scale > 1e-3f);
        for (int i = 0; i < D; i++) {
            double diff = fabs((double)y[r * D + i] - yr[i]) / scale;
            worst = diff > worst ? diff : worst;
        }
        checked++;
    }
    print_message("style %d %s: %d/%d rows compared, worst relative diff %.2e (tol %.0e)\n", style,
                  kvr_dtype_traits(type)->name, checked, MAX_ROWS, worst, tol);
    assert_true(checked >= MAX_ROWS * 9 / 10);
    assert_true(worst <= tol);
    int n_used_experts = 0; /* the rows exercise most experts, not one */
    for (uint32_t e = 0; e < m.mp.n_expert; e++)
        n_used_experts += used[e] > 0;
    assert_true(n_used_experts >= (int)m.mp.n_expert * 3 / 4);
    free(x);
    free(y);
    free(scratch);
    free(ids);
    free(wts);
    kvr_moe_work_destroy(w);
    destroy(&m);
}

static void test_reference_f32(void **state)
{
    (void)state;
    check_against_reference(STYLE_MIXTRAL, KVR_DTYPE_F32, 1e-5f);
    check_against_reference(STYLE_QWEN3, KVR_DTYPE_F32, 1e-5f);
    check_against_reference(STYLE_QWEN2, KVR_DTYPE_F32, 1e-5f);
    check_against_reference(STYLE_OSS, KVR_DTYPE_F32, 1e-5f);
}

static void test_reference_quantized(void **state)
{
    (void)state;
    check_against_reference(STYLE_MIXTRAL, KVR_DTYPE_F16, 1e-5f);
    check_against_reference(STYLE_MIXTRAL, KVR_DTYPE_Q8_0, 3e-2f);
    check_against_reference(STYLE_QWEN3, KVR_DTYPE_Q8_0, 3e-2f);
    check_against_reference(STYLE_QWEN2, KVR_DTYPE_Q8_0, 3e-2f);
    check_against_reference(STYLE_OSS, KVR_DTYPE_MXFP4, 3e-2f);
}

/* A row gives the same bits alone, in a batch (at any position), with 1 or 2 threads, and
 * with its pairs computed by two "agents" holding complementary experts. */
static void check_invariance(enum style style, int type)
{
    struct model m;
    build(&m, style, type, NULL);
    struct kvr_moe_work *w = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_moe_work_create(&w, D, &m.mp, &m.layer, 1, MAX_ROWS, &err), 0);
    struct kvr_pool *pool = kvr_pool_create(2);
    assert_non_null(pool);
    const uint32_t n = MAX_ROWS, k = m.mp.n_used;
    float *x = malloc(n * D * sizeof(float)), *batched = malloc(n * D * sizeof(float));
    float *threaded = malloc(n * D * sizeof(float)), *split = malloc(n * D * sizeof(float));
    float *pairs = malloc((size_t)n * k * D * sizeof(float));
    uint32_t *ids = malloc(n * k * sizeof *ids);
    float *wts = malloc(n * k * sizeof *wts), alone[D];
    rows_of(x, n, 7);
    kvr_moe_forward(w, &m.layer, x, n, batched, NULL);
    kvr_moe_forward(w, &m.layer, x, n, threaded, pool);
    assert_memory_equal(batched, threaded, n * D * sizeof(float));

    /* two agents: one holds the even experts, the other the odd ones */
    uint8_t even[16], odd[16];
    for (int e = 0; e < 16; e++) {
        even[e] = e % 2 == 0;
        odd[e] = e % 2 == 1;
    }
    kvr_moe_route(w, &m.layer, x, n, ids, wts, pool);
    memset(pairs, 0xff, (size_t)n * k * D * sizeof(float)); /* NaN: any gap would show */
    kvr_moe_experts(w, &m.layer, x, n, ids, wts, even, pairs, NULL);
    kvr_moe_experts(w, &m.layer, x, n, ids, wts, odd, pairs, pool);
    kvr_moe_combine(pairs, n, k, D, split);
    kvr_moe_shared(w, &m.layer, x, n, split, pool);
    assert_memory_equal(batched, split, n * D * sizeof(float));

    for (uint32_t r = 0; r < n; r += 7) {
        kvr_moe_forward(w, &m.layer, x + r * D, 1, alone, r % 2 ? pool : NULL);
        assert_memory_equal(alone, batched + r * D, sizeof alone);
    }
    /* a sub-batch starting elsewhere (other neighbours, other expert groups) */
    kvr_moe_forward(w, &m.layer, x + 3 * D, 5, threaded, pool);
    assert_memory_equal(threaded, batched + 3 * D, 5 * D * sizeof(float));
    free(x);
    free(batched);
    free(threaded);
    free(split);
    free(pairs);
    free(ids);
    free(wts);
    kvr_pool_destroy(pool);
    kvr_moe_work_destroy(w);
    destroy(&m);
}

static void test_invariance(void **state)
{
    (void)state;
    check_invariance(STYLE_MIXTRAL, KVR_DTYPE_F32);
    check_invariance(STYLE_MIXTRAL, KVR_DTYPE_Q8_0);
    check_invariance(STYLE_QWEN3, KVR_DTYPE_Q8_0);
    check_invariance(STYLE_QWEN2, KVR_DTYPE_F16);
    check_invariance(STYLE_OSS, KVR_DTYPE_MXFP4);
}

/* Out of memory at create fails cleanly, at every allocation. */
static void test_create_failures(void **state)
{
    (void)state;
    struct model m;
    build(&m, STYLE_QWEN2, KVR_DTYPE_Q8_0, NULL);
    struct kvr_err err = {0};
    int failures = 0;
    for (long n = 0; n < 64; n++) {
        struct kvr_moe_work *w = NULL;
        kvr_alloc_fail_after(n);
        int rc = kvr_moe_work_create(&w, D, &m.mp, &m.layer, 1, MAX_ROWS, &err);
        kvr_alloc_fail_after(-1);
        if (rc) {
            assert_int_equal(rc, KVR_ENOMEM);
            assert_null(w);
            failures++;
        } else {
            kvr_moe_work_destroy(w);
            break;
        }
    }
    assert_true(failures > 10);
    destroy(&m);
}

/* ---- the engine on MoE models ------------------------------------------------------------ */

#define N_SEQ 5
#define N_STEPS 4 /* the prompt's last row, then 3 decode steps */
static const uint32_t prompt_len[N_SEQ] = {1, 6, 3, 11, 2};

struct synth_model {
    char *buf;
    size_t len;
    struct kvr_gguf *g;
    uint32_t n_layer, n_vocab;
};

static void synth_model(struct synth_model *m, const char *arch, int type, int n_expert, int n_used)
{
    struct kvr_synth_opts o = {
        .arch = kvr_arch_find(arch, strlen(arch)), .type = type, .seed = 3, .n_threads = 2};
    o.shape = (struct kvr_synth_shape){.name = "moe-test",
                                       .n_layers = 3,
                                       .dim = 64,
                                       .ff = 96,
                                       .n_heads = 4,
                                       .n_kv_heads = 2,
                                       .vocab_size = 300,
                                       .ctx = 64,
                                       .rope_base = 10000.0f,
                                       .rms_eps = 1e-5f,
                                       .n_expert = n_expert,
                                       .n_expert_used = n_used,
                                       .expert_ff = strcmp(arch, "llama") ? 64 : 0};
    assert_non_null(o.arch);
    FILE *f = open_memstream(&m->buf, &m->len);
    struct kvr_err err = {0};
    if (kvr_synth_write(&o, f, NULL, &err))
        fail_msg("synth %s: %s", arch, err.msg);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(kvr_gguf_open_mem(&m->g, m->buf, m->len, &err), 0);
    struct kvr_hparams hp;
    if (kvr_hparams_read(&hp, m->g, &err))
        fail_msg("hparams %s: %s", arch, err.msg);
    assert_int_equal(hp.moe.n_expert, (uint32_t)n_expert);
    m->n_layer = hp.n_layer;
    m->n_vocab = hp.n_vocab;
}

static struct kvr_engine *engine(struct synth_model *m, uint32_t first, uint32_t last,
                                 uint32_t threads)
{
    struct kvr_engine_config cfg = {.first_layer = first,
                                    .last_layer = last,
                                    .max_rows = 32,
                                    .max_seqs = N_SEQ,
                                    .n_ctx = 64,
                                    .kv_block_tokens = 8,
                                    .n_threads = threads};
    struct kvr_engine *e = NULL;
    struct kvr_err err = {0};
    if (kvr_engine_create(&e, m->g, &cfg, &err))
        fail_msg("engine: %s", err.msg);
    return e;
}

static int32_t token_of(uint32_t seq, uint32_t pos)
{
    return (int32_t)(7 + seq * 31 + pos * 13) % 300;
}

/* Run one step (a segment per listed sequence) through the chain of engines. */
static void step(struct kvr_engine **chain, int n_eng, const struct kvr_seg *segs, uint32_t n_segs,
                 float *logits)
{
    int32_t toks[32];
    float h[2][32 * 64];
    uint32_t r = 0;
    for (uint32_t i = 0; i < n_segs; i++)
        for (uint32_t t = 0; t < segs[i].n_tokens; t++)
            toks[r++] = token_of(segs[i].seq, segs[i].pos0 + t);
    struct kvr_err err = {0};
    for (int k = 0; k < n_eng; k++) {
        const float *in = k ? h[(k - 1) % 2] : NULL;
        float *out = k == n_eng - 1 ? logits : h[k % 2];
        if (kvr_engine_forward(chain[k], segs, n_segs, k ? NULL : toks, in, out, &err))
            fail_msg("forward: %s", err.msg);
    }
}

/* logits[seq][step][vocab] with every sequence alone (together = 0) or all in one batch. */
static void run_sequences(struct kvr_engine **chain, int n_eng, bool together, uint32_t n_vocab,
                          float *logits)
{
    for (uint32_t st = 0; st < N_STEPS; st++) {
        struct kvr_seg segs[N_SEQ];
        for (uint32_t s = 0; s < N_SEQ; s++) {
            uint32_t pos0 = st ? prompt_len[s] + st - 1 : 0, n = st ? 1 : prompt_len[s];
            segs[s] = (struct kvr_seg){
                s, pos0, n,
                (st ? KVR_SEG_DECODE : KVR_SEG_PREFILL | KVR_SEG_LAST_CHUNK) | KVR_SEG_WANTS_TOKEN};
        }
        float out[N_SEQ * 300];
        if (together) {
            step(chain, n_eng, segs, N_SEQ, out);
            for (uint32_t s = 0; s < N_SEQ; s++)
                memcpy(logits + ((size_t)s * N_STEPS + st) * n_vocab, out + s * n_vocab,
                       n_vocab * sizeof(float));
        } else {
            for (uint32_t s = 0; s < N_SEQ; s++)
                step(chain, n_eng, &segs[s], 1, logits + ((size_t)s * N_STEPS + st) * n_vocab);
        }
    }
}

/* A sequence's logits are bit-identical alone (1 thread, one engine) and batched with the
 * others (2 threads), and through the layers split over two engines (a 2-stage ring). */
static void check_engine_invariance(const char *arch, int type, int n_expert, int n_used)
{
    struct synth_model m;
    synth_model(&m, arch, type, n_expert, n_used);
    size_t n = (size_t)N_SEQ * N_STEPS * m.n_vocab;
    float *base = malloc(n * sizeof(float)), *other = malloc(n * sizeof(float));
    struct kvr_engine *whole = engine(&m, 0, m.n_layer - 1, 1);
    run_sequences(&whole, 1, false, m.n_vocab, base);
    kvr_engine_destroy(whole);
    whole = engine(&m, 0, m.n_layer - 1, 2);
    run_sequences(&whole, 1, true, m.n_vocab, other);
    kvr_engine_destroy(whole);
    if (memcmp(base, other, n * sizeof(float)))
        fail_msg("%s %s: batched on 2 threads differs from alone", arch,
                 kvr_dtype_traits(type)->name);
    struct kvr_engine *split[2] = {engine(&m, 0, 0, 2), engine(&m, 1, m.n_layer - 1, 1)};
    run_sequences(split, 2, true, m.n_vocab, other);
    kvr_engine_destroy(split[0]);
    kvr_engine_destroy(split[1]);
    if (memcmp(base, other, n * sizeof(float)))
        fail_msg("%s %s: split over 2 engines differs from one", arch,
                 kvr_dtype_traits(type)->name);
    float spread = 0; /* the logits are a real distribution, not a constant */
    for (uint32_t v = 1; v < m.n_vocab; v++)
        spread = fmaxf(spread, fabsf(base[v] - base[0]));
    assert_true(spread > 0.1f);
    free(base);
    free(other);
    kvr_gguf_close(m.g);
    free(m.buf);
}

static void test_engine_invariance(void **state)
{
    (void)state;
    /* F32 shows a one-ulp difference in the logits; quantized activations of the layers
     * after it would mostly hide one, so Q8_0 runs are for the SIMD kernels' paths. */
    check_engine_invariance("llama", KVR_DTYPE_F32, 8, 2);
    check_engine_invariance("qwen3moe", KVR_DTYPE_F32, 16, 4);
    check_engine_invariance("qwen2moe", KVR_DTYPE_F32, 8, 2);
    check_engine_invariance("llama", KVR_DTYPE_Q8_0, 8, 2);
    check_engine_invariance("qwen3moe", KVR_DTYPE_Q8_0, 16, 4);
}

/* The plan balancer weighs a MoE layer by what a token reads (router + 1 of 32 experts),
 * not by all its experts: against the tail's 1 MiB output head, four such layers (about
 * 0.24 MiB each as weighed) split 3 + 1; weighed by all 32 experts (3.2 MiB each) they
 * would split 2 + 2. */
static void test_plan_weighs_used_experts(void **state)
{
    (void)state;
    struct kvr_synth_opts o = {.type = KVR_DTYPE_F32, .seed = 1, .n_threads = 1};
    o.shape = (struct kvr_synth_shape){.name = "x",
                                       .n_layers = 4,
                                       .dim = 64,
                                       .ff = 64,
                                       .n_heads = 4,
                                       .n_kv_heads = 4,
                                       .vocab_size = 4096,
                                       .ctx = 64,
                                       .rope_base = 10000.0f,
                                       .rms_eps = 1e-5f,
                                       .n_expert = 32,
                                       .n_expert_used = 1};
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    struct kvr_err err = {0};
    assert_int_equal(kvr_synth_write(&o, f, NULL, &err), 0);
    assert_int_equal(fclose(f), 0);
    struct kvr_gguf *g = NULL;
    assert_int_equal(kvr_gguf_open_mem(&g, buf, len, &err), 0);
    struct kvr_plan plan;
    struct kvr_plan_spec spec = {.n_stages = 2, .model_path = "x.gguf"};
    if (kvr_plan_propose(&plan, g, &spec, &err))
        fail_msg("propose: %s", err.msg);
    assert_int_equal(plan.stages[0].first_layer, 0);
    assert_int_equal(plan.stages[0].last_layer, 2);
    assert_int_equal(plan.stages[1].first_layer, 3);
    kvr_gguf_close(g);
    free(buf);
}

/* synth refuses MoE shapes an architecture cannot have, with a message. */
static void test_synth_refusals(void **state)
{
    (void)state;
    struct kvr_synth_opts o = {
        .arch = kvr_arch_find("qwen3moe", 8), .type = KVR_DTYPE_F32, .seed = 1, .n_threads = 1};
    o.shape = (struct kvr_synth_shape){.name = "x",
                                       .n_layers = 1,
                                       .dim = 64,
                                       .ff = 64,
                                       .n_heads = 4,
                                       .n_kv_heads = 4,
                                       .vocab_size = 300,
                                       .ctx = 64,
                                       .rope_base = 10000.0f,
                                       .rms_eps = 1e-5f};
    struct kvr_err err = {0};
    FILE *f = tmpfile();
    assert_int_equal(kvr_synth_write(&o, f, NULL, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "qwen3moe needs experts"));
    o.arch = kvr_arch_find("qwen3", 5);
    o.shape.n_expert = 8;
    o.shape.n_expert_used = 2;
    assert_int_equal(kvr_synth_write(&o, f, NULL, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "qwen3 has no experts"));
    o.arch = NULL;
    o.shape.expert_ff = 32;
    assert_int_equal(kvr_synth_write(&o, f, NULL, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "llama's experts are ff wide"));
    o.shape.expert_ff = 0;
    o.shape.n_expert = 100; /* more experts than reserved routing coordinates (dim 64) */
    assert_int_equal(kvr_synth_write(&o, f, NULL, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "experts"));
    fclose(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_select_rule),         cmocka_unit_test(test_hparams),
        cmocka_unit_test(test_view_checks),         cmocka_unit_test(test_reference_f32),
        cmocka_unit_test(test_reference_quantized), cmocka_unit_test(test_invariance),
        cmocka_unit_test(test_create_failures),     cmocka_unit_test(test_engine_invariance),
        cmocka_unit_test(test_synth_refusals),      cmocka_unit_test(test_plan_weighs_used_experts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
