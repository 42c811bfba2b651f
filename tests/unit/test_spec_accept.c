/* test_spec_accept.c - the accept rule for drafted tokens (model/spec_accept.h).
 *
 * Over many seeds, the tokens kvr_spec_verify emits have the target's distribution: the
 * first one (chi-square against the softmax), the drafted token is accepted with the
 * target's probability of it, a rejection leaves the residual (the target without the
 * drafted token, renormalised), and after an acceptance the next row's distribution holds.
 * A drafted token outside the truncated set (top-k) is never accepted. Every emitted token
 * draws exactly one number (none when greedy), and the emitted tokens are what plain
 * sampling gives for the same seed, whatever was drafted. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "model/sampler.h"
#include "model/spec_accept.h"

#include <math.h>
#include <string.h>

#define V 8
#define N_SEEDS 40000
/* Chi-square critical values at p = 0.001 for 5..7 degrees of freedom. */
static const double chi2_crit[8] = {0, 0, 0, 0, 0, 20.52, 22.46, 24.32};

static const float row0[V] = {1.0f, 0.2f, 1.5f, -0.5f, 0.7f, 0.0f, 1.2f, -1.0f};
static const float row1[V] = {-0.3f, 0.9f, 0.1f, 1.4f, -0.8f, 0.5f, 0.0f, 0.6f};

static void softmax(const float *l, double *p)
{
    double sum = 0;
    for (int i = 0; i < V; i++)
        sum += p[i] = exp(l[i]);
    for (int i = 0; i < V; i++)
        p[i] /= sum;
}

/* Pearson's statistic of counts[0..V) against probabilities p scaled to n, over the
 * categories with p > 0; *dof their number - 1. */
static double chi2(const uint32_t *counts, const double *p, uint32_t n, int *dof)
{
    double x = 0;
    int k = 0;
    for (int i = 0; i < V; i++) {
        if (p[i] <= 0) {
            assert_int_equal(counts[i], 0);
            continue;
        }
        double e = p[i] * n, d = counts[i] - e;
        x += d * d / e;
        k++;
    }
    *dof = k - 1;
    return x;
}

static void expect_dist(const uint32_t *counts, const double *p, uint32_t n, const char *what)
{
    int dof;
    double x = chi2(counts, p, n, &dof);
    assert_true(dof >= 5 && dof <= 7);
    if (x > chi2_crit[dof])
        fail_msg("%s: chi-square %.1f over %d dof (critical %.1f)", what, x, dof, chi2_crit[dof]);
}

static void init_sampler(struct kvr_sampler *s, uint64_t seed, int32_t top_k)
{
    struct kvr_sample_params sp;
    kvr_sample_params_default(&sp);
    sp.temperature = 1.0f;
    sp.top_k = top_k;
    sp.top_p = 1.0f;
    sp.min_p = 0.0f;
    sp.seed = seed;
    struct kvr_err err = {0};
    assert_int_equal(kvr_sampler_init(s, &sp, &err), 0);
}

static void test_distribution_is_the_targets(void **state)
{
    (void)state;
    struct kvr_sample_scratch *sc;
    assert_int_equal(kvr_sample_scratch_create(&sc, V), 0);
    float logits[2 * V];
    memcpy(logits, row0, sizeof row0);
    memcpy(logits + V, row1, sizeof row1);
    const int32_t draft[1] = {2};
    uint32_t first[V] = {0}, rejected[V] = {0}, second[V] = {0}, n_acc = 0;
    for (uint64_t seed = 1; seed <= N_SEEDS; seed++) {
        struct kvr_sampler s;
        init_sampler(&s, seed, 0);
        int32_t out[2];
        int32_t n = kvr_spec_verify(&s, logits, V, draft, 1, sc, out, NULL);
        assert_true(n == 1 || n == 2);
        assert_true(s.n_draws == (uint64_t)n); /* one draw per emitted token */
        first[out[0]]++;
        if (n == 2) {
            assert_int_equal(out[0], draft[0]);
            n_acc++;
            second[out[1]]++;
        } else {
            assert_int_not_equal(out[0], draft[0]);
            rejected[out[0]]++;
        }
        kvr_sampler_fini(&s);
    }
    double p0[V], p1[V], res[V];
    softmax(row0, p0);
    softmax(row1, p1);
    expect_dist(first, p0, N_SEEDS, "first token");
    expect_dist(second, p1, n_acc, "token after an acceptance");
    for (int i = 0; i < V; i++)
        res[i] = i == draft[0] ? 0 : p0[i] / (1 - p0[draft[0]]);
    expect_dist(rejected, res, N_SEEDS - n_acc, "token after a rejection (the residual)");
    /* Accepted with the target's probability of the drafted token (4 standard errors). */
    double q = p0[draft[0]], se = sqrt(q * (1 - q) / N_SEEDS);
    if (fabs((double)n_acc / N_SEEDS - q) > 4 * se)
        fail_msg("acceptance %.4f, target probability %.4f", (double)n_acc / N_SEEDS, q);
    kvr_sample_scratch_destroy(sc);
}

/* top-k 3 keeps tokens 2, 6, 0: a drafted 4 is outside and never accepted. */
static void test_truncated_draft_never_accepted(void **state)
{
    (void)state;
    struct kvr_sample_scratch *sc;
    assert_int_equal(kvr_sample_scratch_create(&sc, V), 0);
    float logits[2 * V];
    memcpy(logits, row0, sizeof row0);
    memcpy(logits + V, row1, sizeof row1);
    const int32_t draft[1] = {4};
    uint32_t first[V] = {0};
    for (uint64_t seed = 1; seed <= N_SEEDS / 4; seed++) {
        struct kvr_sampler s;
        init_sampler(&s, seed, 3);
        int32_t out[2];
        assert_int_equal(kvr_spec_verify(&s, logits, V, draft, 1, sc, out, NULL), 1);
        first[out[0]]++;
        kvr_sampler_fini(&s);
    }
    assert_int_equal(first[4], 0);
    assert_true(first[2] > first[6] && first[6] > first[0] && first[0] > 0);
    kvr_sample_scratch_destroy(sc);
}

/* The emitted tokens are plain sampling's for the same seed; greedy draws nothing. */
static void test_same_tokens_as_plain_sampling(void **state)
{
    (void)state;
    struct kvr_sample_scratch *sc;
    assert_int_equal(kvr_sample_scratch_create(&sc, V), 0);
    float logits[4 * V];
    for (int r = 0; r < 4; r++)
        memcpy(logits + r * V, r % 2 ? row1 : row0, sizeof row0);
    for (float t = 0.0f; t <= 1.0f; t += 1.0f) {
        for (uint64_t seed = 1; seed <= 200; seed++) {
            struct kvr_sampler plain, spec;
            init_sampler(&plain, seed, 0);
            init_sampler(&spec, seed, 0);
            plain.params.temperature = spec.params.temperature = t;
            int32_t want[4];
            for (int r = 0; r < 4; r++) {
                want[r] = kvr_sampler_sample(&plain, logits + r * V, V, sc, NULL);
                kvr_sampler_accept(&plain, want[r]);
            }
            /* Drafts (the tokens rows 0, 1, 2 should give): two right, the third wrong. */
            int32_t draft[3] = {want[0], want[1], (want[2] + 1) % V}, out[4];
            int32_t n = kvr_spec_verify(&spec, logits, V, draft, 3, sc, out, NULL);
            assert_int_equal(n, 3);
            assert_memory_equal(out, want, (size_t)n * sizeof *out);
            assert_true(spec.n_draws == (t > 0 ? (uint64_t)n : 0));
            kvr_sampler_fini(&plain);
            kvr_sampler_fini(&spec);
        }
    }
    kvr_sample_scratch_destroy(sc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_distribution_is_the_targets),
        cmocka_unit_test(test_truncated_draft_never_accepted),
        cmocka_unit_test(test_same_tokens_as_plain_sampling),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
