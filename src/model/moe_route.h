/* moe_route.h - DeepSeek-V3-style expert routing (DESIGN.md 7): sigmoid gating, the
 * selection-only bias, expert groups, normalised and scaled weights, and the keys that
 * describe them. Used by deepseek2 and glm4moe (model/arch.h), through model/moe.c.
 *
 * For one token row with router logits l[0..n_expert):
 *
 *   1. probabilities  p[e] = sigmoid(l[e]) (KVR_MOE_GATING_SIGMOID), or the softmax over all
 *                     experts (KVR_MOE_GATING_SOFTMAX: DeepSeek V2).
 *   2. scores         s[e] = p[e] + b[e], b the layer's exp_probs_b.bias (0 without one).
 *                     The bias only chooses experts; weights below use the unbiased p.
 *   3. groups         with n_group > 1: experts e are in group e / (n_expert / n_group); a
 *                     group's score is the sum of its two best s; the n_group_used best
 *                     groups (ties: lower group first) stay, every other expert's s is -inf.
 *   4. top-k          the n_used best s (ties: lower expert id; NaN ranks as -inf).
 *   5. weights        w[k] = p[ids[k]]; norm_topk divides them by their sum (the sum at
 *                     least 2^-14, as llama.cpp clamps it); then times w_scale (if set).
 *
 * Keys (all under <arch>.): expert_gating_func (1 softmax, 2 sigmoid; absent or 0: the
 * architecture's default), expert_weights_norm (bool, default false), expert_weights_scale
 * (f32, > 0; absent: 1), expert_group_count / expert_group_used_count (absent: no groups),
 * expert_shared_count (the shared expert is that many experts wide: n_ff_exp x count, added
 * without a gate), leading_dense_block_count (the first layers' feed-forward is dense).
 *
 * Pure functions: no globals, no I/O; the same bits on any thread. */
#ifndef KVR_MODEL_MOE_ROUTE_H
#define KVR_MODEL_MOE_ROUTE_H

#include "core/err.h"
#include "model/gguf.h"
#include "model/moe.h"

#include <stdbool.h>
#include <stdint.h>

/* The k (<= n <= KVR_MOE_MAX_EXPERTS) best of v[0..n) into out, best first: higher first,
 * NaN as -inf, equal values by the lower index (k passes of a running best: k is small). */
void kvr_moe_top_k(const float *v, uint32_t n, uint32_t k, uint32_t *out);

/* Does this routing need kvr_moe_select_scored (sigmoid gating, a bias or groups)? */
bool kvr_moe_route_scored(const struct kvr_moe_hparams *mp, const float *probs_b);

/* Steps 1-5 above for one row: ids[0..n_used) best first, weights[s] the weight of ids[s].
 * probs_b: n_expert values or NULL. */
void kvr_moe_select_scored(const struct kvr_moe_hparams *mp, const float *logits,
                           const float *probs_b, uint32_t *ids, float *weights);

/* How an architecture's MoE layers carry exp_probs_b.bias. */
enum kvr_moe_bias {
    KVR_MOE_BIAS_NONE,     /* never */
    KVR_MOE_BIAS_OPTIONAL, /* when the file has it (deepseek2: V3 files do, V2 files not) */
    KVR_MOE_BIAS_REQUIRED, /* always (glm4moe) */
    KVR_MOE_BIAS_COUNT
};

/* Read the keys above into mp, which kvr_moe_hparams_read has filled (n_expert > 0) with
 * the architecture's default gating; n_layer: the layers that run. Every value is
 * bounds-checked with a message. */
int kvr_moe_hparams_read_v3(struct kvr_moe_hparams *mp, const struct kvr_gguf *g, const char *arch,
                            enum kvr_moe_bias bias, uint32_t n_layer, struct kvr_err *err);

#endif
