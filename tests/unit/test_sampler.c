/* test_sampler.c - greedy, seeded reproducibility, the distribution a draw follows, and the
 * exact effect of top-k, top-p, min-p and the penalties on hand-made logits. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "model/sampler.h"

#include <math.h>
#include <string.h>

static struct kvr_sample_params plain(float temperature)
{
    struct kvr_sample_params p;
    kvr_sample_params_default(&p);
    p.temperature = temperature;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    return p;
}

static struct kvr_sample_scratch *scratch(int32_t n)
{
    struct kvr_sample_scratch *sc = NULL;
    assert_int_equal(kvr_sample_scratch_create(&sc, n), 0);
    return sc;
}

/* Candidate with this id, or NULL. */
static const struct kvr_sample_cand *find(const struct kvr_sample_cand *c, int32_t n, int32_t id)
{
    for (int32_t i = 0; i < n; i++)
        if (c[i].id == id)
            return &c[i];
    return NULL;
}

static void test_greedy(void **state)
{
    (void)state;
    const float logits[6] = {0.5f, 3.0f, -1.0f, 3.0f, NAN, 2.9f};
    struct kvr_sample_scratch *sc = scratch(6);
    struct kvr_sample_params p = plain(0.0f);
    struct kvr_sampler s;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    float lp;
    /* Ties go to the lowest id; NaN is never chosen; no random number is drawn. */
    assert_int_equal(kvr_sampler_sample(&s, logits, 6, sc, &lp), 1);
    assert_int_equal(s.n_draws, 0);
    /* Its logprob is the log-softmax over the whole vocabulary at temperature 1. */
    double sum = exp(0.5) + exp(3.0) + exp(-1.0) + exp(3.0) + exp(2.9);
    assert_float_equal(lp, 3.0 - log(sum), 1e-5);

    p.temperature = -1.0f; /* any temperature <= 0 is greedy */
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    assert_int_equal(kvr_sampler_sample(&s, logits, 6, sc, NULL), 1);

    /* top-k = 1 at any temperature is greedy too. */
    float big[1000];
    for (int i = 0; i < 1000; i++)
        big[i] = sinf((float)i * 0.37f) * 5.0f;
    int32_t arg = 0;
    for (int i = 1; i < 1000; i++)
        if (big[i] > big[arg])
            arg = i;
    struct kvr_sample_scratch *sc2 = scratch(1000);
    p = plain(1.5f);
    p.top_k = 1;
    p.seed = 7;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    for (int r = 0; r < 50; r++)
        assert_int_equal(kvr_sampler_sample(&s, big, 1000, sc2, NULL), arg);
    p.temperature = 0.0f;
    p.top_k = 0;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    assert_int_equal(kvr_sampler_sample(&s, big, 1000, sc2, NULL), arg);

    /* No finite logit, or a vocabulary larger than the scratch: refused. */
    const float none[3] = {-INFINITY, NAN, -INFINITY};
    assert_int_equal(kvr_sampler_sample(&s, none, 3, sc, NULL), KVR_EINVAL);
    assert_int_equal(kvr_sampler_sample(&s, big, 7, sc, NULL), KVR_EINVAL);
    /* A row all NaN or all -inf (what a ring's tail must not turn into a token), greedy
     * and sampled, with and without a logprob. */
    const float all_nan[3] = {NAN, NAN, NAN};
    const float all_ninf[3] = {-INFINITY, -INFINITY, -INFINITY};
    float lp_none = 0.0f;
    for (int k = 0; k < 2; k++) {
        p.temperature = k ? 0.8f : 0.0f;
        assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
        assert_int_equal(kvr_sampler_sample(&s, all_nan, 3, sc, NULL), KVR_EINVAL);
        assert_int_equal(kvr_sampler_sample(&s, all_ninf, 3, sc, &lp_none), KVR_EINVAL);
    }
    kvr_sample_scratch_destroy(sc);
    kvr_sample_scratch_destroy(sc2);
}

static void test_seeded_reproducibility(void **state)
{
    (void)state;
    enum { N = 500, STEPS = 200 };
    float logits[N];
    struct kvr_sample_scratch *sc = scratch(N);
    int32_t seq[3][STEPS];
    const uint64_t seeds[3] = {42, 42, 43};
    for (int k = 0; k < 3; k++) {
        struct kvr_sample_params p;
        kvr_sample_params_default(&p);
        p.temperature = 1.0f;
        p.top_k = 100;
        p.top_p = 0.99f;
        p.min_p = 0.01f;
        p.repeat_penalty = 1.1f;
        p.seed = seeds[k];
        struct kvr_sampler s;
        assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
        for (int t = 0; t < STEPS; t++) {
            for (int i = 0; i < N; i++)
                logits[i] = 2.0f * sinf((float)(i * 7 + t * 3) * 0.11f);
            seq[k][t] = kvr_sampler_sample(&s, logits, N, sc, NULL);
            assert_true(seq[k][t] >= 0 && seq[k][t] < N);
            kvr_sampler_accept(&s, seq[k][t]);
        }
        assert_int_equal(s.n_draws, STEPS); /* exactly one draw per non-greedy sample */
    }
    assert_memory_equal(seq[0], seq[1], sizeof seq[0]);
    assert_memory_not_equal(seq[0], seq[2], sizeof seq[0]);
    kvr_sample_scratch_destroy(sc);
}

static void test_distribution(void **state)
{
    (void)state;
    /* Temperature 1, no truncation: frequencies follow softmax(logits). */
    const double want[4] = {0.1, 0.2, 0.3, 0.4};
    float logits[4];
    for (int i = 0; i < 4; i++)
        logits[i] = (float)log(want[i]) + 3.0f; /* a shift changes nothing */
    struct kvr_sample_scratch *sc = scratch(4);
    struct kvr_sample_params p = plain(1.0f);
    p.seed = 12345;
    struct kvr_sampler s;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    enum { DRAWS = 20000 };
    int count[4] = {0};
    for (int r = 0; r < DRAWS; r++) {
        int32_t id = kvr_sampler_sample(&s, logits, 4, sc, NULL);
        assert_true(id >= 0 && id < 4);
        count[id]++;
    }
    for (int i = 0; i < 4; i++) {
        double f = (double)count[i] / DRAWS;
        /* 4.5 standard deviations of a binomial frequency at p = 0.4 is 0.0156. */
        if (fabs(f - want[i]) > 0.016)
            fail_msg("token %d: frequency %.4f, expected %.2f", i, f, want[i]);
    }

    /* Temperature 2 flattens: p ~ want^(1/2). */
    p.temperature = 2.0f;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    const struct kvr_sample_cand *c;
    assert_int_equal(kvr_sampler_candidates(&s, logits, 4, sc, &c), 4);
    double z = 0;
    for (int i = 0; i < 4; i++)
        z += sqrt(want[i]);
    for (int i = 0; i < 4; i++)
        assert_float_equal(find(c, 4, i)->prob, sqrt(want[i]) / z, 1e-6);

    /* The generator's uniform numbers are in [0, 1) and look uniform. */
    double mean = 0;
    for (int r = 0; r < 10000; r++) {
        double u = kvr_sampler_uniform(&s);
        assert_true(u >= 0.0 && u < 1.0);
        mean += u;
    }
    assert_float_equal(mean / 10000, 0.5, 0.015);
    kvr_sample_scratch_destroy(sc);
}

static void test_truncation(void **state)
{
    (void)state;
    /* Probabilities at temperature 1: 0.5, 0.25, 0.125, 0.0625, 0.0625 (ids shuffled). */
    float logits[5];
    const int32_t order[5] = {3, 0, 4, 1, 2}; /* order[r] = id of the r-th most likely */
    const double prob[5] = {0.5, 0.25, 0.125, 0.0625, 0.0625};
    for (int r = 0; r < 5; r++)
        logits[order[r]] = (float)log(prob[r]);
    struct kvr_sample_scratch *sc = scratch(5);
    struct kvr_sampler s;
    const struct kvr_sample_cand *c;

    /* top-k 3: the three best, best first, renormalised. */
    struct kvr_sample_params p = plain(1.0f);
    p.top_k = 3;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    assert_int_equal(kvr_sampler_candidates(&s, logits, 5, sc, &c), 3);
    for (int r = 0; r < 3; r++) {
        assert_int_equal(c[r].id, order[r]);
        assert_float_equal(c[r].prob, prob[r] / 0.875, 1e-6);
    }

    /* top-p: the smallest prefix reaching p (boundaries kept away from rounding). 0.7 and
     * 0.74 need 0.5 + 0.25; 0.76 needs a third; 0.45 is reached by the first alone. */
    const float top_ps[4] = {0.7f, 0.74f, 0.76f, 0.45f};
    const int32_t kept[4] = {2, 2, 3, 1};
    for (int k = 0; k < 4; k++) {
        p = plain(1.0f);
        p.top_p = top_ps[k];
        assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
        int32_t n = kvr_sampler_candidates(&s, logits, 5, sc, &c);
        if (n != kept[k])
            fail_msg("top_p %.2f kept %d, expected %d", (double)top_ps[k], n, kept[k]);
        for (int r = 0; r < n; r++)
            assert_int_equal(c[r].id, order[r]);
    }

    /* min-p: keep p >= min_p * 0.5. 0.24 keeps 0.5, 0.25, 0.125; 0.26 keeps two; 1 keeps
     * only the top; 0.1 keeps all five. */
    const float min_ps[4] = {0.24f, 0.26f, 1.0f, 0.1f};
    const int32_t kept_min[4] = {3, 2, 1, 5};
    for (int k = 0; k < 4; k++) {
        p = plain(1.0f);
        p.min_p = min_ps[k];
        assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
        int32_t n = kvr_sampler_candidates(&s, logits, 5, sc, &c);
        if (n != kept_min[k])
            fail_msg("min_p %.2f kept %d, expected %d", (double)min_ps[k], n, kept_min[k]);
        for (int r = 0; r < kept_min[k]; r++)
            assert_non_null(find(c, n, order[r]));
    }

    /* Chained: top-k 4 keeps mass 0.9375; top-p 0.9 needs 0.84375 of it, which takes three
     * (0.5 + 0.25 + 0.125); min-p 0.3 (floor 0.15) then drops the 0.125. */
    p = plain(1.0f);
    p.top_k = 4;
    p.top_p = 0.9f;
    p.min_p = 0.3f;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    assert_int_equal(kvr_sampler_candidates(&s, logits, 5, sc, &c), 2);
    assert_int_equal(c[0].id, order[0]);
    assert_int_equal(c[1].id, order[1]);
    assert_float_equal(c[0].prob, 2.0 / 3.0, 1e-6);

    /* Sampling only ever returns kept tokens. */
    p.seed = 99;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    int seen[5] = {0};
    for (int r = 0; r < 2000; r++)
        seen[kvr_sampler_sample(&s, logits, 5, sc, NULL)]++;
    assert_true(seen[order[0]] > 0 && seen[order[1]] > 0);
    assert_int_equal(seen[order[2]] + seen[order[3]] + seen[order[4]], 0);
    kvr_sample_scratch_destroy(sc);
}

static void test_penalties(void **state)
{
    (void)state;
    const float logits[6] = {2.0f, -1.0f, 0.5f, 3.0f, 1.0f, -2.0f};
    struct kvr_sample_scratch *sc = scratch(6);
    struct kvr_sample_params p = plain(1.0f);
    p.repeat_penalty = 2.0f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    p.repeat_last_n = 5;
    struct kvr_sampler s;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    /* History 5 3 0 1 1 2 77: the window of 5 is 0 1 1 2 77; tokens 3 and 5 fell out of it
     * and 77, outside the vocabulary, is ignored. */
    const int32_t hist[7] = {5, 3, 0, 1, 1, 2, 77};
    for (int i = 0; i < 7; i++)
        kvr_sampler_accept(&s, hist[i]);
    const struct kvr_sample_cand *c;
    assert_int_equal(kvr_sampler_candidates(&s, logits, 6, sc, &c), 6);
    /* l > 0: l / 2; l <= 0: l * 2; then - count * 0.5 - 0.25. */
    const float want[6] = {2.0f / 2 - 0.5f - 0.25f,
                           -1.0f * 2 - 1.0f - 0.25f,
                           0.5f / 2 - 0.5f - 0.25f,
                           3.0f,
                           1.0f,
                           -2.0f};
    for (int id = 0; id < 6; id++)
        assert_float_equal(find(c, 6, id)->logit, want[id], 1e-6);

    /* Greedy sees the penalties: each accepted winner drops to a tenth. */
    p = plain(0.0f);
    p.repeat_penalty = 10.0f;
    p.repeat_last_n = 64;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    assert_int_equal(kvr_sampler_sample(&s, logits, 6, sc, NULL), 3);
    kvr_sampler_accept(&s, 3);
    assert_int_equal(kvr_sampler_sample(&s, logits, 6, sc, NULL), 0); /* 3 -> 0.3 < 2 */
    kvr_sampler_accept(&s, 0);
    assert_int_equal(kvr_sampler_sample(&s, logits, 6, sc, NULL), 4); /* 1.0 > 0.5, 0.3, 0.2 */

    /* Window 0 turns penalties off; -1 means the whole ring. */
    p.repeat_last_n = 0;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    kvr_sampler_accept(&s, 3);
    assert_int_equal(kvr_sampler_sample(&s, logits, 6, sc, NULL), 3);
    p.repeat_last_n = -1;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    kvr_sampler_accept(&s, 3);
    for (int i = 0; i < KVR_SAMPLER_MAX_LAST_N - 1; i++)
        kvr_sampler_accept(&s, 5);
    assert_int_equal(kvr_sampler_sample(&s, logits, 6, sc, NULL), 0); /* 3 still in window */
    kvr_sampler_accept(&s, 5);                                        /* now it is not */
    assert_int_equal(kvr_sampler_sample(&s, logits, 6, sc, NULL), 3);
    kvr_sample_scratch_destroy(sc);
}

static void test_params_check(void **state)
{
    (void)state;
    struct kvr_sample_params p;
    struct kvr_err err = {0};
    struct kvr_sampler s;
    kvr_sample_params_default(&p);
    assert_int_equal(kvr_sample_params_check(&p, &err), 0);
    assert_float_equal(p.temperature, 0.8, 1e-7);
    assert_int_equal(p.top_k, 40);

    p.top_p = 0.0f;
    assert_int_equal(kvr_sampler_init(&s, &p, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "top_p"));
    p.top_p = NAN;
    assert_int_equal(kvr_sample_params_check(&p, &err), KVR_EINVAL);
    kvr_sample_params_default(&p);
    p.min_p = 1.5f;
    assert_int_equal(kvr_sample_params_check(&p, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "min_p"));
    kvr_sample_params_default(&p);
    p.temperature = INFINITY;
    assert_int_equal(kvr_sample_params_check(&p, &err), KVR_EINVAL);
    kvr_sample_params_default(&p);
    p.repeat_penalty = 0.0f;
    assert_int_equal(kvr_sample_params_check(&p, &err), KVR_EINVAL);
    kvr_sample_params_default(&p);
    p.repeat_last_n = KVR_SAMPLER_MAX_LAST_N + 1;
    assert_int_equal(kvr_sample_params_check(&p, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "repeat_last_n"));
    kvr_sample_params_default(&p);
    p.frequency_penalty = NAN;
    assert_int_equal(kvr_sample_params_check(&p, &err), KVR_EINVAL);

    struct kvr_sample_scratch *sc = NULL;
    assert_int_equal(kvr_sample_scratch_create(&sc, 0), KVR_EINVAL);
    assert_null(sc);
}

/* Step 0: a bias moves one token's logit before everything else. */
static void test_logit_bias(void **state)
{
    (void)state;
    float logits[4] = {1.0f, 5.0f, 2.0f, 0.0f};
    struct kvr_sample_scratch *sc = scratch(4);
    struct kvr_sample_params p = plain(0.0f);
    p.n_bias = 2;
    p.bias[0] = (struct kvr_logit_bias){3, 100.0f};
    p.bias[1] = (struct kvr_logit_bias){9, -5.0f}; /* past this vocabulary: ignored */
    struct kvr_sampler s;
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    float lp = 0;
    assert_int_equal(kvr_sampler_sample(&s, logits, 4, sc, &lp), 3);
    assert_true(lp > -0.001f);
    /* Added later (as the ring's tail does): -100 on the best token, replacing id 3's. */
    assert_int_equal(kvr_sampler_add_bias(&s, 3, 0.0f), 0);
    assert_int_equal(kvr_sampler_add_bias(&s, 1, -100.0f), 0);
    assert_int_equal(kvr_sampler_sample(&s, logits, 4, sc, NULL), 2);
    assert_int_equal(kvr_sampler_add_bias(&s, 1, 101.0f), KVR_EINVAL);
    assert_int_equal(kvr_sampler_add_bias(&s, -1, 1.0f), KVR_EINVAL);
    for (int32_t id = 10; s.params.n_bias < KVR_SAMPLER_MAX_BIAS; id++)
        assert_int_equal(kvr_sampler_add_bias(&s, id, 1.0f), 0);
    assert_int_equal(kvr_sampler_add_bias(&s, 99, 1.0f), KVR_EFULL);
    kvr_sampler_fini(&s);
    /* Sampling at temperature 1 with +100 on a token picks it every time. */
    p = plain(1.0f);
    p.seed = 7;
    p.n_bias = 1;
    p.bias[0] = (struct kvr_logit_bias){0, 100.0f};
    assert_int_equal(kvr_sampler_init(&s, &p, NULL), 0);
    for (int i = 0; i < 100; i++)
        assert_int_equal(kvr_sampler_sample(&s, logits, 4, sc, NULL), 0);
    kvr_sampler_fini(&s);
    struct kvr_err err = {0};
    p.n_bias = 2;
    p.bias[1] = p.bias[0];
    assert_int_equal(kvr_sample_params_check(&p, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "biased twice"));
    p.n_bias = 1;
    p.bias[0].bias = NAN;
    assert_int_equal(kvr_sample_params_check(&p, &err), KVR_EINVAL);
    p.n_bias = KVR_SAMPLER_MAX_BIAS + 1;
    assert_int_equal(kvr_sample_params_check(&p, &err), KVR_EINVAL);
    kvr_sample_scratch_destroy(sc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logit_bias),
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_seeded_reproducibility),
        cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_params_check),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
