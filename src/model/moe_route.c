/* moe_route.c - DeepSeek-V3-style routing and its keys (see moe_route.h). */
#include "model/moe_route.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* llama.cpp's floor on the sum that normalises the weights: f16's smallest normal. */
#define NORM_SUM_MIN 6.103515625e-5f

bool kvr_moe_route_scored(const struct kvr_moe_hparams *mp, const float *probs_b)
{
    return mp->gating == KVR_MOE_GATING_SIGMOID || probs_b || mp->n_group > 1;
}

/* Does score a (of expert or group a) rank before score b? NaN ranks as -inf; equal
 * scores by the lower index. */
static bool before(float a, uint32_t ia, float b, uint32_t ib)
{
    if (isnan(a))
        a = -INFINITY;
    if (isnan(b))
        b = -INFINITY;
    return a > b || (a == b && ia < ib);
}

void kvr_moe_top_k(const float *v, uint32_t n, uint32_t k, uint32_t *out)
{
    uint64_t taken[KVR_MOE_MAX_EXPERTS / 64] = {0};
    for (uint32_t s = 0; s < k; s++) {
        uint32_t best = UINT32_MAX;
        for (uint32_t e = 0; e < n; e++) {
            if (taken[e / 64] >> (e % 64) & 1)
                continue;
            if (best == UINT32_MAX || before(v[e], e, v[best], best))
                best = e;
        }
        if (best == UINT32_MAX) /* k > n, which the loader refuses */
            return;
        taken[best / 64] |= 1ull << (best % 64);
        out[s] = best;
    }
}

/* Step 1: p[e] from the logits; a NaN logit gets probability 0. */
static void probabilities(const struct kvr_moe_hparams *mp, const float *logits, float *p)
{
    const uint32_t n = mp->n_expert;
    if (mp->gating == KVR_MOE_GATING_SIGMOID) {
        for (uint32_t e = 0; e < n; e++)
            p[e] = isnan(logits[e]) ? 0.0f : 1.0f / (1.0f + expf(-logits[e]));
        return;
    }
    float max = -INFINITY;
    for (uint32_t e = 0; e < n; e++)
        if (logits[e] > max)
            max = logits[e];
    if (!isfinite(max)) { /* no usable logit: spread the probability evenly */
        for (uint32_t e = 0; e < n; e++)
            p[e] = 1.0f / (float)n;
        return;
    }
    double sum = 0.0;
    for (uint32_t e = 0; e < n; e++) {
        p[e] = isnan(logits[e]) ? 0.0f : expf(logits[e] - max);
        sum += p[e];
    }
    float inv = (float)(1.0 / sum);
    for (uint32_t e = 0; e < n; e++)
        p[e] *= inv;
}

/* Step 3: every expert outside the n_group_used best groups gets score -inf. */
static void limit_groups(const struct kvr_moe_hparams *mp, float *s)
{
    const uint32_t per = mp->n_expert / mp->n_group;
    float gscore[KVR_MOE_MAX_EXPERTS / 2];
    uint32_t two[2], keep[KVR_MOE_MAX_EXPERTS / 2];
    for (uint32_t g = 0; g < mp->n_group; g++) {
        kvr_moe_top_k(s + (size_t)g * per, per, 2, two);
        gscore[g] = s[g * per + two[0]] + s[g * per + two[1]];
    }
    kvr_moe_top_k(gscore, mp->n_group, mp->n_group_used, keep);
    uint8_t kept[KVR_MOE_MAX_EXPERTS / 2] = {0};
    for (uint32_t i = 0; i < mp->n_group_used; i++)
        kept[keep[i]] = 1;
    for (uint32_t g = 0; g < mp->n_group; g++)
        if (!kept[g])
            for (uint32_t e = 0; e < per; e++)
                s[g * per + e] = -INFINITY;
}

void kvr_moe_select_scored(const struct kvr_moe_hparams *mp, const float *logits,
                           const float *probs_b, uint32_t *ids, float *weights)
{
    const uint32_t n = mp->n_expert, k = mp->n_used;
    float p[KVR_MOE_MAX_EXPERTS], s[KVR_MOE_MAX_EXPERTS];
    probabilities(mp, logits, p);
    for (uint32_t e = 0; e < n; e++)
        s[e] = isnan(logits[e]) ? -INFINITY : probs_b ? p[e] + probs_b[e] : p[e];
    if (mp->n_group > 1)
        limit_groups(mp, s);
    kvr_moe_top_k(s, n, k, ids);
    for (uint32_t i = 0; i < k; i++)
        weights[i] = p[ids[i]];
    if (mp->norm_topk) {
        double sum = 0.0;
        for (uint32_t i = 0; i < k; i++)
            sum += weights[i];
        float d = (float)sum < NORM_SUM_MIN ? NORM_SUM_MIN : (float)sum;
        for (uint32_t i = 0; i < k; i++)
            weights[i] /= d;
    }
    if (mp->w_scale != 0.0f && mp->w_scale != 1.0f)
        for (uint32_t i = 0; i < k; i++)
            weights[i] *= mp->w_scale;
}

/* ---- keys ------------------------------------------------------------------------------ */

static int key_u32(const struct kvr_gguf *g, const char *arch, const char *suffix, uint32_t *out,
                   struct kvr_err *err)
{
    char key[96];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = kvr_gguf_get_u32(g, key, out, err);
    return rc == KVR_ENOTFOUND ? KVR_OK : rc;
}

/* expert_gating_func, expert_weights_norm and expert_weights_scale. */
static int read_weighting(struct kvr_moe_hparams *mp, const struct kvr_gguf *g, const char *arch,
                          struct kvr_err *err)
{
    char key[96];
    uint32_t func = 0;
    int rc = key_u32(g, arch, "expert_gating_func", &func, err);
    if (rc)
        return rc;
    if (func == 1 || func == 2)
        mp->gating = func == 1 ? KVR_MOE_GATING_SOFTMAX : KVR_MOE_GATING_SIGMOID;
    else if (func != 0)
        return kvr_err_set(err, KVR_ENOTSUP,
                           "model: %s.expert_gating_func %u is not supported (1 softmax, "
                           "2 sigmoid)",
                           arch, func);
    snprintf(key, sizeof key, "%s.expert_weights_norm", arch);
    mp->norm_topk = false;
    rc = kvr_gguf_get_bool(g, key, &mp->norm_topk, err);
    if (rc && rc != KVR_ENOTFOUND)
        return rc;
    snprintf(key, sizeof key, "%s.expert_weights_scale", arch);
    mp->w_scale = 1.0f;
    rc = kvr_gguf_get_f32(g, key, &mp->w_scale, err);
    if (rc && rc != KVR_ENOTFOUND)
        return rc;
    if (!(mp->w_scale > 0.0f) || mp->w_scale > 1e4f)
        return kvr_err_set(err, KVR_EFORMAT, "model: %s.expert_weights_scale %g", arch,
                           (double)mp->w_scale);
    return KVR_OK;
}

int kvr_moe_hparams_read_v3(struct kvr_moe_hparams *mp, const struct kvr_gguf *g, const char *arch,
                            enum kvr_moe_bias bias, uint32_t n_layer, struct kvr_err *err)
{
    int rc;
    uint32_t n_shared = 0;
    if ((rc = read_weighting(mp, g, arch, err)) ||
        (rc = key_u32(g, arch, "expert_group_count", &mp->n_group, err)) ||
        (rc = key_u32(g, arch, "expert_group_used_count", &mp->n_group_used, err)) ||
        (rc = key_u32(g, arch, "expert_shared_count", &n_shared, err)) ||
        (rc = key_u32(g, arch, "leading_dense_block_count", &mp->n_dense_lead, err)))
        return rc;
    if (mp->n_group > 1) {
        uint32_t per = mp->n_expert / mp->n_group;
        if (mp->n_expert % mp->n_group || per < 2 || mp->n_group_used == 0 ||
            mp->n_group_used > mp->n_group || mp->n_used > mp->n_group_used * per)
            return kvr_err_set(err, KVR_EFORMAT,
                               "model: %s.expert_group_count %u / expert_group_used_count %u "
                               "do not fit %u experts, %u used (groups of 2 or more that "
                               "divide the experts and hold the used ones)",
                               arch, mp->n_group, mp->n_group_used, mp->n_expert, mp->n_used);
    } else {
        mp->n_group = mp->n_group_used = 0;
    }
    if (n_shared > 64 || (uint64_t)n_shared * mp->n_ff_exp > 262144)
        return kvr_err_set(err, KVR_EFORMAT, "model: %s.expert_shared_count %u is implausible",
                           arch, n_shared);
    mp->n_ff_shexp = n_shared * mp->n_ff_exp;
    mp->shared_plain = true;
    if (mp->n_dense_lead >= n_layer)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: %s.leading_dense_block_count %u leaves none of the %u "
                           "layers a mixture of experts",
                           arch, mp->n_dense_lead, n_layer);
    mp->probs_bias = bias != KVR_MOE_BIAS_NONE;
    mp->probs_bias_required = bias == KVR_MOE_BIAS_REQUIRED;
    return KVR_OK;
}
