/* attn.c - the plain set of attention's inner loops (see attn.h), written with GCC vector
 * types so they are vectorised on any x86-64 (two SSE registers per vector). Each dot
 * reduces in one fixed order: the same result for a row whatever else is in the batch. */
#include "model/attn.h"

#include "model/dtype.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32), aligned(4)));

static float dot_plain(const float *a, const float *b, uint32_t n)
{
    v8f acc = {0};
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        acc += x * y;
    }
    float tail = 0.0f;
    for (; i < n; i++)
        tail += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

static void axpy_plain(float *y, float a, const float *x, uint32_t n)
{
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f vx, vy;
        memcpy(&vx, x + i, sizeof vx);
        memcpy(&vy, y + i, sizeof vy);
        vy += a * vx;
        memcpy(y + i, &vy, sizeof vy);
    }
    for (; i < n; i++)
        y[i] += a * x[i];
}

static void scores_plain(float *scores, size_t stride, const float *q, uint32_t group, uint32_t hd,
                         const float *k, size_t k_step, uint32_t n, float scale)
{
    for (uint32_t j = 0; j < n; j++)
        for (uint32_t g = 0; g < group; g++)
            scores[g * stride + j] = dot_plain(q + (size_t)g * hd, k + j * k_step, hd) * scale;
}

/* The keys converted one position at a time, then dotted as scores_plain dots them. */
static void scores_f16_plain(float *scores, size_t stride, const float *q, uint32_t group,
                             uint32_t hd, const uint16_t *k, size_t k_step, uint32_t n, float scale)
{
    float kf[4096]; /* head_dim <= 4096 (arch.c) */
    for (uint32_t j = 0; j < n; j++) {
        for (uint32_t i = 0; i < hd; i++)
            kf[i] = kvr_f16_to_f32(k[j * k_step + i]);
        for (uint32_t g = 0; g < group; g++)
            scores[g * stride + j] = dot_plain(q + (size_t)g * hd, kf, hd) * scale;
    }
}

static void mix_plain(float *out, const float *p, size_t stride, uint32_t group, uint32_t hd,
                      const float *v, size_t v_step, uint32_t n)
{
    for (uint32_t j = 0; j < n; j++)
        for (uint32_t g = 0; g < group; g++)
            axpy_plain(out + (size_t)g * hd, p[g * stride + j], v + j * v_step, hd);
}

void kvr_online_step(float *st, float p, float *rescale, float *weight)
{
    *rescale = 1.0f;
    *weight = 1.0f;
    if (p > st[0]) {
        *rescale = expf(st[0] - p);
        st[0] = p;
    } else {
        *weight = expf(p - st[0]);
    }
    st[1] = st[1] * *rescale + *weight;
}

void kvr_online_steps(float *st, const float *p, uint32_t m, float *ms, float *vs, bool *grew)
{
    for (uint32_t j = 0; j < m; j++) {
        grew[j] = p[j] > st[0];
        kvr_online_step(st, p[j], &ms[j], &vs[j]);
    }
}

static void mix_online_f16_plain(uint16_t *acc, float *st, const float *p, size_t stride,
                                 uint32_t group, uint32_t hd, const uint16_t *v, size_t v_step,
                                 uint32_t n)
{
    for (uint32_t g = 0; g < group; g++) {
        uint16_t *ag = acc + (size_t)g * hd;
        for (uint32_t j = 0; j < n; j++) {
            float ms, vs, pj = p[g * stride + j];
            bool grew = pj > st[2 * g];
            kvr_online_step(st + 2 * g, pj, &ms, &vs);
            const uint16_t *vj = v + j * v_step;
            for (uint32_t i = 0; i < hd; i++) {
                float a = kvr_f16_to_f32(ag[i]);
                if (grew)
                    a = kvr_f16_to_f32(kvr_f32_to_f16(a * ms));
                ag[i] = kvr_f32_to_f16(fmaf(kvr_f16_to_f32(vj[i]), vs, a));
            }
        }
    }
}

static void round_half_plain(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = kvr_f16_to_f32(kvr_f32_to_f16(x[i]));
}

static void softmax_plain(float *x, uint32_t n)
{
    float max = -INFINITY;
    for (uint32_t t = 0; t < n; t++)
        max = x[t] > max ? x[t] : max;
    double sum = 0.0;
    for (uint32_t t = 0; t < n; t++) {
        x[t] = expf(x[t] - max);
        sum += x[t];
    }
    float inv = (float)(1.0 / sum);
    for (uint32_t t = 0; t < n; t++)
        x[t] *= inv;
}

static void swiglu_plain(float *gate, const float *up, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

float kvr_gelu_half(float g)
{
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    if (g <= -10.0f)
        return 0.0f;
    if (g >= 10.0f)
        return g;
    float h = kvr_f16_to_f32(kvr_f32_to_f16(g));
    float y = 0.5f * h * (1.0f + tanhf(c * h * (1.0f + 0.044715f * h * h)));
    return kvr_f16_to_f32(kvr_f32_to_f16(y));
}

void kvr_geglu_plain(float *gate, const float *up, size_t n)
{
    for (size_t i = 0; i < n; i++)
        gate[i] = kvr_gelu_half(gate[i]) * up[i];
}

const struct kvr_attn_ops kvr_attn_ops_plain = {.scores = scores_plain,
                                                .mix = mix_plain,
                                                .scores_f16 = scores_f16_plain,
                                                .mix_online_f16 = mix_online_f16_plain,
                                                .round_half = round_half_plain,
                                                .softmax = softmax_plain,
                                                .swiglu = swiglu_plain,
                                                .geglu = kvr_geglu_plain};
