/* test_costmodel.c - the batch cost model fits what the ring reports and predicts periods. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "bridge/costmodel.h"

#include <math.h>

static void test_fits_linear_costs(void **state)
{
    (void)state;
    struct kvr_cost_model m;
    kvr_cost_init(&m, 3, 3);
    assert_false(kvr_cost_ready(&m));
    /* Stage s holds a batch for (1 + s) + 0.1 * (s + 1) * rows ms; hops add 0.5 ms. */
    for (int i = 0; i < 200; i++) {
        uint32_t rows = 1 + (uint32_t)(i * 7 % 64);
        double held[3], sum = 0;
        for (int s = 0; s < 3; s++) {
            held[s] = (1 + s) + 0.1 * (s + 1) * rows;
            sum += held[s];
        }
        kvr_cost_observe(&m, rows, held, sum + 0.5);
    }
    assert_true(kvr_cost_ready(&m));
    assert_true(fabs(kvr_cost_stage_ms(&m, 0, 10) - 2.0) < 1e-6);
    assert_true(fabs(kvr_cost_stage_ms(&m, 2, 10) - 6.0) < 1e-6);
    assert_true(fabs(kvr_cost_batch_ms(&m, 20) - (3 + 6.0)) < 1e-6);
    assert_true(fabs(kvr_cost_trip_ms(&m, 0) - (1 + 2 + 3 + 0.5)) < 1e-6);
    /* 30 decoding sequences over 3 micro-batches: 10 rows a batch; the slowest stage passes
     * three batches per period (3 x 6 ms = 18) which is more than one trip (2+4+6+0.5). */
    assert_true(fabs(kvr_cost_period_ms(&m, 30, 0) - 18.0) < 1e-6);
    /* One sequence rides in one batch (empty batches are not sent): the trip dominates. */
    double one = kvr_cost_period_ms(&m, 1, 0);
    assert_true(fabs(one - kvr_cost_trip_ms(&m, 1)) < 1e-9);
}

static void test_constant_rows_are_pessimistic(void **state)
{
    (void)state;
    struct kvr_cost_model m;
    kvr_cost_init(&m, 2, 2);
    double held[2] = {4, 4};
    for (int i = 0; i < 20; i++)
        kvr_cost_observe(&m, 8, held, 9);
    /* Only 8-row batches seen: time is taken as proportional to rows. */
    assert_true(fabs(kvr_cost_stage_ms(&m, 0, 16) - 8) < 1e-6);
    assert_true(kvr_cost_stage_ms(&m, 0, 0) >= 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fits_linear_costs),
        cmocka_unit_test(test_constant_rows_are_pessimistic),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
