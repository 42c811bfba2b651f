/* logprobs.c - log_softmax of a logits row and its most likely tokens (see logprobs.h). */
#include "model/logprobs.h"

#include "core/err.h"

#include <math.h>
#include <stdbool.h>

/* a ranks before b: larger logit, then lower id (NaN never ranks). */
static bool before(float la, int32_t a, float lb, int32_t b)
{
    return la > lb || (la == lb && a < b);
}

/* Insert (id, l) into the sorted top[0..*n) of capacity k, if it ranks. */
static void offer(struct kvr_token_logprob *top, uint32_t *n, uint32_t k, int32_t id, float l)
{
    if (k == 0 || (*n == k && !before(l, id, top[k - 1].logprob, top[k - 1].id)))
        return;
    uint32_t at = *n < k ? (*n)++ : k - 1;
    while (at > 0 && before(l, id, top[at - 1].logprob, top[at - 1].id)) {
        top[at] = top[at - 1];
        at--;
    }
    top[at] = (struct kvr_token_logprob){id, l};
}

int kvr_logprobs_top(const float *logits, int32_t n_vocab, uint32_t n_top,
                     struct kvr_token_logprob *top, double *lse)
{
    if (n_vocab < 1 || n_top > KVR_LOGPROBS_MAX_TOP)
        return KVR_EINVAL;
    float max = -INFINITY;
    uint32_t n = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        float l = logits[i];
        if (l > max)
            max = l;
        if (n_top && isfinite(l))
            offer(top, &n, n_top, i, l); /* top holds raw logits until the end */
    }
    if (!isfinite(max))
        return KVR_EINVAL;
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; i++)
        if (isfinite(logits[i]))
            sum += exp((double)logits[i] - (double)max);
    if (!(sum >= 1.0)) /* the max's own term is exp(0) = 1 */
        return KVR_EINVAL;
    *lse = (double)max + log(sum);
    for (uint32_t j = 0; j < n; j++)
        top[j].logprob = (float)((double)top[j].logprob - *lse);
    return (int)n;
}

float kvr_logprobs_token(const float *logits, int32_t token, double lse)
{
    float l = logits[token];
    return isfinite(l) ? (float)((double)l - lse) : -INFINITY;
}
