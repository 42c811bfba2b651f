/* test_loadgen.c - the pure parts of `kvasir bench`: the seeded generator, Poisson and gamma
 * arrival schedules (their mean and spread with a fixed seed), length ranges, percentiles on
 * known data, aggregation of request records into counts, goodput and refusal latency (the
 * SVG writer is test_svg.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "client/loadgen.h"
#include "core/alloc.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- generator and schedules ---------------------------------------------------------- */

static void test_rng_deterministic(void **state)
{
    (void)state;
    struct kvr_lg_rng a, b, c;
    kvr_lg_rng_seed(&a, 42);
    kvr_lg_rng_seed(&b, 42);
    kvr_lg_rng_seed(&c, 43);
    bool differs = false;
    for (int i = 0; i < 100; i++) {
        uint64_t x = kvr_lg_rng_next(&a);
        assert_true(x == kvr_lg_rng_next(&b));
        differs |= x != kvr_lg_rng_next(&c);
    }
    assert_true(differs);
    for (int i = 0; i < 10000; i++) {
        double u = kvr_lg_rng_uniform(&a);
        assert_true(u > 0 && u < 1);
        uint32_t r = kvr_lg_rng_range(&a, 5, 7);
        assert_true(r >= 5 && r <= 7);
    }
}

/* Mean and variance of the gaps of a schedule. */
static void gap_stats(const double *t, size_t n, double *mean, double *var)
{
    double s = 0, s2 = 0;
    for (size_t i = 1; i < n; i++) {
        double g = t[i] - t[i - 1];
        assert_true(g >= 0);
        s += g;
        s2 += g * g;
    }
    double m = s / (double)(n - 1);
    *mean = m;
    *var = s2 / (double)(n - 1) - m * m;
}

static void check_schedule(double rate, double burstiness)
{
    struct kvr_lg_schedule_spec spec = {
        .rate_per_s = rate, .burstiness = burstiness, .seed = 1234, .max_requests = 40000};
    double *t = NULL;
    size_t n = 0;
    struct kvr_err err = {0};
    assert_int_equal(kvr_lg_schedule(&spec, &t, &n, &err), 0);
    assert_int_equal(n, 40000);
    assert_true(t[0] == 0);
    double mean, var;
    gap_stats(t, n, &mean, &var);
    /* Gamma(k, 1/(rate k)): mean 1/rate, variance 1/(rate^2 k). With 40000 gaps the mean's
     * relative standard error is 1/sqrt(40000 k) <= 1.2% for k >= 0.2: 4% is over 3 sigma. */
    double want_mean = 1.0 / rate, want_var = 1.0 / (rate * rate * burstiness);
    assert_true(fabs(mean - want_mean) / want_mean < 0.04);
    assert_true(fabs(var - want_var) / want_var < 0.15);
    /* The same seed gives the same schedule. */
    double *t2 = NULL;
    size_t n2 = 0;
    assert_int_equal(kvr_lg_schedule(&spec, &t2, &n2, &err), 0);
    assert_int_equal(n2, n);
    assert_memory_equal(t, t2, n * sizeof *t);
    kvr_free(t);
    kvr_free(t2);
}

static void test_schedule_poisson(void **state)
{
    (void)state;
    check_schedule(5.0, 1.0);
    check_schedule(250.0, 1.0);
}

static void test_schedule_gamma(void **state)
{
    (void)state;
    check_schedule(10.0, 0.25); /* bursty */
    check_schedule(10.0, 4.0);  /* regular */
}

static void test_schedule_limits(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    double *t = NULL;
    size_t n = 0;
    /* Duration only: every arrival is before the end, and about rate * duration of them. */
    struct kvr_lg_schedule_spec spec = {
        .rate_per_s = 20, .burstiness = 1, .seed = 7, .duration_s = 100};
    assert_int_equal(kvr_lg_schedule(&spec, &t, &n, &err), 0);
    assert_true(n > 1800 && n < 2200);
    for (size_t i = 0; i < n; i++)
        assert_true(t[i] < 100);
    kvr_free(t);
    /* Count and duration: whichever comes first. */
    spec.max_requests = 10;
    assert_int_equal(kvr_lg_schedule(&spec, &t, &n, &err), 0);
    assert_int_equal(n, 10);
    kvr_free(t);
    /* Infinite rate: everything at once. */
    spec.rate_per_s = INFINITY;
    spec.duration_s = 0;
    assert_int_equal(kvr_lg_schedule(&spec, &t, &n, &err), 0);
    assert_int_equal(n, 10);
    for (size_t i = 0; i < n; i++)
        assert_true(t[i] == 0);
    kvr_free(t);
    /* Unbounded or nonsense specs are refused. */
    spec.max_requests = 0;
    spec.duration_s = 5;
    assert_int_equal(kvr_lg_schedule(&spec, &t, &n, &err), KVR_EINVAL);
    assert_null(t);
    struct kvr_lg_schedule_spec bad[] = {
        {.rate_per_s = 0, .burstiness = 1, .max_requests = 5},
        {.rate_per_s = -1, .burstiness = 1, .max_requests = 5},
        {.rate_per_s = NAN, .burstiness = 1, .max_requests = 5},
        {.rate_per_s = 1, .burstiness = 0, .max_requests = 5},
        {.rate_per_s = 1, .burstiness = 1},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(kvr_lg_schedule(&bad[i], &t, &n, &err), KVR_EINVAL);
    struct kvr_lg_schedule_spec huge = {.rate_per_s = 1e6, .burstiness = 1, .duration_s = 10};
    assert_int_equal(kvr_lg_schedule(&huge, &t, &n, &err), KVR_ERANGE);
    assert_null(t);
}

static void test_gamma_small_shape(void **state)
{
    (void)state;
    /* Shape < 1 goes through the boost; its mean must still be shape * scale. */
    struct kvr_lg_rng r;
    kvr_lg_rng_seed(&r, 99);
    double s = 0;
    int n = 100000;
    for (int i = 0; i < n; i++) {
        double g = kvr_lg_gamma(&r, 0.5, 2.0);
        assert_true(g >= 0 && isfinite(g));
        s += g;
    }
    assert_true(fabs(s / n - 1.0) < 0.03);
}

/* ---- ranges and lists ----------------------------------------------------------------- */

static void test_range_parse(void **state)
{
    (void)state;
    struct kvr_lg_range r;
    struct kvr_err err = {0};
    assert_int_equal(kvr_lg_range_parse(&r, "128", 1000, &err), 0);
    assert_int_equal(r.lo, 128);
    assert_int_equal(r.hi, 128);
    assert_int_equal(kvr_lg_range_parse(&r, "8:32", 1000, &err), 0);
    assert_int_equal(r.lo, 8);
    assert_int_equal(r.hi, 32);
    struct kvr_lg_rng rng;
    kvr_lg_rng_seed(&rng, 1);
    bool seen_lo = false, seen_hi = false;
    for (int i = 0; i < 2000; i++) {
        uint32_t v = kvr_lg_range_draw(&r, &rng);
        assert_true(v >= 8 && v <= 32);
        seen_lo |= v == 8;
        seen_hi |= v == 32;
    }
    assert_true(seen_lo && seen_hi);
    const char *bad[] = {"",       "0",  "x",     "8:",         ":8", "9:8",
                         "1:2000", "-3", "1:2:3", "4294967296", " 5"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_true(kvr_lg_range_parse(&r, bad[i], 1000, &err) < 0);
}

static void test_parse_rates(void **state)
{
    (void)state;
    double v[4];
    struct kvr_err err = {0};
    assert_int_equal(kvr_lg_parse_rates("1,2.5,40", v, 4, &err), 3);
    assert_true(v[0] == 1 && v[1] == 2.5 && v[2] == 40);
    assert_int_equal(kvr_lg_parse_rates("7", v, 4, &err), 1);
    assert_int_equal(kvr_lg_parse_rates("1,2,3,4,5", v, 4, &err), KVR_ERANGE);
    const char *bad[] = {"", ",", "1,", "1,,2", "0", "-1", "inf", "nan", "1;2", "abc"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(kvr_lg_parse_rates(bad[i], v, 4, &err), KVR_EINVAL);
}

/* ---- statistics ----------------------------------------------------------------------- */

static void test_percentile(void **state)
{
    (void)state;
    /* 1..100: rank p/100 * 99 interpolated, as numpy.percentile. */
    double v[100];
    for (int i = 0; i < 100; i++)
        v[i] = i + 1;
    assert_true(fabs(kvr_lg_percentile(v, 100, 50) - 50.5) < 1e-12);
    assert_true(fabs(kvr_lg_percentile(v, 100, 90) - 90.1) < 1e-12);
    assert_true(fabs(kvr_lg_percentile(v, 100, 99) - 99.01) < 1e-12);
    assert_true(kvr_lg_percentile(v, 100, 0) == 1);
    assert_true(kvr_lg_percentile(v, 100, 100) == 100);
    double one = 3.5;
    assert_true(kvr_lg_percentile(&one, 1, 99) == 3.5);
    double two[] = {10, 20};
    assert_true(fabs(kvr_lg_percentile(two, 2, 25) - 12.5) < 1e-12);
    assert_true(isnan(kvr_lg_percentile(v, 0, 50)));

    /* Summaries sort, skip NaN and give mean/min/max. */
    double w[] = {5, NAN, 1, 3, 2, 4};
    struct kvr_lg_summary s;
    kvr_lg_summarize(w, 6, &s);
    assert_int_equal(s.n, 5);
    assert_true(s.mean == 3 && s.min == 1 && s.max == 5 && s.p50 == 3);
    assert_true(fabs(s.p90 - 4.6) < 1e-12);
    kvr_lg_summarize(w, 0, &s);
    assert_int_equal(s.n, 0);
    assert_true(isnan(s.mean) && isnan(s.p99));
}

/* ---- aggregation ---------------------------------------------------------------------- */

static void test_aggregate(void **state)
{
    (void)state;
    double itl0[] = {0.010, 0.020, 0.030}, itl1[] = {0.050};
    struct kvr_lg_record r[6];
    memset(r, 0, sizeof r);
    /* 0: ok, 4 tokens, TTFT 100 ms, E2E 160 ms: meets a 200/500 ms budget. */
    r[0] = (struct kvr_lg_record){.outcome = KVR_LG_OK,
                                  .http_status = 200,
                                  .prompt_tokens = 10,
                                  .output_tokens = 4,
                                  .ttft_s = 0.1,
                                  .e2e_s = 0.16,
                                  .itl_s = itl0,
                                  .n_itl = 3};
    /* 1: ok but TTFT 300 ms: misses the first-token budget. */
    r[1] = (struct kvr_lg_record){.outcome = KVR_LG_OK,
                                  .http_status = 200,
                                  .prompt_tokens = 10,
                                  .output_tokens = 2,
                                  .ttft_s = 0.3,
                                  .e2e_s = 0.35,
                                  .itl_s = itl1,
                                  .n_itl = 1};
    /* 2, 3: refused over budget (fast) and queue full (slow: over the 50 ms limit). */
    r[2] = (struct kvr_lg_record){
        .outcome = KVR_LG_REFUSED, .http_status = 429, .response_s = 0.002, .ttft_s = NAN};
    snprintf(r[2].reason, sizeof r[2].reason, "over_budget");
    r[3] = (struct kvr_lg_record){
        .outcome = KVR_LG_REFUSED, .http_status = 503, .response_s = 0.080, .ttft_s = NAN};
    snprintf(r[3].reason, sizeof r[3].reason, "queue_full");
    /* 4: an error; 5: a timeout. */
    r[4] = (struct kvr_lg_record){.outcome = KVR_LG_ERROR, .http_status = 500, .ttft_s = NAN};
    snprintf(r[4].reason, sizeof r[4].reason, "internal");
    r[5] = (struct kvr_lg_record){.outcome = KVR_LG_TIMEOUT, .ttft_s = NAN};
    snprintf(r[5].reason, sizeof r[5].reason, "timeout");

    struct kvr_lg_result res;
    assert_int_equal(kvr_lg_aggregate(r, 6, 2.0, 0.2, 0.5, &res), 0);
    assert_int_equal(res.n_total, 6);
    assert_int_equal(res.n_outcome[KVR_LG_OK], 2);
    assert_int_equal(res.n_outcome[KVR_LG_REFUSED], 2);
    assert_int_equal(res.n_outcome[KVR_LG_ERROR], 1);
    assert_int_equal(res.n_outcome[KVR_LG_TIMEOUT], 1);
    assert_int_equal(res.n_met_budget, 1);
    assert_true(r[0].met_budget && !r[1].met_budget && !r[2].met_budget);
    assert_true(fabs(res.goodput_req_per_s - 0.5) < 1e-12);
    assert_true(fabs(res.req_per_s - 1.0) < 1e-12);
    assert_int_equal(res.output_tokens, 6);
    assert_true(fabs(res.output_tok_per_s - 3.0) < 1e-12);
    assert_true(fabs(res.total_tok_per_s - 13.0) < 1e-12);
    assert_int_equal(res.ttft_s.n, 2);
    assert_true(fabs(res.ttft_s.mean - 0.2) < 1e-12);
    /* TPOT: (0.16 - 0.1) / 3 = 20 ms and (0.35 - 0.3) / 1 = 50 ms. */
    assert_int_equal(res.tpot_s.n, 2);
    assert_true(fabs(res.tpot_s.min - 0.02) < 1e-12 && fabs(res.tpot_s.max - 0.05) < 1e-12);
    assert_int_equal(res.itl_s.n, 4);
    assert_true(fabs(res.itl_s.max - 0.05) < 1e-12);
    assert_int_equal(res.refusal_s.n, 2);
    assert_true(fabs(res.refusal_s.max - 0.080) < 1e-12);
    assert_int_equal(res.n_refusal_over_limit, 1);
    assert_int_equal(res.n_refused_reasons, 2);
    assert_int_equal(res.n_error_reasons, 2);
    bool seen429 = false, seen503 = false;
    for (size_t i = 0; i < res.n_refused_reasons; i++) {
        seen429 |= res.refused[i].http_status == 429 &&
                   !strcmp(res.refused[i].reason, "over_budget") && res.refused[i].n == 1;
        seen503 |= res.refused[i].http_status == 503 &&
                   !strcmp(res.refused[i].reason, "queue_full") && res.refused[i].n == 1;
    }
    assert_true(seen429 && seen503);

    /* No budget: every ok request counts as good. */
    assert_int_equal(kvr_lg_aggregate(r, 6, 2.0, 0, 0, &res), 0);
    assert_int_equal(res.n_met_budget, 2);
    /* Nothing at all. */
    assert_int_equal(kvr_lg_aggregate(r, 0, 0, 0, 0, &res), 0);
    assert_int_equal(res.n_total, 0);
    assert_true(isnan(res.ttft_s.p50));
}

static void test_aggregate_many_reasons(void **state)
{
    (void)state;
    struct kvr_lg_record r[20];
    memset(r, 0, sizeof r);
    for (int i = 0; i < 20; i++) {
        r[i].outcome = KVR_LG_ERROR;
        r[i].http_status = 400 + i;
        snprintf(r[i].reason, sizeof r[i].reason, "r%d", i);
    }
    struct kvr_lg_result res;
    assert_int_equal(kvr_lg_aggregate(r, 20, 1, 0, 0, &res), 0);
    assert_int_equal(res.n_error_reasons, KVR_LG_MAX_REASONS);
    size_t total = 0;
    bool other = false;
    for (size_t i = 0; i < res.n_error_reasons; i++) {
        total += res.errors[i].n;
        other |= !strcmp(res.errors[i].reason, "other");
    }
    assert_int_equal(total, 20);
    assert_true(other);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rng_deterministic), cmocka_unit_test(test_schedule_poisson),
        cmocka_unit_test(test_schedule_gamma),    cmocka_unit_test(test_schedule_limits),
        cmocka_unit_test(test_gamma_small_shape), cmocka_unit_test(test_range_parse),
        cmocka_unit_test(test_parse_rates),       cmocka_unit_test(test_percentile),
        cmocka_unit_test(test_aggregate),         cmocka_unit_test(test_aggregate_many_reasons),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
