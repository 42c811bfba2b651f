/* test_logprobs.c - log_softmax of a logits row and its most likely tokens: the values
 * against a plain double computation, the order (ties by lower id), rows with -inf and NaN,
 * and the bounds. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/err.h"
#include "core/rng.h"
#include "model/logprobs.h"

#include <math.h>

static void test_small_row(void **state)
{
    (void)state;
    const float l[6] = {1.0f, 3.0f, 3.0f, 2.0f, -INFINITY, NAN};
    double want_lse = log(exp(1.0) + 2 * exp(3.0) + exp(2.0));
    struct kvr_token_logprob top[KVR_LOGPROBS_MAX_TOP];
    double lse = 0;
    assert_int_equal(kvr_logprobs_top(l, 6, 3, top, &lse), 3);
    assert_true(fabs(lse - want_lse) < 1e-12);
    /* most likely first; the tie of ids 1 and 2 goes to the lower id */
    assert_int_equal(top[0].id, 1);
    assert_int_equal(top[1].id, 2);
    assert_int_equal(top[2].id, 3);
    assert_true(top[0].logprob == (float)(3.0 - want_lse));
    assert_true(top[2].logprob == (float)(2.0 - want_lse));
    assert_true(kvr_logprobs_token(l, 0, lse) == (float)(1.0 - want_lse));
    assert_true(kvr_logprobs_token(l, 4, lse) == -INFINITY); /* -inf and NaN: impossible */
    assert_true(kvr_logprobs_token(l, 5, lse) == -INFINITY);
    /* more asked for than the row has finite logits: those there are */
    assert_int_equal(kvr_logprobs_top(l, 6, 20, top, &lse), 4);
    assert_int_equal(top[3].id, 0);
    /* none asked for: only the log-sum-exp */
    assert_int_equal(kvr_logprobs_top(l, 6, 0, NULL, &lse), 0);
}

static void test_bounds(void **state)
{
    (void)state;
    const float none[3] = {-INFINITY, NAN, -INFINITY};
    const float one[1] = {0.5f};
    struct kvr_token_logprob top[KVR_LOGPROBS_MAX_TOP + 1];
    double lse = 0;
    assert_int_equal(kvr_logprobs_top(none, 3, 2, top, &lse), KVR_EINVAL);
    assert_int_equal(kvr_logprobs_top(one, 0, 1, top, &lse), KVR_EINVAL);
    assert_int_equal(kvr_logprobs_top(one, 1, KVR_LOGPROBS_MAX_TOP + 1, top, &lse), KVR_EINVAL);
    assert_int_equal(kvr_logprobs_top(one, 1, 1, top, &lse), 1);
    assert_true(top[0].id == 0 && top[0].logprob == 0.0f); /* the only token: certain */
}

/* A vocabulary-sized row: every value against a plain two-pass softmax in double, the top 20
 * against a full sort, and the probabilities summing to 1. */
static void test_large_row(void **state)
{
    (void)state;
    enum { N = 32000 };
    static float l[N];
    uint64_t rng[4];
    kvr_xoshiro_seed(rng, 7);
    for (int i = 0; i < N; i++)
        l[i] = (float)((double)(kvr_xoshiro_next(rng) >> 11) * 0x1p-53 * 30.0 - 15.0);
    l[123] = l[456] = 40.0f; /* a tie at the top */
    struct kvr_token_logprob top[KVR_LOGPROBS_MAX_TOP];
    double lse = 0;
    assert_int_equal(kvr_logprobs_top(l, N, KVR_LOGPROBS_MAX_TOP, top, &lse), 20);
    double m = 40.0, sum = 0.0;
    for (int i = 0; i < N; i++)
        sum += exp((double)l[i] - m);
    assert_true(fabs(lse - (m + log(sum))) < 1e-9);
    assert_int_equal(top[0].id, 123);
    assert_int_equal(top[1].id, 456);
    double p = 0.0;
    for (int i = 0; i < N; i++) {
        float lp = kvr_logprobs_token(l, i, lse);
        assert_true(lp <= 0.0f);
        p += exp((double)lp);
    }
    assert_true(fabs(p - 1.0) < 1e-4);
    for (int k = 1; k < KVR_LOGPROBS_MAX_TOP; k++) /* sorted, and nothing outside beats them */
        assert_true(top[k].logprob <= top[k - 1].logprob);
    int above = 0;
    for (int i = 0; i < N; i++)
        above += kvr_logprobs_token(l, i, lse) > top[KVR_LOGPROBS_MAX_TOP - 1].logprob;
    assert_int_equal(above, KVR_LOGPROBS_MAX_TOP - 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_row),
        cmocka_unit_test(test_bounds),
        cmocka_unit_test(test_large_row),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
