/* test_generate.c - the single-process generation loop (model/generate.h) on a tiny
 * synthetic model.
 *
 * The regression it guards: a logits row with no finite value has no token to sample, and
 * kvr_sampler_sample says so with a negative status. The loop must fail with a message,
 * never store that status as a token id and feed it back to the engine. Both loops are
 * checked: one sequence at a time, and all at once. A healthy model is run first, so the
 * failure is the poison's doing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "../support/tiny_model.h"

#include "core/err.h"
#include "model/arch.h"
#include "model/generate.h"
#include "model/logprobs.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TOKENS 4

struct rig {
    char *buf; /* the GGUF image, writable: the test poisons a tensor in place */
    size_t len;
    struct kvr_gguf *g;
    struct kvr_hparams hp;
    struct kvr_tok *tok;
};

static void rig_init(struct rig *r)
{
    memset(r, 0, sizeof *r);
    kvr_test_tiny_model("generate-test", 7, &r->buf, &r->len, &r->g, &r->hp);
    struct kvr_err err = {0};
    if (kvr_tok_create(&r->tok, r->g, &err))
        fail_msg("tokenizer: %s", err.msg);
}

static void rig_fini(struct rig *r)
{
    kvr_tok_destroy(r->tok);
    kvr_gguf_close(r->g);
    free(r->buf);
}

/* Every weight of the final norm becomes NaN, so every logit is NaN. */
static void poison_output_norm(struct rig *r)
{
    const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(r->g, "output_norm.weight");
    assert_non_null(t);
    assert_int_equal(t->type, KVR_DTYPE_F32);
    float *w = (float *)(r->buf + ((const char *)t->data - r->buf));
    for (size_t i = 0; i < t->n_bytes / sizeof *w; i++)
        w[i] = NAN;
}

typedef int (*generate_fn)(const struct kvr_gguf *, const struct kvr_hparams *,
                           const struct kvr_tok *, const struct kvr_generate_config *,
                           struct kvr_generate_seq *, uint32_t, kvr_generate_token_fn, void *,
                           struct kvr_generate_stats *, struct kvr_err *);

static void on_token(void *ud, uint32_t seq, int32_t id)
{
    (void)seq;
    assert_true(id >= 0); /* a status must never reach the caller as a token */
    (*(int *)ud)++;
}

static int run(struct rig *r, generate_fn fn, float temperature, int *n_tokens, struct kvr_err *err)
{
    static const int32_t prompt[2][3] = {{1, 17, 42}, {1, 99, 5}};
    int32_t out[2][MAX_TOKENS];
    struct kvr_generate_seq seqs[2];
    for (int i = 0; i < 2; i++) {
        seqs[i] = (struct kvr_generate_seq){
            .ids = prompt[i], .n_ids = 3, .max_tokens = MAX_TOKENS, .out = out[i]};
        kvr_sample_params_default(&seqs[i].sp);
        seqs[i].sp.temperature = temperature;
        seqs[i].sp.seed = 11 + (uint64_t)i;
    }
    struct kvr_generate_config cfg = {
        .n_ctx = 64, .row_width = 8, .kv_type = KVR_DTYPE_F32, .n_threads = 1, .ignore_eos = true};
    struct kvr_generate_stats st;
    *n_tokens = 0;
    return fn(r->g, &r->hp, r->tok, &cfg, seqs, 2, on_token, n_tokens, &st, err);
}

static void check_loop(generate_fn fn)
{
    static const float temps[] = {0.0f, 0.8f};
    for (size_t k = 0; k < 2; k++) {
        struct rig r;
        rig_init(&r);
        struct kvr_err err = {0};
        int n = 0;
        assert_int_equal(run(&r, fn, temps[k], &n, &err), 0);
        assert_int_equal(n, 2 * MAX_TOKENS);

        poison_output_norm(&r);
        err = (struct kvr_err){0};
        assert_int_equal(run(&r, fn, temps[k], &n, &err), KVR_EINVAL);
        assert_int_equal(n, 0);
        assert_non_null(strstr(err.msg, "no finite logit"));
        rig_fini(&r);
    }
}

static void test_one_at_a_time_fails_on_nan_logits(void **state)
{
    (void)state;
    check_loop(kvr_generate);
}

static void test_batched_fails_on_nan_logits(void **state)
{
    (void)state;
    check_loop(kvr_generate_batched);
}

/* Logprobs asked of either loop (model/logprobs.h): the same bits from both, each token's
 * at most its most likely alternative's, and under greedy sampling that alternative. */
static void run_logprobs(struct rig *r, generate_fn fn, float temperature, int32_t out[2][8],
                         float lp[2][8], struct kvr_token_logprob top[2][8 * 5])
{
    static const int32_t prompt[2][3] = {{1, 17, 42}, {1, 99, 5}};
    struct kvr_generate_seq seqs[2];
    for (int i = 0; i < 2; i++) {
        seqs[i] = (struct kvr_generate_seq){.ids = prompt[i],
                                            .n_ids = 3,
                                            .max_tokens = 8,
                                            .out = out[i],
                                            .logprobs = lp[i],
                                            .top = top[i],
                                            .n_top = 5};
        kvr_sample_params_default(&seqs[i].sp);
        seqs[i].sp.temperature = temperature;
        seqs[i].sp.seed = 3 + (uint64_t)i;
    }
    struct kvr_generate_config cfg = {
        .n_ctx = 64, .row_width = 8, .kv_type = KVR_DTYPE_F32, .n_threads = 1, .ignore_eos = true};
    struct kvr_generate_stats st;
    struct kvr_err err = {0};
    assert_int_equal(fn(r->g, &r->hp, r->tok, &cfg, seqs, 2, NULL, NULL, &st, &err), 0);
}

static void test_logprobs(void **state)
{
    (void)state;
    struct rig r;
    rig_init(&r);
    for (int greedy = 0; greedy < 2; greedy++) {
        int32_t out[2][2][8];
        float lp[2][2][8];
        struct kvr_token_logprob top[2][2][8 * 5];
        run_logprobs(&r, kvr_generate, greedy ? 0.0f : 0.9f, out[0], lp[0], top[0]);
        run_logprobs(&r, kvr_generate_batched, greedy ? 0.0f : 0.9f, out[1], lp[1], top[1]);
        assert_memory_equal(out[0], out[1], sizeof out[0]);
        assert_memory_equal(lp[0], lp[1], sizeof lp[0]);
        assert_memory_equal(top[0], top[1], sizeof top[0]);
        for (int i = 0; i < 2; i++)
            for (int k = 0; k < 8; k++) {
                const struct kvr_token_logprob *t = &top[0][i][k * 5];
                assert_true(lp[0][i][k] <= t[0].logprob && t[4].logprob <= t[0].logprob);
                if (greedy)
                    assert_true(t[0].id == out[0][i][k] && t[0].logprob == lp[0][i][k]);
            }
    }
    rig_fini(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_at_a_time_fails_on_nan_logits),
        cmocka_unit_test(test_batched_fails_on_nan_logits),
        cmocka_unit_test(test_logprobs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
