/* spec_accept.c - the accept rule for drafted tokens (see spec_accept.h). */
#include "model/spec_accept.h"

#include <stddef.h>

int32_t kvr_spec_verify(struct kvr_sampler *s, const float *logits, int32_t n_vocab,
                        const int32_t *drafts, uint32_t n_drafts, struct kvr_sample_scratch *sc,
                        int32_t *out, float *logprobs)
{
    for (uint32_t j = 0; j <= n_drafts; j++) {
        const float *row = logits + (size_t)j * (size_t)n_vocab;
        int32_t y = kvr_sampler_sample(s, row, n_vocab, sc, logprobs ? &logprobs[j] : NULL);
        if (y < 0)
            return y;
        kvr_sampler_accept(s, y);
        out[j] = y;
        if (j == n_drafts || y != drafts[j])
            return (int32_t)j + 1;
    }
    return (int32_t)n_drafts + 1; /* not reached: j == n_drafts returns */
}
