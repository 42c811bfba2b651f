/* gptoss.h - the pieces of gpt-oss's forward pass that no other architecture of arch.h has
 * (DESIGN.md 7): softmax with an attention sink and the clamped SwiGLU (its YaRN rope
 * scaling, shared with deepseek2, is model/yarn.h).
 * The engine (engine.c) and the expert feed-forward (moe.c, moe_oai.c) call them from small
 * hooks, so each rule lives here once.
 *
 * Pure functions of their arguments, no I/O, no globals: callable from any thread. */
#ifndef KVR_MODEL_GPTOSS_H
#define KVR_MODEL_GPTOSS_H

#include "model/yarn.h"

#include <stddef.h>
#include <stdint.h>

/* Softmax of scores[0..n) in place with one more logit, `sink`, in the denominator only (an
 * attention sink: a slot with no value, so a head may attend to nothing): with m the max
 * of the scores and the sink, p_i = exp(s_i - m) / (sum_j exp(s_j - m) + exp(sink - m)). */
void kvr_softmax_sink(float *scores, uint32_t n, float sink);

/* gpt-oss's SwiGLU in place over n elements: g = min(gate, 7), u = clamp(up, -7, 7),
 * gate = g * sigmoid(1.702 g) * (u + 1). */
void kvr_swiglu_oai(float *gate, const float *up, size_t n);

#endif
