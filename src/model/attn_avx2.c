/* attn_avx2.c - attention's dot and axpy with AVX2 + FMA (see attn.h). Compiled with
 * -mavx2 -mfma; called only after the CPU check of kvr_kernels_init. Each call reduces in
 * one fixed order (8 lanes, then a fixed tree, then the tail), whatever the batch. */
#include "model/attn.h"

#include <immintrin.h>

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
    for (; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

static void axpy_avx2(float *y, float a, const float *x, uint32_t n)
{
    __m256 va = _mm256_set1_ps(a);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i),
                                                _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * x[i];
}

const struct kvr_attn_ops kvr_attn_ops_avx2 = {.dot = dot_avx2, .axpy = axpy_avx2};
