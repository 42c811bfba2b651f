/* test_costmodel.c - the batch cost model fits what the ring reports and predicts periods;
 * calibration follows the ratio of actual to predicted times. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "bridge/costmodel.h"

#include <math.h>

static double close_to(double a, double b)
{
    return fabs(a - b) < 1e-6 * (1 + fabs(b));
}

/* Stage s holds a batch for (1 + s) + 0.1 (s + 1) rows + 0.001 pairs ms; hops add 0.5 ms. */
static void feed(struct kvr_cost_model *m, int n)
{
    for (int i = 0; i < n; i++) {
        double rows = 1 + (i * 7 % 64), pairs = rows * (10 + (i * 13 % 300));
        double held[3], sum = 0;
        for (int s = 0; s < 3; s++) {
            held[s] = (1 + s) + 0.1 * (s + 1) * rows + 0.001 * pairs;
            sum += held[s];
        }
        kvr_cost_observe(m, (struct kvr_cost_shape){rows, pairs}, held, sum + 0.5);
    }
}

static void test_fits_rows_and_attention(void **state)
{
    (void)state;
    struct kvr_cost_model m;
    kvr_cost_init(&m, 3, 3);
    assert_false(kvr_cost_ready(&m));
    feed(&m, 300);
    assert_true(kvr_cost_ready(&m));
    struct kvr_cost_shape b = {10, 2000};
    assert_true(close_to(kvr_cost_stage_ms(&m, 0, b), 1 + 1 + 2));
    assert_true(close_to(kvr_cost_stage_ms(&m, 2, b), 3 + 3 + 2));
    assert_true(close_to(kvr_cost_batch_ms(&m, b), 8));
    assert_true(close_to(kvr_cost_trip_ms(&m, (struct kvr_cost_shape){0, 0}), 1 + 2 + 3 + 0.5));
    /* 30 decoding sequences with 99 positions of context over 3 micro-batches: 10 rows and
     * 1000 pairs a batch; the slowest stage passes three batches per period (3 x 7 ms),
     * more than one trip (3 + 5 + 7 + 0.5). */
    struct kvr_cost_shape none = {0, 0};
    assert_true(close_to(kvr_cost_period_ms(&m, 30, 99, none), 21));
    /* One sequence rides in one batch (empty batches are not sent): the trip dominates. */
    assert_true(close_to(kvr_cost_period_ms(&m, 1, 99, none),
                         kvr_cost_trip_ms(&m, (struct kvr_cost_shape){1, 100})));
    assert_true(close_to(kvr_cost_pairs(10, 4), 4 * 10 + 10));
}

static void test_no_spread_is_pessimistic(void **state)
{
    (void)state;
    struct kvr_cost_model m;
    kvr_cost_init(&m, 2, 2);
    double held[2] = {4, 4};
    for (int i = 0; i < 20; i++)
        kvr_cost_observe(&m, (struct kvr_cost_shape){8, 800}, held, 9);
    /* Only one shape seen: time is taken as proportional to rows. */
    assert_true(close_to(kvr_cost_stage_ms(&m, 0, (struct kvr_cost_shape){16, 1600}), 8));
    assert_true(kvr_cost_stage_ms(&m, 0, (struct kvr_cost_shape){0, 0}) >= 0);
}

/* A light load: a prompt's full batches, then hundreds of decode batches of 1-4 rows whose
 * time hardly depends on their rows (streaming the weights costs the same for 1 row or 4).
 * What a full batch costs must not be forgotten meanwhile: with one shared memory (0.98 a
 * batch) the fit had only the decode batches left and put a 64-row batch at ~5 ms. */
static void test_full_batches_remembered_between_prompts(void **state)
{
    (void)state;
    struct kvr_cost_model m;
    kvr_cost_init(&m, 1, 2);
    for (int i = 0; i < 6; i++) {
        double held = 40; /* 64 rows of prefill */
        kvr_cost_observe(&m, (struct kvr_cost_shape){64, 64 * 100}, &held, held + 1);
    }
    for (int i = 0; i < 400; i++) {
        double rows = 1 + i % 4, held = 5 + 0.01 * rows;
        kvr_cost_observe(&m, (struct kvr_cost_shape){rows, rows * 150}, &held, held + 1);
    }
    double full = kvr_cost_stage_ms(&m, 0, (struct kvr_cost_shape){64, 64 * 100});
    double one = kvr_cost_stage_ms(&m, 0, (struct kvr_cost_shape){1, 150});
    assert_true(full > 30 && full < 50);
    assert_true(one > 3 && one < 8);
}

static void test_calibration(void **state)
{
    (void)state;
    struct kvr_calib c = {0};
    assert_true(kvr_calib_factor(&c, 1.1) >= 1.3); /* nothing known: careful */
    for (int i = 0; i < 200; i++)
        kvr_calib_observe(&c, 1.0);
    assert_true(close_to(kvr_calib_factor(&c, 1.1), 1.1)); /* exact model: the floor */
    /* Ratios spread evenly over [1, 2]: the factor is their 95th percentile, the median
     * their middle, and one outlier moves the factor by a step, not by its size. */
    for (int i = 0; i < 2000; i++)
        kvr_calib_observe(&c, 1.0 + fmod(i * 0.6180339887, 1.0));
    double f = kvr_calib_factor(&c, 1.1);
    assert_true(f > 1.85 && f < 2.2);
    assert_true(c.mid > 1.35 && c.mid < 1.65);
    assert_true(c.mean > 1.45 && c.mean < 1.55);
    kvr_calib_observe(&c, 100.0);
    assert_true(kvr_calib_factor(&c, 1.1) < 1.25 * f);
    kvr_calib_observe(&c, NAN); /* ignored */
    double g = kvr_calib_factor(&c, 1.1);
    kvr_calib_observe(&c, NAN);
    assert_true(close_to(kvr_calib_factor(&c, 1.1), g));
}

/* The recent mean: the prior alone before anything is seen and again long after; at one
 * observation a second, it follows a new level within a few tau instead of remembering the
 * old one. */
static void test_recent_mean(void **state)
{
    (void)state;
    const uint64_t S = 1000000000ull; /* 1 s in ns */
    struct kvr_recent r = {0};
    assert_true(close_to(kvr_recent_mean(&r, 5 * S, 2000, 7.0, 5), 7.0));
    for (uint64_t t = 1; t <= 60; t++) /* a saturated spell: gaps of 100 ms */
        kvr_recent_add(&r, 100.0, t * S, 2000);
    double m = kvr_recent_mean(&r, 60 * S, 2000, 10.0, 5);
    /* weight of the 60 observations: sum of exp(-k / 2) = 1 / (1 - exp(-0.5)) = 2.54 */
    double w = 1 / (1 - exp(-0.5));
    assert_true(close_to(m, (100.0 * w + 10.0 * 5) / (w + 5)));
    assert_true(close_to(kvr_recent_mean(&r, 600 * S, 2000, 10.0, 5), 10.0)); /* forgotten */
    for (uint64_t t = 61; t <= 70; t++) /* a light spell: gaps of 10 ms */
        kvr_recent_add(&r, 10.0, t * S, 2000);
    assert_true(kvr_recent_mean(&r, 70 * S, 2000, 10.0, 0) < 10.0 + 90.0 * exp(-5.0) * 3);
    kvr_recent_add(&r, NAN, 71 * S, 2000); /* ignored */
    assert_true(isfinite(kvr_recent_mean(&r, 71 * S, 2000, 10.0, 0)));
    /* a time before the last observation (clocks are monotonic; never a weight above 1) */
    assert_true(isfinite(kvr_recent_mean(&r, 1 * S, 2000, 10.0, 0)));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fits_rows_and_attention),
        cmocka_unit_test(test_no_spread_is_pessimistic),
        cmocka_unit_test(test_full_batches_remembered_between_prompts),
        cmocka_unit_test(test_calibration),
        cmocka_unit_test(test_recent_mean),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
