/* gptoss.h - the pieces of gpt-oss's forward pass that no other architecture of arch.h has
 * (DESIGN.md 7): YaRN rope scaling, softmax with an attention sink, and the clamped SwiGLU.
 * The engine (engine.c) and the expert feed-forward (moe.c, moe_oai.c) call them from small
 * hooks, so each rule lives here once.
 *
 * Pure functions of their arguments, no I/O, no globals: callable from any thread. */
#ifndef KVR_MODEL_GPTOSS_H
#define KVR_MODEL_GPTOSS_H

#include "core/err.h"
#include "model/gguf.h"

#include <stddef.h>
#include <stdint.h>

/* YaRN ("Yet another RoPE extensioN"), as llama.cpp applies it: pair i's angle at position p
 * is interpolated, p * theta_i / factor, for the slow pairs and kept, p * theta_i, for the
 * fast ones, with a linear ramp between the pairs whose wavelength fits beta_fast and
 * beta_slow times into the original context; cos and sin are then multiplied by mscale =
 * attn_factor * (1 + 0.1 ln(factor)). Keys `ARCH.rope.scaling.*`: type "yarn", factor,
 * original_context_length (default: context_length), yarn_beta_fast (32), yarn_beta_slow
 * (1). */
struct kvr_yarn {
    float factor;        /* rope.scaling.factor; 0: no YaRN */
    uint32_t n_ctx_orig; /* rope.scaling.original_context_length */
    float beta_fast, beta_slow;
    float attn_factor; /* 1 */
};

/* Read the YaRN keys of `arch` with the already read factor. */
int kvr_yarn_read(struct kvr_yarn *y, const struct kvr_gguf *g, const char *arch, float factor,
                  uint32_t n_ctx_train, struct kvr_err *err);

/* cos_t, sin_t [n_rot / 2] of position pos with RoPE base `base` under YaRN y. */
void kvr_yarn_tables(float *cos_t, float *sin_t, uint32_t n_rot, uint32_t pos, float base,
                     const struct kvr_yarn *y);

/* Softmax of scores[0..n) in place with one more logit, `sink`, in the denominator only (an
 * attention sink: a slot with no value, so a head may attend to nothing): with m the max
 * of the scores and the sink, p_i = exp(s_i - m) / (sum_j exp(s_j - m) + exp(sink - m)). */
void kvr_softmax_sink(float *scores, uint32_t n, float sink);

/* gpt-oss's SwiGLU in place over n elements: g = min(gate, 7), u = clamp(up, -7, 7),
 * gate = g * sigmoid(1.702 g) * (u + 1). */
void kvr_swiglu_oai(float *gate, const float *up, size_t n);

#endif
