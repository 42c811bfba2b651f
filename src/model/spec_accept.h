/* spec_accept.h - the tail's accept rule for drafted tokens (issue 37: speculation without
 * a draft model).
 *
 * A decode segment flagged KVR_SEG_DRAFTS (engine.h) carries 1 + k rows: the sequence's
 * last token t0 and k drafted tokens d1..dk, at positions p..p+k. Row j's logits give the
 * distribution of the token after position p+j. kvr_spec_verify walks them in order:
 *
 *     for j = 0..k:  y = sample(row j); accept(y); emit y;
 *                    stop if j == k or y != d(j+1)
 *
 * so it emits the longest prefix of the drafts the target agrees with plus one token of its
 * own: 1..k+1 tokens.
 *
 * Why this is the speculative-sampling rule. A draft from a lookup is a point mass q = 1 at
 * d. Speculative sampling accepts d with probability min(1, p(d) / q(d)) = p(d) and else
 * samples the residual norm(max(0, p - q)) = p without d, renormalised. Sampling y from p
 * and accepting d iff y == d does exactly that: P(accept) = p(d), and given a rejection, y
 * is distributed as p without d, renormalised. The output distribution is p at every step
 * (tests/unit/test_spec_accept.c checks it with a chi-square test over many seeds).
 *
 * Why this coupling and not a separate accept draw: every emitted token is one call of
 * kvr_sampler_sample followed by kvr_sampler_accept, the calls a plain decode makes, so
 * each emitted token draws exactly one number (none when greedy), the sampler state after n
 * tokens is the same whatever was drafted, and a seed gives the same answer with
 * speculation on or off. A recovery's REPLAY (one draw per generated token) needs no
 * change. Greedy verification is exact: y is the argmax, as without drafts.
 *
 * Pure: no I/O, no globals, nothing allocated. One thread per sampler. */
#ifndef KVR_MODEL_SPEC_ACCEPT_H
#define KVR_MODEL_SPEC_ACCEPT_H

#include "model/sampler.h"

#include <stdint.h>

/* Most drafted tokens one segment carries (its rows are 1 + k). */
#define KVR_SPEC_MAX_DRAFT 16

/* Verify n_drafts drafted tokens against logits[(n_drafts + 1) x n_vocab]: logits row j is
 * the segment's row j, and drafts[j] the token of its row j + 1 (what row j should give). Writes
 * the emitted tokens to out[0..n) (capacity n_drafts + 1) and, if logprobs is non-NULL, each one's
 * log-probability as kvr_sampler_sample gives it. Returns n (1..n_drafts + 1), or KVR_EINVAL as
 * kvr_sampler_sample (a row with no finite logit; out holds the tokens emitted before it, which
 * were accepted into the sampler). */
int32_t kvr_spec_verify(struct kvr_sampler *s, const float *logits, int32_t n_vocab,
                        const int32_t *drafts, uint32_t n_drafts, struct kvr_sample_scratch *sc,
                        int32_t *out, float *logprobs);

#endif
