/* logprobs.h - what an API reports as a token's log-probability and its alternatives.
 *
 * The distribution is the model's own: log_softmax of the raw logits row at temperature 1,
 * before the sampler's logit bias, penalties, truncation and temperature (sampler.h). That
 * is what llama.cpp's server (n_probs) and vLLM (its default raw logprobs) report, and
 * what `kvasir run --force-ids` prints the logits of, so a reported value can be checked
 * against them: logprob(t) = l[t] - (max + ln(sum_i exp(l[i] - max))), summed in double in
 * id order. A ring's tail and the single-process loop both call these on the row
 * the sampler drew from, so both report the same bits.
 *
 * The alternatives are the n_top most likely tokens, most likely first, ties by lower id;
 * the sampled token is among them only when it is that likely.
 *
 * Pure: no I/O, no globals, nothing allocated; any thread. */
#ifndef KVR_MODEL_LOGPROBS_H
#define KVR_MODEL_LOGPROBS_H

#include <stdint.h>

/* The most alternatives a token may carry (OpenAI's top_logprobs bound). */
#define KVR_LOGPROBS_MAX_TOP 20

struct kvr_token_logprob {
    int32_t id;
    float logprob; /* <= 0; -inf when exp underflows */
};

/* The n_top (<= KVR_LOGPROBS_MAX_TOP) most likely tokens of logits[0..n_vocab) into
 * top[0..n_top), and the row's log-sum-exp into *lse (what kvr_logprobs_token needs).
 * Returns n_top (fewer when the row has fewer finite logits), or KVR_EINVAL for
 * n_vocab < 1, n_top above the bound, or a row without a finite logit. Call it before
 * anything masks the row in place (a grammar): the report is of the model's row. */
int kvr_logprobs_top(const float *logits, int32_t n_vocab, uint32_t n_top,
                     struct kvr_token_logprob *top, double *lse);

/* The logprob of `token` (< the row's n_vocab) given the row's log-sum-exp. */
float kvr_logprobs_token(const float *logits, int32_t token, double lse);

#endif
