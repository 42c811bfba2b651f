/* gptoss.c - YaRN, the attention sink's softmax and the clamped SwiGLU (see gptoss.h). */
#include "model/gptoss.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

int kvr_yarn_read(struct kvr_yarn *y, const struct kvr_gguf *g, const char *arch, float factor,
                  uint32_t n_ctx_train, struct kvr_err *err)
{
    char k[96];
    *y = (struct kvr_yarn){factor, n_ctx_train, 32.0f, 1.0f, 1.0f};
    snprintf(k, sizeof k, "%s.rope.scaling.original_context_length", arch);
    int rc = kvr_gguf_get_u32(g, k, &y->n_ctx_orig, err);
    if (rc && rc != KVR_ENOTFOUND)
        return rc;
    static const char *const betas[2] = {"yarn_beta_fast", "yarn_beta_slow"};
    float *dst[2] = {&y->beta_fast, &y->beta_slow};
    for (int i = 0; i < 2; i++) {
        snprintf(k, sizeof k, "%s.rope.scaling.%s", arch, betas[i]);
        rc = kvr_gguf_get_f32(g, k, dst[i], err);
        if (rc && rc != KVR_ENOTFOUND)
            return rc;
    }
    if (!(factor >= 1.0f) || factor > 1024.0f || y->n_ctx_orig == 0 || !(y->beta_fast > 0.0f) ||
        !(y->beta_slow > 0.0f) || y->beta_slow > y->beta_fast)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: bad YaRN scaling (factor %g, original context %u, betas %g/%g)",
                           (double)factor, y->n_ctx_orig, (double)y->beta_fast,
                           (double)y->beta_slow);
    return KVR_OK;
}

/* The pair index at which the angle makes n_turns turns over the original context. */
static float corr_dim(uint32_t n_rot, uint32_t n_ctx_orig, float n_turns, float base)
{
    return (float)n_rot * logf((float)n_ctx_orig / (n_turns * 2.0f * (float)M_PI)) /
           (2.0f * logf(base));
}

void kvr_yarn_tables(float *cos_t, float *sin_t, uint32_t n_rot, uint32_t pos, float base,
                     const struct kvr_yarn *y)
{
    float lo = floorf(corr_dim(n_rot, y->n_ctx_orig, y->beta_fast, base));
    float hi = ceilf(corr_dim(n_rot, y->n_ctx_orig, y->beta_slow, base));
    lo = lo > 0.0f ? lo : 0.0f;
    hi = hi < (float)(n_rot - 1) ? hi : (float)(n_rot - 1);
    const float freq_scale = 1.0f / y->factor;
    const float mscale = y->attn_factor * (1.0f + 0.1f * logf(1.0f / freq_scale));
    const float theta_scale = powf(base, -2.0f / (float)n_rot);
    float theta = (float)pos;
    for (uint32_t i = 0; i < n_rot / 2; i++) {
        float interp = freq_scale * theta;
        float ramp = ((float)i - lo) / fmaxf(0.001f, hi - lo);
        float mix = 1.0f - fminf(1.0f, fmaxf(0.0f, ramp)); /* 1: keep, 0: interpolate */
        float t = interp * (1.0f - mix) + theta * mix;
        cos_t[i] = cosf(t) * mscale;
        sin_t[i] = sinf(t) * mscale;
        theta *= theta_scale;
    }
}

void kvr_softmax_sink(float *scores, uint32_t n, float sink)
{
    float m = sink;
    for (uint32_t i = 0; i < n; i++)
        m = scores[i] > m ? scores[i] : m;
    double sum = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        scores[i] = expf(scores[i] - m);
        sum += scores[i];
    }
    sum += expf(sink - m);
    float inv = (float)(1.0 / sum);
    for (uint32_t i = 0; i < n; i++)
        scores[i] *= inv;
}

void kvr_swiglu_oai(float *gate, const float *up, size_t n)
{
    const float alpha = 1.702f, limit = 7.0f;
    for (size_t i = 0; i < n; i++) {
        float g = gate[i] < limit ? gate[i] : limit;
        float u = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
        gate[i] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
}
