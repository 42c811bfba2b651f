/* test_attn.c - attention's inner loops (src/model/attn.h), both sets.
 *
 * What is checked, and against what:
 *  - scores and the weighted sum agree with a double-precision computation (the math);
 *  - a call over a block of n positions is bit-identical to n calls over one position each
 *    (the eight-at-a-time AVX2 dot and its transposed reduction do the same additions as
 *    the single dot), for head sizes that are and are not a multiple of 8, and for every
 *    group size; so where a sequence's blocks begin never changes a bit (batch invariance);
 *  - over an f16 cache: scores over halves give the bits of scores over the same keys as
 *    floats; the online half-precision sum gives, per head, the same bits for a block or
 *    single positions, a group or each head alone, and the AVX2 set the plain set's bits,
 *    over blocks longer than the AVX2 set's chunk of precomputed weights; rounding the
 *    query to half gives kvr_f32_to_f16's bits;
 *  - softmax and SwiGLU agree with double precision to a few ulp (the AVX2 set has its own
 *    exp), also at the clamped extremes, and SwiGLU gives the same bits however the range
 *    is cut (threads split it anywhere);
 *  - GeGLU's GELU at half precision: over every half in (-10, 10) the result is a half,
 *    depends only on the input's half rounding, and is within a half-ulp (and the f32
 *    formula's cancellation near -1) of the double-precision tanh GELU; g itself from 10 up,
 *    0 from -10 down; both sets give the same bits.
 * The AVX2 set is checked only when the CPU has it (the kernel set says "avx2"). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "model_options.h"
#include "testutil.h"

#include "model/attn.h"
#include "model/dtype.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x2545F4914F6CDD1Dull;

static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) / (double)(1u << 24)) * 2.0f - 1.0f;
}

static float *rand_floats(size_t n)
{
    float *p = malloc(n * sizeof *p);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = frand();
    return p;
}

static const uint32_t HDS[] = {8, 12, 20, 32, 64, 128};
static const uint32_t GROUPS[] = {1, 2, 3, 4};
static const uint32_t NS[] = {1, 5, 8, 9, 16, 19, 33};

static void check_scores(const struct kvr_attn_ops *ops, const char *set)
{
    for (size_t a = 0; a < sizeof HDS / sizeof *HDS; a++)
        for (size_t b = 0; b < sizeof GROUPS / sizeof *GROUPS; b++)
            for (size_t c = 0; c < sizeof NS / sizeof *NS; c++) {
                uint32_t hd = HDS[a], group = GROUPS[b], n = NS[c];
                size_t k_step = (size_t)hd * 5 + 8, stride = n + 3;
                float *q = rand_floats((size_t)group * hd), *k = rand_floats(n * k_step);
                float *block = calloc(group * stride, sizeof *block);
                float *single = calloc(group * stride, sizeof *single);
                assert_non_null(block);
                assert_non_null(single);
                float scale = 1.0f / sqrtf((float)hd);
                ops->scores(block, stride, q, group, hd, k, k_step, n, scale);
                for (uint32_t j = 0; j < n; j++)
                    ops->scores(single + j, stride, q, group, hd, k + j * k_step, k_step, 1, scale);
                if (memcmp(block, single, group * stride * sizeof *block) != 0)
                    fail_msg("%s scores: hd %u group %u n %u: a block differs from single "
                             "positions",
                             set, hd, group, n);
                for (uint32_t g = 0; g < group; g++)
                    for (uint32_t j = 0; j < n; j++) {
                        double want = 0;
                        for (uint32_t i = 0; i < hd; i++)
                            want += (double)q[g * hd + i] * k[j * k_step + i];
                        want *= scale;
                        if (fabs(block[g * stride + j] - want) > 1e-5 * (1 + fabs(want)) * hd)
                            fail_msg("%s scores: hd %u group %u pos %u: %g, want %g", set, hd,
                                     group, j, block[g * stride + j], want);
                    }
                free(q);
                free(k);
                free(block);
                free(single);
            }
}

static void check_mix(const struct kvr_attn_ops *ops, const char *set)
{
    for (size_t a = 0; a < sizeof HDS / sizeof *HDS; a++)
        for (size_t b = 0; b < sizeof GROUPS / sizeof *GROUPS; b++)
            for (size_t c = 0; c < sizeof NS / sizeof *NS; c++) {
                uint32_t hd = HDS[a], group = GROUPS[b], n = NS[c];
                size_t v_step = (size_t)hd * 3 + 4, stride = n + 1;
                float *p = rand_floats(group * stride), *v = rand_floats(n * v_step);
                float *start = rand_floats((size_t)group * hd);
                float *block = malloc((size_t)group * hd * sizeof *block);
                float *single = malloc((size_t)group * hd * sizeof *single);
                assert_non_null(block);
                assert_non_null(single);
                memcpy(block, start, (size_t)group * hd * sizeof *block);
                memcpy(single, start, (size_t)group * hd * sizeof *single);
                ops->mix(block, p, stride, group, hd, v, v_step, n);
                for (uint32_t j = 0; j < n; j++)
                    ops->mix(single, p + j, stride, group, hd, v + j * v_step, v_step, 1);
                if (memcmp(block, single, (size_t)group * hd * sizeof *block) != 0)
                    fail_msg("%s mix: hd %u group %u n %u: a block differs from single "
                             "positions",
                             set, hd, group, n);
                for (uint32_t g = 0; g < group; g++)
                    for (uint32_t i = 0; i < hd; i++) {
                        double want = start[g * hd + i];
                        for (uint32_t j = 0; j < n; j++)
                            want += (double)p[g * stride + j] * v[j * v_step + i];
                        if (fabs(block[g * hd + i] - want) > 1e-5 * (1 + n))
                            fail_msg("%s mix: hd %u group %u elem %u: %g, want %g", set, hd, group,
                                     i, block[g * hd + i], want);
                    }
                free(p);
                free(v);
                free(start);
                free(block);
                free(single);
            }
}

/* scores_f16 over keys held as halves gives the bits of scores over the same keys as
 * floats, block or single positions alike. */
static void check_scores_f16(const struct kvr_attn_ops *ops, const char *set)
{
    for (size_t a = 0; a < sizeof HDS / sizeof *HDS; a++)
        for (size_t b = 0; b < sizeof GROUPS / sizeof *GROUPS; b++)
            for (size_t c = 0; c < sizeof NS / sizeof *NS; c++) {
                uint32_t hd = HDS[a], group = GROUPS[b], n = NS[c];
                size_t k_step = (size_t)hd * 3 + 8, stride = n + 2;
                float *q = rand_floats((size_t)group * hd), *kf = rand_floats(n * k_step);
                uint16_t *kh = malloc(n * k_step * sizeof *kh);
                float *want = calloc(group * stride, sizeof *want);
                float *block = calloc(group * stride, sizeof *block);
                float *single = calloc(group * stride, sizeof *single);
                assert_non_null(kh);
                assert_non_null(want);
                assert_non_null(block);
                assert_non_null(single);
                for (size_t i = 0; i < n * k_step; i++) {
                    kh[i] = kvr_f32_to_f16(kf[i] * 4.0f);
                    kf[i] = kvr_f16_to_f32(kh[i]);
                }
                float scale = 1.0f / sqrtf((float)hd);
                ops->scores(want, stride, q, group, hd, kf, k_step, n, scale);
                ops->scores_f16(block, stride, q, group, hd, kh, k_step, n, scale);
                for (uint32_t j = 0; j < n; j++)
                    ops->scores_f16(single + j, stride, q, group, hd, kh + j * k_step, k_step, 1,
                                    scale);
                if (memcmp(block, want, group * stride * sizeof *block) != 0)
                    fail_msg("%s scores_f16: hd %u group %u n %u: differs from scores over the "
                             "keys as floats",
                             set, hd, group, n);
                if (memcmp(block, single, group * stride * sizeof *block) != 0)
                    fail_msg("%s scores_f16: hd %u group %u n %u: a block differs from single "
                             "positions",
                             set, hd, group, n);
                free(q);
                free(kf);
                free(kh);
                free(want);
                free(block);
                free(single);
            }
}

/* mix_online_f16 over random scores and half values, for every head size, group size and
 * block length: a block gives what single positions give, a group gives what each of its
 * heads alone gives, and the result is the softmax-weighted sum to half precision. ref, if
 * given, is a set whose accumulator and state bits must be equal. */
static void check_online(const struct kvr_attn_ops *ops, const struct kvr_attn_ops *ref,
                         const char *set)
{
    enum { MAX_G = 4, MAX_HD = 128 };
    static const uint32_t ns[] = {1, 5, 8, 9, 16, 19, 33, 64, 65, 150};
    for (size_t a = 0; a < sizeof HDS / sizeof *HDS; a++)
        for (size_t b = 0; b < sizeof GROUPS / sizeof *GROUPS; b++)
            for (size_t c = 0; c < sizeof ns / sizeof *ns; c++) {
                uint32_t hd = HDS[a], group = GROUPS[b], n = ns[c];
                size_t v_step = (size_t)hd * 2 + 4, stride = n + 3;
                float *p = rand_floats(group * stride), *vf = rand_floats(n * v_step);
                uint16_t *v = malloc(n * v_step * sizeof *v);
                assert_non_null(v);
                for (size_t i = 0; i < group * stride; i++)
                    p[i] *= 6.0f;
                for (size_t i = 0; i < n * v_step; i++)
                    v[i] = kvr_f32_to_f16(vf[i]);
                uint16_t block[MAX_G * MAX_HD] = {0}, single[MAX_G * MAX_HD] = {0};
                uint16_t alone[MAX_G * MAX_HD] = {0}, other[MAX_G * MAX_HD] = {0};
                float st_b[2 * MAX_G], st_s[2 * MAX_G], st_a[2 * MAX_G], st_o[2 * MAX_G];
                for (uint32_t g = 0; g < MAX_G; g++) {
                    st_b[2 * g] = st_s[2 * g] = st_a[2 * g] = st_o[2 * g] = -INFINITY;
                    st_b[2 * g + 1] = st_s[2 * g + 1] = st_a[2 * g + 1] = st_o[2 * g + 1] = 0.0f;
                }
                ops->mix_online_f16(block, st_b, p, stride, group, hd, v, v_step, n);
                for (uint32_t j = 0; j < n; j++)
                    ops->mix_online_f16(single, st_s, p + j, stride, group, hd, v + j * v_step,
                                        v_step, 1);
                for (uint32_t g = 0; g < group; g++)
                    ops->mix_online_f16(alone + g * hd, st_a + 2 * g, p + g * stride, stride, 1, hd,
                                        v, v_step, n);
                if (memcmp(block, single, sizeof block) != 0 || memcmp(st_b, st_s, sizeof st_b))
                    fail_msg("%s online: hd %u group %u n %u: a block differs from single "
                             "positions",
                             set, hd, group, n);
                if (memcmp(block, alone, sizeof block) != 0 || memcmp(st_b, st_a, sizeof st_b))
                    fail_msg("%s online: hd %u group %u n %u: a group differs from its heads "
                             "alone",
                             set, hd, group, n);
                if (ref) {
                    ref->mix_online_f16(other, st_o, p, stride, group, hd, v, v_step, n);
                    if (memcmp(block, other, sizeof block) != 0 || memcmp(st_b, st_o, sizeof st_b))
                        fail_msg("%s online: hd %u group %u n %u: differs from the plain set", set,
                                 hd, group, n);
                }
                for (uint32_t g = 0; g < group; g++) {
                    const float *pg = p + g * stride;
                    double max = -INFINITY, sum = 0.0;
                    for (uint32_t j = 0; j < n; j++)
                        max = pg[j] > max ? pg[j] : max;
                    for (uint32_t j = 0; j < n; j++)
                        sum += exp(pg[j] - max);
                    if (fabs(st_b[2 * g + 1] - sum) > 1e-5 * sum)
                        fail_msg("%s online: hd %u n %u head %u: sum %g, want %g", set, hd, n, g,
                                 st_b[2 * g + 1], sum);
                    for (uint32_t i = 0; i < hd; i++) {
                        double want = 0.0;
                        for (uint32_t j = 0; j < n; j++)
                            want += exp(pg[j] - max) / sum * kvr_f16_to_f32(v[j * v_step + i]);
                        double got = kvr_f16_to_f32(block[g * hd + i]) / st_b[2 * g + 1];
                        if (fabs(got - want) > 2e-3 * (1 + 0.1 * n))
                            fail_msg("%s online: hd %u n %u head %u elem %u: %g, want %g", set, hd,
                                     n, g, i, got, want);
                    }
                }
                free(p);
                free(vf);
                free(v);
            }
}

/* round_half gives kvr_f32_to_f16's rounding read back, over bit patterns of the whole
 * range (NaNs only as NaNs). */
static void check_round_half(const struct kvr_attn_ops *ops, const char *set)
{
    enum { N = 1 << 16 };
    static float x[N + 3];
    for (uint32_t i = 0; i < N + 3; i++) {
        uint32_t bits = i * 65539u + (i >> 3);
        memcpy(&x[i], &bits, sizeof bits);
    }
    x[0] = 1.0f + 0x1p-11f; /* a tie: to even, 1 */
    x[1] = 65520.0f;        /* past the largest half: infinity */
    x[2] = 0x1p-25f;        /* a tie at the bottom: 0 */
    static float y[N + 3];
    memcpy(y, x, sizeof y);
    ops->round_half(y, N + 3); /* a tail past the vectors */
    for (uint32_t i = 0; i < N + 3; i++) {
        float want = kvr_f16_to_f32(kvr_f32_to_f16(x[i]));
        if (isnan(want) ? !isnan(y[i]) : memcmp(&y[i], &want, sizeof want) != 0)
            fail_msg("%s round_half(%a) = %a, want %a", set, x[i], y[i], want);
    }
}

static void check_softmax(const struct kvr_attn_ops *ops, const char *set)
{
    static const uint32_t lens[] = {1, 3, 8, 13, 64, 200};
    for (size_t k = 0; k < sizeof lens / sizeof *lens; k++) {
        uint32_t n = lens[k];
        float *x = rand_floats(n);
        for (uint32_t t = 0; t < n; t++)
            x[t] *= 30.0f; /* spreads of up to 60: some terms underflow to nothing */
        /* The exponent's argument is x - max rounded to float, as the kernels compute it
         * (that rounding alone is worth up to ~4e-6 of the result at spreads of 60). */
        float max = -INFINITY;
        double sum = 0;
        for (uint32_t t = 0; t < n; t++)
            max = x[t] > max ? x[t] : max;
        for (uint32_t t = 0; t < n; t++)
            sum += exp((double)(x[t] - max));
        float *y = malloc(n * sizeof *y);
        assert_non_null(y);
        memcpy(y, x, n * sizeof *y);
        ops->softmax(y, n);
        for (uint32_t t = 0; t < n; t++) {
            double want = exp((double)(x[t] - max)) / sum;
            if (fabs(y[t] - want) > 1e-6 * want + 1e-37)
                fail_msg("%s softmax n %u: p[%u] = %.9g, want %.9g", set, n, t, y[t], want);
        }
        free(x);
        free(y);
    }
}

static void check_swiglu(const struct kvr_attn_ops *ops, const char *set)
{
    enum { N = 203 };
    float gate[N], up[N], whole[N], pieces[N];
    for (int i = 0; i < N; i++) {
        gate[i] = frand() * (i < 100 ? 12.0f : 100.0f); /* the tail reaches the clamps */
        up[i] = frand();
    }
    gate[0] = 0.0f;
    gate[1] = -100.0f;
    gate[2] = 100.0f;
    memcpy(whole, gate, sizeof whole);
    ops->swiglu(whole, up, N);
    for (int i = 0; i < N; i++) {
        double g = gate[i], want = g / (1.0 + exp(-g)) * up[i];
        if (fabs(whole[i] - want) > 1e-6 * fabs(want) + 1e-30)
            fail_msg("%s swiglu: gate %.9g up %.9g -> %.9g, want %.9g", set, gate[i], up[i],
                     whole[i], want);
    }
    /* cut into ragged pieces, as threads do */
    memcpy(pieces, gate, sizeof pieces);
    static const int cuts[] = {0, 1, 4, 13, 21, 22, 64, 99, 150, 197, N};
    for (size_t c = 0; c + 1 < sizeof cuts / sizeof *cuts; c++)
        ops->swiglu(pieces + cuts[c], up + cuts[c], (size_t)(cuts[c + 1] - cuts[c]));
    if (memcmp(whole, pieces, sizeof whole) != 0)
        fail_msg("%s swiglu: results depend on how the range is cut", set);
}

static void check_geglu(const struct kvr_attn_ops *ops, const char *set)
{
    for (uint32_t b = 0; b < 65536; b++) {
        float h = kvr_f16_to_f32((uint16_t)b);
        if (!(fabsf(h) < 10.0f))
            continue;
        float y = kvr_gelu_half(h);
        if (kvr_f16_to_f32(kvr_f32_to_f16(y)) != y)
            fail_msg("gelu_half(%.9g) = %.9g is not a half", h, y);
        double x = h,
               exact = 0.5 * x * (1.0 + tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)));
        /* within one half-ulp of the nearest half, plus the f32 formula's cancellation in
         * 1 + tanh near -1 (a few ulp of 1, times h / 2) */
        uint16_t want = kvr_f32_to_f16((float)exact);
        double ulp = fabs(kvr_f16_to_f32((uint16_t)((want & 0x7fff) + 1)) -
                          kvr_f16_to_f32((uint16_t)(want & 0x7fff)));
        if (fabs(y - exact) > ulp + fabs(x) * 0x1p-21)
            fail_msg("gelu_half(%.9g) = %.9g, the nearest half is %.9g", h, y,
                     kvr_f16_to_f32(want));
        /* inputs that round to this half give its result */
        float up = nextafterf(h, INFINITY);
        if (kvr_f32_to_f16(up) == b && kvr_gelu_half(up) != y)
            fail_msg("gelu_half(%.9g) differs from gelu_half(%.9g)", up, h);
    }
    if (kvr_gelu_half(10.3f) != 10.3f || kvr_gelu_half(-10.5f) != 0.0f ||
        kvr_gelu_half(1e6f) != 1e6f)
        fail_msg("gelu_half: the saturated ends");
    enum { N = 203 };
    float gate[N], up[N], a[N], want[N];
    for (int i = 0; i < N; i++) {
        gate[i] = frand() * 12.0f;
        up[i] = frand();
        want[i] = kvr_gelu_half(gate[i]) * up[i];
    }
    memcpy(a, gate, sizeof a);
    ops->geglu(a, up, N);
    if (memcmp(a, want, sizeof a) != 0)
        fail_msg("%s geglu differs from gelu_half(gate) * up", set);
}

static void test_plain(void **state)
{
    (void)state;
    check_scores(&kvr_attn_ops_plain, "plain");
    check_mix(&kvr_attn_ops_plain, "plain");
    check_scores_f16(&kvr_attn_ops_plain, "plain");
    check_online(&kvr_attn_ops_plain, NULL, "plain");
    check_round_half(&kvr_attn_ops_plain, "plain");
    check_softmax(&kvr_attn_ops_plain, "plain");
    check_swiglu(&kvr_attn_ops_plain, "plain");
    check_geglu(&kvr_attn_ops_plain, "plain");
}

static void test_avx2(void **state)
{
    (void)state;
    kvr_kernels_init();
    if (!kvr_kernels_avx2_ok()) {
        printf("test_attn: this CPU has no AVX2: the AVX2 set is not checked\n");
        skip();
    }
    check_scores(&kvr_attn_ops_avx2, "avx2");
    check_mix(&kvr_attn_ops_avx2, "avx2");
    check_scores_f16(&kvr_attn_ops_avx2, "avx2");
    check_online(&kvr_attn_ops_avx2, &kvr_attn_ops_plain, "avx2");
    check_round_half(&kvr_attn_ops_avx2, "avx2");
    check_softmax(&kvr_attn_ops_avx2, "avx2");
    check_swiglu(&kvr_attn_ops_avx2, "avx2");
    check_geglu(&kvr_attn_ops_avx2, "avx2");
}

int main(void)
{
    kvr_test_model_options();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain),
        cmocka_unit_test(test_avx2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
