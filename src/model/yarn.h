/* yarn.h - YaRN ("Yet another RoPE extensioN") rope scaling, as llama.cpp applies it, for
 * every architecture whose file says rope.scaling.type "yarn" (gpt-oss through the engine,
 * deepseek2 through mla.c).
 *
 * Pair i's angle at position p is interpolated, p * theta_i / factor, for the slow pairs and
 * kept, p * theta_i, for the fast ones, with a linear ramp between the pairs whose wavelength
 * fits beta_fast and beta_slow times into the original context; cos and sin are then
 * multiplied by mscale = attn_factor * (1 + 0.1 ln(factor)). Keys `ARCH.rope.scaling.*`:
 * type "yarn", factor, original_context_length (default: context_length), yarn_beta_fast
 * (32), yarn_beta_slow (1), yarn_log_multiplier (0; deepseek2's attention-scale correction).
 *
 * Pure functions of their arguments, no globals: callable from any thread. */
#ifndef KVR_MODEL_YARN_H
#define KVR_MODEL_YARN_H

#include "core/err.h"
#include "model/gguf.h"

#include <stdint.h>

struct kvr_yarn {
    float factor;        /* rope.scaling.factor; 0: no YaRN */
    uint32_t n_ctx_orig; /* rope.scaling.original_context_length */
    float beta_fast, beta_slow;
    float attn_factor; /* 1; mla.c sets the inverse of the magnitude correction */
    float log_mul;     /* rope.scaling.yarn_log_multiplier (0 when absent) */
};

/* Read the YaRN keys of `arch` with the already read factor; bad values are KVR_EFORMAT. */
int kvr_yarn_read(struct kvr_yarn *y, const struct kvr_gguf *g, const char *arch, float factor,
                  uint32_t n_ctx_train, struct kvr_err *err);

/* cos_t, sin_t [n_rot / 2] of position pos with RoPE base `base` under YaRN y. */
void kvr_yarn_tables(float *cos_t, float *sin_t, uint32_t n_rot, uint32_t pos, float base,
                     const struct kvr_yarn *y);

#endif
