/* yarn.c - YaRN rope scaling's keys and tables (see yarn.h). */
#include "model/yarn.h"

#include <math.h>
#include <stdio.h>

/* An optional f32 key ARCH.rope.scaling.NAME: absent leaves *out as it is. */
static int get_opt_f32(const struct kvr_gguf *g, const char *arch, const char *name, float *out,
                       struct kvr_err *err)
{
    char k[96];
    snprintf(k, sizeof k, "%s.rope.scaling.%s", arch, name);
    int rc = kvr_gguf_get_f32(g, k, out, err);
    return rc == KVR_ENOTFOUND ? KVR_OK : rc;
}

int kvr_yarn_read(struct kvr_yarn *y, const struct kvr_gguf *g, const char *arch, float factor,
                  uint32_t n_ctx_train, struct kvr_err *err)
{
    char k[96];
    *y = (struct kvr_yarn){factor, n_ctx_train, 32.0f, 1.0f, 1.0f, 0.0f};
    snprintf(k, sizeof k, "%s.rope.scaling.original_context_length", arch);
    int rc = kvr_gguf_get_u32(g, k, &y->n_ctx_orig, err);
    if (rc && rc != KVR_ENOTFOUND)
        return rc;
    if ((rc = get_opt_f32(g, arch, "yarn_beta_fast", &y->beta_fast, err)) ||
        (rc = get_opt_f32(g, arch, "yarn_beta_slow", &y->beta_slow, err)) ||
        (rc = get_opt_f32(g, arch, "yarn_log_multiplier", &y->log_mul, err)))
        return rc;
    if (!(factor >= 1.0f) || factor > 1024.0f || y->n_ctx_orig == 0 || !(y->beta_fast > 0.0f) ||
        !(y->beta_slow > 0.0f) || y->beta_slow > y->beta_fast || !(y->log_mul >= 0.0f) ||
        y->log_mul > 10.0f)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: bad YaRN scaling (factor %g, original context %u, betas "
                           "%g/%g, log multiplier %g)",
                           (double)factor, y->n_ctx_orig, (double)y->beta_fast,
                           (double)y->beta_slow, (double)y->log_mul);
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
