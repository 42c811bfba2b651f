/* attn_avx2.c - attention's inner loops with AVX2 + FMA (see attn.h). Compiled with
 * -mavx2 -mfma; called only after the CPU check of kvr_kernels_init.
 *
 * A query-key dot accumulates 8 lanes over the head dimension, then reduces the lanes in
 * one fixed tree, ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), then adds the tail. When the head
 * dimension is a multiple of 8, eight positions are done together and their eight
 * accumulators are reduced by a transpose that performs exactly the same additions, so a
 * block gives what eight single dots give (tests/unit/test_attn.c). The weighted sum keeps
 * up to four vectors of the output in registers across the block's positions, with the same
 * fused multiply-add per element and position as one axpy at a time. */
#include "model/attn.h"

#include "model/dtype.h"

#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

static float dot_avx2(const float *a, const float *b, uint32_t n)
{
    __m256 acc = _mm256_setzero_ps();
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float sum = _mm_cvtss_f32(s);
    for (; i < n; i++) /* fused as written: a compiler left to contract may vectorise this
                        * loop as products then in-order sums, and give other bits */
        sum = fmaf(a[i], b[i], sum);
    return sum;
}

static void axpy_avx2(float *y, float a, const float *x, uint32_t n)
{
    __m256 va = _mm256_set1_ps(a);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] = fmaf(a, x[i], y[i]);
}

/* Lane sums of two accumulators: [a.lo + a.hi | b.lo + b.hi], the first step of the tree. */
static inline __m256 halves(__m256 a, __m256 b)
{
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Eight lanes of halves as floats (exact). */
static inline __m256 load_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
}

/* The lane accumulators of eight positions reduced each as dot_avx2 reduces, in order. */
static inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                             __m256 a6, __m256 a7)
{
    /* s_p[l] = a_p[l] + a_p[l+4]; two positions per register. */
    __m256 s01 = halves(a0, a1), s23 = halves(a2, a3), s45 = halves(a4, a5), s67 = halves(a6, a7);
    /* t_p = (s_p[0] + s_p[2], s_p[1] + s_p[3]). */
    __m256 t0123 = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 t4567 = _mm256_add_ps(_mm256_shuffle_ps(s45, s67, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(s45, s67, _MM_SHUFFLE(3, 2, 3, 2)));
    /* d_p = t_p[0] + t_p[1], in the order 0 2 4 6 | 1 3 5 7, then put back in order. */
    __m256 d = _mm256_add_ps(_mm256_shuffle_ps(t0123, t4567, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(t0123, t4567, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The dots of eight positions (hd a multiple of 8), each reduced as dot_avx2 reduces.
 * KEYS is float or uint16_t, LOAD the matching load_f32 or load_f16. */
#define DOT8(NAME, KEYS, LOAD)                                                                     \
    static inline __m256 NAME(const float *q, const KEYS *k, size_t k_step, uint32_t hd)           \
    {                                                                                              \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,     \
               a7 = a0;                                                                            \
        for (uint32_t i = 0; i < hd; i += 8) {                                                     \
            __m256 qv = _mm256_loadu_ps(q + i);                                                    \
            const KEYS *kp = k + i;                                                                \
            a0 = _mm256_fmadd_ps(qv, LOAD(kp), a0);                                                \
            a1 = _mm256_fmadd_ps(qv, LOAD(kp + k_step), a1);                                       \
            a2 = _mm256_fmadd_ps(qv, LOAD(kp + 2 * k_step), a2);                                   \
            a3 = _mm256_fmadd_ps(qv, LOAD(kp + 3 * k_step), a3);                                   \
            a4 = _mm256_fmadd_ps(qv, LOAD(kp + 4 * k_step), a4);                                   \
            a5 = _mm256_fmadd_ps(qv, LOAD(kp + 5 * k_step), a5);                                   \
            a6 = _mm256_fmadd_ps(qv, LOAD(kp + 6 * k_step), a6);                                   \
            a7 = _mm256_fmadd_ps(qv, LOAD(kp + 7 * k_step), a7);                                   \
        }                                                                                          \
        return reduce8(a0, a1, a2, a3, a4, a5, a6, a7);                                            \
    }
DOT8(dot8, float, _mm256_loadu_ps)
DOT8(dot8_f16, uint16_t, load_f16)

/* dot_avx2 over halves: the same lanes, tree and tail. */
static float dot_f16_avx2(const float *a, const uint16_t *b, uint32_t n)
{
    __m256 acc = _mm256_setzero_ps();
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_f16(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float sum = _mm_cvtss_f32(s);
    for (; i < n; i++)
        sum = fmaf(a[i], kvr_f16_to_f32(b[i]), sum);
    return sum;
}

static void scores_avx2(float *scores, size_t stride, const float *q, uint32_t group, uint32_t hd,
                        const float *k, size_t k_step, uint32_t n, float scale)
{
    uint32_t j = 0;
    if (hd % 8 == 0) {
        __m256 vs = _mm256_set1_ps(scale);
        for (; j + 8 <= n; j += 8)
            for (uint32_t g = 0; g < group; g++)
                _mm256_storeu_ps(
                    scores + g * stride + j,
                    _mm256_mul_ps(dot8(q + (size_t)g * hd, k + j * k_step, k_step, hd), vs));
    }
    for (; j < n; j++)
        for (uint32_t g = 0; g < group; g++)
            scores[g * stride + j] = dot_avx2(q + (size_t)g * hd, k + j * k_step, hd) * scale;
}

static void scores_f16_avx2(float *scores, size_t stride, const float *q, uint32_t group,
                            uint32_t hd, const uint16_t *k, size_t k_step, uint32_t n, float scale)
{
    uint32_t j = 0;
    if (hd % 8 == 0) {
        __m256 vs = _mm256_set1_ps(scale);
        for (; j + 8 <= n; j += 8)
            for (uint32_t g = 0; g < group; g++)
                _mm256_storeu_ps(
                    scores + g * stride + j,
                    _mm256_mul_ps(dot8_f16(q + (size_t)g * hd, k + j * k_step, k_step, hd), vs));
    }
    for (; j < n; j++)
        for (uint32_t g = 0; g < group; g++)
            scores[g * stride + j] = dot_f16_avx2(q + (size_t)g * hd, k + j * k_step, hd) * scale;
}

static void mix_avx2(float *out, const float *p, size_t stride, uint32_t group, uint32_t hd,
                     const float *v, size_t v_step, uint32_t n)
{
    if (hd % 8 != 0) {
        for (uint32_t j = 0; j < n; j++)
            for (uint32_t g = 0; g < group; g++)
                axpy_avx2(out + (size_t)g * hd, p[g * stride + j], v + j * v_step, hd);
        return;
    }
    for (uint32_t g = 0; g < group; g++) {
        float *o = out + (size_t)g * hd;
        const float *pg = p + g * stride;
        uint32_t i = 0;
        for (; i + 32 <= hd; i += 32) {
            __m256 y0 = _mm256_loadu_ps(o + i), y1 = _mm256_loadu_ps(o + i + 8),
                   y2 = _mm256_loadu_ps(o + i + 16), y3 = _mm256_loadu_ps(o + i + 24);
            for (uint32_t j = 0; j < n; j++) {
                __m256 w = _mm256_set1_ps(pg[j]);
                const float *x = v + j * v_step + i;
                y0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x), y0);
                y1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8), y1);
                y2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 16), y2);
                y3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 24), y3);
            }
            _mm256_storeu_ps(o + i, y0);
            _mm256_storeu_ps(o + i + 8, y1);
            _mm256_storeu_ps(o + i + 16, y2);
            _mm256_storeu_ps(o + i + 24, y3);
        }
        for (; i < hd; i += 8) {
            __m256 y = _mm256_loadu_ps(o + i);
            for (uint32_t j = 0; j < n; j++)
                y = _mm256_fmadd_ps(_mm256_set1_ps(pg[j]), _mm256_loadu_ps(v + j * v_step + i), y);
            _mm256_storeu_ps(o + i, y);
        }
    }
}

/* As the plain loop: F16C rounds to nearest even like kvr_f32_to_f16, the same fma.
 * The rounding mode is a macro: clang wants an integer constant expression there. */
#define KVR_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* x rounded to half and back, kept in a register: the accumulator's value as a float. */
static inline __m256 round_half8(__m256 x)
{
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, KVR_RNE));
}

static inline void store_f16(uint16_t *p, __m256 x)
{
    _mm_storeu_si128((__m128i *)(void *)p, _mm256_cvtps_ph(x, KVR_RNE));
}

/* Positions whose weights are computed ahead of the sums (the exps do not wait on them). */
#define ONLINE_CHUNK 64

/* The rescale ms[j] and weight vs[j] of positions j < m of one head, and whether its
 * maximum grew there: the kvr_online_step calls of the plain loop, in the same order. */
struct online_w {
    float ms[ONLINE_CHUNK], vs[ONLINE_CHUNK];
    bool grew[ONLINE_CHUNK];
};

/* The sums of nh heads (1 or 2) over m positions of v, whose accumulators are acc and
 * acc + hd: per position, where a head's maximum grew its accumulator is rescaled, then the
 * weighted value added, each rounded to half. Two heads share each value's load and give
 * the conversions' latency two independent chains per vector; a head's lanes see the same
 * operations either way. The loops over heads and vectors unroll fully, so the
 * accumulators stay in registers (without the pragmas GCC keeps them on the stack). */
static inline __attribute__((always_inline)) void online_sums(uint16_t *acc,
                                                              const struct online_w *w, uint32_t nh,
                                                              uint32_t hd, const uint16_t *v,
                                                              size_t v_step, uint32_t m)
{
    uint32_t i = 0;
    for (; i + 32 <= hd; i += 32) {
        __m256 a[2][4];
#pragma GCC unroll 2
        for (uint32_t h = 0; h < nh; h++)
#pragma GCC unroll 4
            for (uint32_t k = 0; k < 4; k++)
                a[h][k] = load_f16(acc + (size_t)h * hd + i + 8 * k);
        for (uint32_t j = 0; j < m; j++) {
#pragma GCC unroll 2
            for (uint32_t h = 0; h < nh; h++)
                if (w[h].grew[j]) { /* the maximum grew: rescale */
                    __m256 r = _mm256_set1_ps(w[h].ms[j]);
#pragma GCC unroll 4
                    for (uint32_t k = 0; k < 4; k++)
                        a[h][k] = round_half8(_mm256_mul_ps(a[h][k], r));
                }
            const uint16_t *x = v + j * v_step + i;
            __m256 wv[2];
#pragma GCC unroll 2
            for (uint32_t h = 0; h < nh; h++)
                wv[h] = _mm256_set1_ps(w[h].vs[j]);
#pragma GCC unroll 4
            for (uint32_t k = 0; k < 4; k++) {
                __m256 xk = load_f16(x + 8 * k);
#pragma GCC unroll 2
                for (uint32_t h = 0; h < nh; h++)
                    a[h][k] = round_half8(_mm256_fmadd_ps(xk, wv[h], a[h][k]));
            }
        }
#pragma GCC unroll 2
        for (uint32_t h = 0; h < nh; h++)
#pragma GCC unroll 4
            for (uint32_t k = 0; k < 4; k++)
                store_f16(acc + (size_t)h * hd + i + 8 * k, a[h][k]);
    }
    for (; i + 8 <= hd; i += 8) {
        __m256 a[2][1];
#pragma GCC unroll 2
        for (uint32_t h = 0; h < nh; h++)
            a[h][0] = load_f16(acc + (size_t)h * hd + i);
        for (uint32_t j = 0; j < m; j++) {
#pragma GCC unroll 2
            for (uint32_t h = 0; h < nh; h++)
                if (w[h].grew[j]) { /* the maximum grew: rescale */
                    __m256 r = _mm256_set1_ps(w[h].ms[j]);
#pragma GCC unroll 4
                    for (uint32_t k = 0; k < 1; k++)
                        a[h][k] = round_half8(_mm256_mul_ps(a[h][k], r));
                }
            __m256 x = load_f16(v + j * v_step + i);
#pragma GCC unroll 2
            for (uint32_t h = 0; h < nh; h++)
                a[h][0] = round_half8(_mm256_fmadd_ps(x, _mm256_set1_ps(w[h].vs[j]), a[h][0]));
        }
#pragma GCC unroll 2
        for (uint32_t h = 0; h < nh; h++)
            store_f16(acc + (size_t)h * hd + i, a[h][0]);
    }
    for (; i < hd; i++)
        for (uint32_t h = 0; h < nh; h++) {
            const struct online_w *wh = &w[h];
            float a = kvr_f16_to_f32(acc[(size_t)h * hd + i]);
            for (uint32_t j = 0; j < m; j++) {
                if (wh->grew[j])
                    a = kvr_f16_to_f32(kvr_f32_to_f16(a * wh->ms[j]));
                a = kvr_f16_to_f32(
                    kvr_f32_to_f16(fmaf(kvr_f16_to_f32(v[j * v_step + i]), wh->vs[j], a)));
            }
            acc[(size_t)h * hd + i] = kvr_f32_to_f16(a);
        }
}

/* Heads two at a time (the last alone when the group is odd), positions in chunks: first
 * the chunk's weights, then the sums with the accumulators held in registers as floats that
 * are exact halves (rounded after every step, as the plain loop's halves in memory are). */
static void mix_online_f16_avx2(uint16_t *acc, float *st, const float *p, size_t stride,
                                uint32_t group, uint32_t hd, const uint16_t *v, size_t v_step,
                                uint32_t n)
{
    struct online_w w[2];
    for (uint32_t g = 0; g < group; g += 2) {
        uint32_t nh = group - g < 2 ? 1 : 2;
        for (uint32_t j0 = 0; j0 < n; j0 += ONLINE_CHUNK) {
            uint32_t m = n - j0 < ONLINE_CHUNK ? n - j0 : ONLINE_CHUNK;
            for (uint32_t h = 0; h < nh; h++)
                kvr_online_steps(st + 2 * (g + h), p + (g + h) * stride + j0, m, w[h].ms, w[h].vs,
                                 w[h].grew);
            if (nh == 2)
                online_sums(acc + (size_t)g * hd, w, 2, hd, v + j0 * v_step, v_step, m);
            else
                online_sums(acc + (size_t)g * hd, w, 1, hd, v + j0 * v_step, v_step, m);
        }
    }
}

static void round_half_avx2(float *x, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, round_half8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++)
        x[i] = kvr_f16_to_f32(kvr_f32_to_f16(x[i]));
}

/* exp of 8 lanes: 2^n * e^r with n = round(x / ln 2) and r = x - n ln 2 (ln 2 in two parts,
 * so r is exact to a few ulp), e^r from its Taylor series to r^6 (|r| <= ln 2 / 2: the
 * first term left out is below 1.3e-7 of the result). x is clamped to [-87.3, 88] so 2^n
 * stays a normal float: below, the result is ~1e-38 instead of smaller; above, 1.65e38.
 * Lane by lane, so an element's result does not depend on its neighbours. */
static inline __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    e = _mm256_slli_epi32(e, 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static void softmax_avx2(float *x, uint32_t n)
{
    float max = -INFINITY;
    for (uint32_t t = 0; t < n; t++)
        max = x[t] > max ? x[t] : max;
    __m256 vmax = _mm256_set1_ps(max);
    uint32_t t = 0;
    for (; t + 8 <= n; t += 8)
        _mm256_storeu_ps(x + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), vmax)));
    if (t < n) { /* the tail through the same lanes */
        float buf[8] = {0};
        memcpy(buf, x + t, (n - t) * sizeof *buf);
        _mm256_storeu_ps(buf, exp8(_mm256_sub_ps(_mm256_loadu_ps(buf), vmax)));
        memcpy(x + t, buf, (n - t) * sizeof *buf);
    }
    double sum = 0.0;
    for (t = 0; t < n; t++)
        sum += x[t];
    float inv = (float)(1.0 / sum);
    for (t = 0; t < n; t++)
        x[t] *= inv;
}

static inline __m256 swiglu8(__m256 g, __m256 u)
{
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

static void swiglu_avx2(float *gate, const float *up, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(gate + i, swiglu8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (i < n) {
        float g[8] = {0}, u[8] = {0};
        memcpy(g, gate + i, (n - i) * sizeof *g);
        memcpy(u, up + i, (n - i) * sizeof *u);
        _mm256_storeu_ps(g, swiglu8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
        memcpy(gate + i, g, (n - i) * sizeof *g);
    }
}

const struct kvr_attn_ops kvr_attn_ops_avx2 = {.scores = scores_avx2,
                                               .mix = mix_avx2,
                                               .scores_f16 = scores_f16_avx2,
                                               .mix_online_f16 = mix_online_f16_avx2,
                                               .round_half = round_half_avx2,
                                               .softmax = softmax_avx2,
                                               .swiglu = swiglu_avx2,
                                               .geglu = kvr_geglu_plain};
