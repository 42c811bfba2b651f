/* test_moe_route.c - DeepSeek-V3-style routing (model/moe_route.h): sigmoid gating, the
 * selection-only bias, expert groups, normalised and scaled weights, the keys, and a layer
 * with a bias and an ungated shared expert through the batched path against the reference.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "core/rng.h"
#include "model/dtype.h"
#include "model/gguf.h"
#include "model/engine.h"
#include "model/gguf_write.h"
#include "model/moe.h"
#include "model/moe_route.h"
#include "model/synth.h"
#include "ring/propose.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double sig(double v)
{
    return 1.0 / (1.0 + exp(-v));
}

static struct kvr_moe_hparams sigmoid_mp(uint32_t n_expert, uint32_t n_used)
{
    return (struct kvr_moe_hparams){
        .n_expert = n_expert, .n_used = n_used, .n_ff_exp = 8, .gating = KVR_MOE_GATING_SIGMOID};
}

/* Sigmoid probabilities: the best logits win; weights are the sigmoids, normalised over
 * the selection only with norm_topk, then scaled. */
static void test_sigmoid(void **state)
{
    (void)state;
    struct kvr_moe_hparams mp = sigmoid_mp(6, 2);
    const float l[6] = {0.5f, -1.0f, 2.0f, 1.0f, NAN, 2.0f};
    uint32_t ids[2];
    float w[2];
    kvr_moe_select(&mp, l, ids, w);
    assert_int_equal(ids[0], 2); /* equal scores: the lower id first */
    assert_int_equal(ids[1], 5);
    assert_float_equal(w[0], sig(2.0), 1e-6);
    assert_float_equal(w[1], sig(2.0), 1e-6);

    mp.norm_topk = true;
    mp.n_used = 3;
    uint32_t id3[3];
    float w3[3];
    kvr_moe_select(&mp, l, id3, w3);
    assert_int_equal(id3[2], 3);
    double sum = 2 * sig(2.0) + sig(1.0);
    assert_float_equal(w3[2], sig(1.0) / sum, 1e-6);
    assert_float_equal(w3[0] + w3[1] + w3[2], 1.0, 1e-6);

    mp.w_scale = 2.5f;
    kvr_moe_select(&mp, l, id3, w3);
    assert_float_equal(w3[0] + w3[1] + w3[2], 2.5, 1e-5);
    assert_float_equal(w3[2], 2.5 * sig(1.0) / sum, 1e-6);
}

/* The bias chooses experts, the weights stay the unbiased probabilities. */
static void test_bias_selects_only(void **state)
{
    (void)state;
    struct kvr_moe_hparams mp = sigmoid_mp(4, 2);
    const float l[4] = {3.0f, 2.0f, -1.0f, -2.0f};
    const float b[4] = {0.0f, 0.0f, 0.5f, 2.0f};
    uint32_t ids[2];
    float w[2];
    kvr_moe_select_b(&mp, l, b, ids, w);
    assert_int_equal(ids[0], 3); /* sigmoid(-2) + 2 beats sigmoid(3) */
    assert_int_equal(ids[1], 0);
    assert_float_equal(w[0], sig(-2.0), 1e-6);
    assert_float_equal(w[1], sig(3.0), 1e-6);
    /* without it, the plain order */
    kvr_moe_select_b(&mp, l, NULL, ids, w);
    assert_int_equal(ids[0], 0);
    assert_int_equal(ids[1], 1);
    /* a bias with softmax gating adds to the probabilities, not the logits */
    mp.gating = KVR_MOE_GATING_SOFTMAX;
    const float b2[4] = {0.0f, 0.0f, 0.0f, 0.2f};
    kvr_moe_select_b(&mp, l, b2, ids, w);
    double all = exp(3.0) + exp(2.0) + exp(-1.0) + exp(-2.0);
    /* p3 + 0.2 = 0.205 < p1 = 0.264: expert 1 stays second */
    assert_int_equal(ids[1], 1);
    assert_float_equal(w[1], exp(2.0) / all, 1e-6);
    const float b3[4] = {0.0f, 0.0f, 0.0f, 0.3f};
    kvr_moe_select_b(&mp, l, b3, ids, w);
    assert_int_equal(ids[1], 3);
    assert_float_equal(w[1], exp(-2.0) / all, 1e-6);
}

/* Groups: a group scores the sum of its two best scores; only the best n_group_used groups'
 * experts may be chosen, even when another group holds the single best expert. */
static void test_groups(void **state)
{
    (void)state;
    struct kvr_moe_hparams mp = sigmoid_mp(8, 2);
    mp.n_group = 4;
    mp.n_group_used = 2;
    /* groups {0,1} {2,3} {4,5} {6,7}; scores via the bias on sigmoid(0) = 0.5 */
    const float l[8] = {0};
    const float b[8] = {5.0f, -5.0f, 1.0f, 1.0f, 2.0f, 0.5f, 0.0f, 0.0f};
    /* group sums: 0 + 1 (grp 0: 5.5 - 4.5), 3, 3.5, 1 -> groups 2 and 1 */
    uint32_t ids[2];
    float w[2];
    kvr_moe_select_b(&mp, l, b, ids, w);
    assert_int_equal(ids[0], 4);
    assert_int_equal(ids[1], 2); /* 2 and 3 score the same: the lower id */
    assert_float_equal(w[0], 0.5, 1e-6);
    /* without groups the lone best expert 0 wins */
    mp.n_group = 0;
    kvr_moe_select_b(&mp, l, b, ids, w);
    assert_int_equal(ids[0], 0);
    /* one group used: both from group 2 */
    mp.n_group = 4;
    mp.n_group_used = 1;
    kvr_moe_select_b(&mp, l, b, ids, w);
    assert_int_equal(ids[0], 4);
    assert_int_equal(ids[1], 5);
    /* groups over softmax probabilities (DeepSeek V2): sums of probabilities, not logits */
    struct kvr_moe_hparams sm = mp;
    sm.gating = KVR_MOE_GATING_SOFTMAX;
    sm.n_group_used = 1;
    const float l2[8] = {4.0f, -5.0f, 2.0f, 2.0f, 0, 0, 0, 0};
    /* logit sums: group 0 -1 < group 1 4; probability sums (x 79.4): 54.6 > 14.8 */
    kvr_moe_select_b(&sm, l2, NULL, ids, w);
    assert_int_equal(ids[0], 0);
    assert_int_equal(ids[1], 1);
}

/* ---- keys ------------------------------------------------------------------------------ */

struct kv {
    const char *key;
    int kind; /* 0 u32, 1 f32, 2 bool */
    double v;
};

static int read_keys(const struct kv *kvs, int n, struct kvr_moe_hparams *mp, struct kvr_err *err)
{
    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    kvr_gguf_writer_add_str(w, "general.architecture", "glm4moe");
    kvr_gguf_writer_add_u32(w, "glm4moe.expert_count", 16);
    kvr_gguf_writer_add_u32(w, "glm4moe.expert_used_count", 4);
    kvr_gguf_writer_add_u32(w, "glm4moe.expert_feed_forward_length", 32);
    for (int i = 0; i < n; i++) {
        if (kvs[i].kind == 0)
            kvr_gguf_writer_add_u32(w, kvs[i].key, (uint32_t)kvs[i].v);
        else if (kvs[i].kind == 1)
            kvr_gguf_writer_add_f32(w, kvs[i].key, (float)kvs[i].v);
        else
            kvr_gguf_writer_add_bool(w, kvs[i].key, kvs[i].v != 0);
    }
    char *buf;
    size_t len;
    FILE *f = open_memstream(&buf, &len);
    assert_int_equal(kvr_gguf_writer_write(w, f, err), 0);
    fclose(f);
    kvr_gguf_writer_destroy(w);
    struct kvr_gguf *g = NULL;
    assert_int_equal(kvr_gguf_open_mem(&g, buf, len, err), 0);
    int rc = kvr_moe_hparams_read(mp, g, "glm4moe", KVR_MOE_GATING_SIGMOID, false, false, 64, err);
    if (!rc)
        rc = kvr_moe_hparams_read_v3(mp, g, "glm4moe", KVR_MOE_BIAS_REQUIRED, 4, err);
    kvr_gguf_close(g);
    free(buf);
    return rc;
}

static void test_keys(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    struct kvr_moe_hparams mp;
    const struct kv all[] = {
        {"glm4moe.expert_gating_func", 2, 0}, /* bool: wrong type */
        {"glm4moe.expert_weights_norm", 2, 1}, {"glm4moe.expert_weights_scale", 1, 2.5},
        {"glm4moe.expert_group_count", 0, 4},  {"glm4moe.expert_group_used_count", 0, 2},
        {"glm4moe.expert_shared_count", 0, 2}, {"glm4moe.leading_dense_block_count", 0, 1}};
    assert_int_not_equal(read_keys(all, 7, &mp, &err), 0);
    struct kv good[7];
    memcpy(good, all, sizeof good);
    good[0] = (struct kv){"glm4moe.expert_gating_func", 0, 1};
    assert_int_equal(read_keys(good, 7, &mp, &err), 0);
    assert_int_equal(mp.gating, KVR_MOE_GATING_SOFTMAX);
    assert_true(mp.norm_topk);
    assert_float_equal(mp.w_scale, 2.5, 0);
    assert_int_equal(mp.n_group, 4);
    assert_int_equal(mp.n_group_used, 2);
    assert_int_equal(mp.n_ff_shexp, 64);
    assert_true(mp.shared_plain && mp.probs_bias && mp.probs_bias_required);
    assert_int_equal(mp.n_dense_lead, 1);
    /* defaults: the architecture's gating, no norm, scale 1, no groups, no shared expert */
    assert_int_equal(read_keys(NULL, 0, &mp, &err), 0);
    assert_int_equal(mp.gating, KVR_MOE_GATING_SIGMOID);
    assert_false(mp.norm_topk);
    assert_float_equal(mp.w_scale, 1.0, 0);
    assert_int_equal(mp.n_group, 0);
    assert_int_equal(mp.n_ff_shexp, 0);
    /* refusals, each with its reason */
    const struct kv bad[][2] = {
        {{"glm4moe.expert_gating_func", 0, 3}, {"glm4moe.expert_shared_count", 0, 0}},
        {{"glm4moe.expert_weights_scale", 1, 0}, {"glm4moe.expert_shared_count", 0, 0}},
        {{"glm4moe.expert_group_count", 0, 3}, {"glm4moe.expert_group_used_count", 0, 1}},
        {{"glm4moe.expert_group_count", 0, 4}, {"glm4moe.expert_group_used_count", 0, 5}},
        {{"glm4moe.expert_group_count", 0, 16}, {"glm4moe.expert_group_used_count", 0, 2}},
        {{"glm4moe.expert_group_count", 0, 8}, {"glm4moe.expert_group_used_count", 0, 1}},
        {{"glm4moe.leading_dense_block_count", 0, 4}, {"glm4moe.expert_shared_count", 0, 0}},
        {{"glm4moe.expert_shared_count", 0, 1000}, {"glm4moe.expert_weights_norm", 2, 0}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err.msg[0] = 0;
        assert_int_not_equal(read_keys(bad[i], 2, &mp, &err), 0);
        print_message("refused: %s\n", err.msg);
        assert_true(err.msg[0] != 0);
    }
}

/* ---- a layer: bias, groups, ungated shared expert --------------------------------------- */

#define D 64
#define FF 32
#define NE 16
#define ROWS 24

static void *f32_rows(int64_t n, float scale, uint64_t seed, void **keep)
{
    float *f = malloc((size_t)n * sizeof(float));
    uint64_t st = seed;
    for (int64_t i = 0; i < n; i++)
        f[i] = scale * ((float)(kvr_splitmix64(&st) >> 40) * 0x1p-23f - 1.0f);
    *keep = f;
    return f;
}

static void test_layer_against_reference(void **state)
{
    (void)state;
    void *keep[8];
    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    int64_t ne_r[2] = {D, NE}, ne_gu[3] = {D, FF, NE}, ne_dn[3] = {FF, D, NE};
    int64_t ne_b[1] = {NE}, ne_sgu[2] = {D, 2 * FF}, ne_sdn[2] = {2 * FF, D};
    kvr_gguf_writer_add_tensor(w, "blk.0.ffn_gate_inp.weight", 2, ne_r, KVR_DTYPE_F32,
                               f32_rows(D * NE, 0.5f, 1, &keep[0]));
    kvr_gguf_writer_add_tensor(w, "blk.0.ffn_gate_exps.weight", 3, ne_gu, KVR_DTYPE_F32,
                               f32_rows(D * FF * NE, 0.2f, 2, &keep[1]));
    kvr_gguf_writer_add_tensor(w, "blk.0.ffn_up_exps.weight", 3, ne_gu, KVR_DTYPE_F32,
                               f32_rows(D * FF * NE, 0.2f, 3, &keep[2]));
    kvr_gguf_writer_add_tensor(w, "blk.0.ffn_down_exps.weight", 3, ne_dn, KVR_DTYPE_F32,
                               f32_rows(D * FF * NE, 0.2f, 4, &keep[3]));
    kvr_gguf_writer_add_tensor(w, "blk.0.exp_probs_b.bias", 1, ne_b, KVR_DTYPE_F32,
                               f32_rows(NE, 0.3f, 5, &keep[4]));
    kvr_gguf_writer_add_tensor(w, "blk.0.ffn_gate_shexp.weight", 2, ne_sgu, KVR_DTYPE_F32,
                               f32_rows(D * 2 * FF, 0.2f, 6, &keep[5]));
    kvr_gguf_writer_add_tensor(w, "blk.0.ffn_up_shexp.weight", 2, ne_sgu, KVR_DTYPE_F32,
                               f32_rows(D * 2 * FF, 0.2f, 7, &keep[6]));
    kvr_gguf_writer_add_tensor(w, "blk.0.ffn_down_shexp.weight", 2, ne_sdn, KVR_DTYPE_F32,
                               f32_rows(D * 2 * FF, 0.2f, 8, &keep[7]));
    char *buf;
    size_t len;
    struct kvr_err err = {0};
    FILE *f = open_memstream(&buf, &len);
    assert_int_equal(kvr_gguf_writer_write(w, f, &err), 0);
    fclose(f);
    kvr_gguf_writer_destroy(w);
    struct kvr_gguf *g = NULL;
    assert_int_equal(kvr_gguf_open_mem(&g, buf, len, &err), 0);

    struct kvr_moe_hparams mp = sigmoid_mp(NE, 4);
    mp.n_ff_exp = FF;
    mp.n_ff_shexp = 2 * FF;
    mp.shared_plain = mp.probs_bias = mp.probs_bias_required = mp.norm_topk = true;
    mp.w_scale = 1.5f;
    mp.n_group = 4;
    mp.n_group_used = 2;
    struct kvr_moe_layer layer;
    assert_int_equal(kvr_moe_layer_view(&layer, g, 0, D, &mp, &err), 0);
    assert_non_null(layer.probs_b);
    assert_null(layer.sh_gate_inp.data);

    struct kvr_moe_work *work = NULL;
    assert_int_equal(kvr_moe_work_create(&work, D, &mp, &layer, 1, ROWS, &err), 0);
    float *x, *y = malloc(ROWS * D * sizeof(float)), yr[D];
    void *xk;
    x = f32_rows(ROWS * D, 1.0f, 9, &xk);
    float *scratch = malloc(kvr_moe_ref_scratch_floats(D, &mp) * sizeof(float));
    uint32_t ids[ROWS * 4], ref_ids[4];
    float wts[ROWS * 4];
    kvr_moe_forward(work, &layer, x, ROWS, y, NULL);
    kvr_moe_route(work, &layer, x, ROWS, ids, wts, NULL);
    double worst = 0;
    for (uint32_t r = 0; r < ROWS; r++) {
        kvr_moe_forward_ref(&layer, &mp, D, x + r * D, yr, ref_ids, scratch);
        float wsum = 0;
        for (int s = 0; s < 4; s++) {
            assert_int_equal(ids[r * 4 + s], ref_ids[s]);
            wsum += wts[r * 4 + s];
        }
        assert_float_equal(wsum, 1.5, 1e-5);
        for (int i = 0; i < D; i++)
            worst = fmax(worst, fabs((double)y[r * D + i] - yr[i]));
    }
    print_message("bias, groups, plain shared expert: worst diff %.2e\n", worst);
    assert_true(worst < 1e-4);

    kvr_moe_work_destroy(work);
    free(scratch);
    free(y);
    free(xk);
    for (int i = 0; i < 8; i++)
        free(keep[i]);
    kvr_gguf_close(g);
    free(buf);
}

/* ---- glm4moe: leading dense layers, NextN blocks outside the plan --------------------- */

/* Does the engine refuse a copy of g without tensor `drop`? */
static bool refused_without(const struct kvr_gguf *g, const char *drop,
                            const struct kvr_engine_config *cfg)
{
    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    for (int64_t i = 0; i < kvr_gguf_n_kv(g); i++)
        kvr_gguf_writer_copy_kv(w, g, i);
    for (int64_t i = 0; i < kvr_gguf_n_tensors(g); i++) {
        const struct kvr_gguf_tensor *t = kvr_gguf_tensor(g, i);
        if (strcmp(t->name, drop))
            kvr_gguf_writer_add_tensor(w, t->name, t->n_dims, t->ne, t->type, t->data);
    }
    char *buf;
    size_t len;
    struct kvr_err err = {0};
    FILE *f = open_memstream(&buf, &len);
    assert_int_equal(kvr_gguf_writer_write(w, f, &err), 0);
    fclose(f);
    kvr_gguf_writer_destroy(w);
    struct kvr_gguf *copy = NULL;
    assert_int_equal(kvr_gguf_open_mem(&copy, buf, len, &err), 0);
    struct kvr_engine *e = NULL;
    int rc = kvr_engine_create(&e, copy, cfg, &err);
    if (rc)
        print_message("without %s: %s\n", drop, err.msg);
    kvr_engine_destroy(e);
    kvr_gguf_close(copy);
    free(buf);
    return rc != 0;
}

static void test_glm4moe_layout(void **state)
{
    (void)state;
    struct kvr_synth_opts o = {.arch = kvr_arch_find("glm4moe", 7),
                               .type = KVR_DTYPE_F32,
                               .seed = 1,
                               .n_threads = 1,
                               .qk_norm = true};
    o.shape = (struct kvr_synth_shape){.name = "x",
                                       .n_layers = 4,
                                       .dim = 64,
                                       .ff = 96,
                                       .n_heads = 4,
                                       .n_kv_heads = 2,
                                       .vocab_size = 300,
                                       .ctx = 64,
                                       .rope_base = 10000.0f,
                                       .rms_eps = 1e-5f,
                                       .n_expert = 8,
                                       .n_expert_used = 2,
                                       .expert_ff = 32,
                                       .n_shared_exp = 2,
                                       .n_dense_lead = 1,
                                       .rope_dim = 8,
                                       .n_nextn = 1};
    assert_non_null(o.arch);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    struct kvr_err err = {0};
    if (kvr_synth_write(&o, f, NULL, &err))
        fail_msg("synth: %s", err.msg);
    assert_int_equal(fclose(f), 0);
    struct kvr_gguf *g = NULL;
    assert_int_equal(kvr_gguf_open_mem(&g, buf, len, &err), 0);
    struct kvr_hparams hp;
    if (kvr_hparams_read(&hp, g, &err))
        fail_msg("hparams: %s", err.msg);
    assert_int_equal(hp.n_layer, 4); /* block_count 5, less the NextN block */
    assert_int_equal(hp.n_nextn, 1);
    assert_int_equal(hp.n_rot, 8);
    assert_int_equal(hp.moe.n_ff_shexp, 64);
    assert_false(kvr_hparams_layer_moe(&hp, 0));
    assert_true(kvr_hparams_layer_moe(&hp, 1));
    assert_true(kvr_hparams_layer_has(&hp, 0, KVR_LT_FFN_GATE));
    assert_false(kvr_hparams_layer_has(&hp, 1, KVR_LT_FFN_GATE));
    assert_non_null(kvr_gguf_find_tensor(g, "blk.0.ffn_gate.weight"));
    assert_null(kvr_gguf_find_tensor(g, "blk.0.ffn_gate_inp.weight"));
    assert_non_null(kvr_gguf_find_tensor(g, "blk.1.exp_probs_b.bias"));
    assert_null(kvr_gguf_find_tensor(g, "blk.1.ffn_gate_inp_shexp.weight"));
    assert_non_null(kvr_gguf_find_tensor(g, "blk.4.nextn.eh_proj.weight"));
    assert_non_null(kvr_gguf_find_tensor(g, "blk.4.ffn_gate_exps.weight"));
    assert_non_null(kvr_gguf_find_tensor(g, "blk.1.post_attention_norm.weight"));
    assert_null(kvr_gguf_find_tensor(g, "blk.1.ffn_norm.weight"));

    /* an engine over every layer that runs loads; without a NextN tensor llama.cpp needs,
     * or with only one of the q/k norms, the file is refused */
    struct kvr_engine_config cfg = {.first_layer = 0,
                                    .last_layer = 3,
                                    .max_rows = 8,
                                    .max_seqs = 2,
                                    .n_ctx = 64,
                                    .kv_block_tokens = 8,
                                    .n_threads = 1};
    struct kvr_engine *e = NULL;
    if (kvr_engine_create(&e, g, &cfg, &err))
        fail_msg("engine: %s", err.msg);
    kvr_engine_destroy(e);
    const char *drop[] = {"blk.4.nextn.eh_proj.weight", "blk.4.ffn_up_exps.weight",
                          "blk.2.exp_probs_b.bias", "blk.1.attn_k_norm.weight"};
    for (size_t i = 0; i < sizeof drop / sizeof drop[0]; i++)
        assert_true(refused_without(g, drop[i], &cfg));
    assert_false(refused_without(g, "blk.4.nextn.shared_head_head.weight", &cfg)); /* optional */

    /* the plan splits the 4 layers that run; the NextN block is no stage's */
    struct kvr_plan plan;
    struct kvr_plan_spec spec = {.n_stages = 2, .model_path = "x.gguf"};
    if (kvr_plan_propose(&plan, g, &spec, &err))
        fail_msg("propose: %s", err.msg);
    assert_int_equal(plan.stages[1].last_layer, 3);
    kvr_gguf_close(g);
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sigmoid),
        cmocka_unit_test(test_bias_selects_only),
        cmocka_unit_test(test_groups),
        cmocka_unit_test(test_keys),
        cmocka_unit_test(test_layer_against_reference),
        cmocka_unit_test(test_glm4moe_layout),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
