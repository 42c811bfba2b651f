/* spec_policy.h - the scheduler's speculation room (issue 37): which decode rows carry
 * drafted tokens, how many, and what their results teach.
 *
 * The rule, per batch and per decoding sequence, as the batch builder adds its decode row:
 *   - nothing when speculation is off, when the ring is saturated (a request waits for a
 *     slot, a prompt is still being prefilled, or a stage was held at least SATURATED_UTIL
 *     or starved less than STARVED_MIN of the last window: every extra row then costs
 *     every stream), or when the batch has no spare rows or control records left;
 *   - else the first source of draft.h that proposes tokens (prediction, prompt lookup,
 *     suffix) gives up to KVR_SPEC_MAX_DRAFT of them, and k of them go out: the k that
 *     maximises the batch's expected tokens per unit of time, sum over its decode rows of
 *     (1 + a + a^2 + ... + a^k) / the batch's time (cost model, costmodel.h: the trip round
 *     the ring for a lone sequence, the slowest stage's time when several share the
 *     pipeline), where a is this sequence's measured acceptance of that source (per
 *     drafted position, a decaying mean from a prior) and the time grows with the k rows
 *     added. A source the sequence keeps rejecting is left at k = 0.
 * Results: a segment with k drafts that returned n tokens accepted n - 1 of them; the
 * counters (struct kvr_sched_stats spec_*, the request's spec_* fields) and the acceptance
 * learn it. An answer that ends (EOS or length) joins the suffix source.
 *
 * KV: drafted rows write positions p+1..p+k on every stage. The next decode row of the
 * sequence starts at its first position not kept, which truncates every stage's cache there
 * (model/kv.h): rejected rows are overwritten before a row could attend to them, and the
 * prefix cache names only blocks of kept positions (sched.c prefix_publish).
 *
 * Owns struct kvr_spec (per-slot state and the suffix source). Pure; one thread at a time
 * (the scheduler's caller). Only sched.c calls it. */
#ifndef KVR_BRIDGE_SPEC_POLICY_H
#define KVR_BRIDGE_SPEC_POLICY_H

#include "core/err.h"
#include "ring/wire.h"

#include <stdint.h>

struct kvr_sched;
struct kvr_spec;
struct batch; /* sched_state.h */

int kvr_spec_create(struct kvr_spec **out, uint32_t max_seqs, struct kvr_err *err);
void kvr_spec_destroy(struct kvr_spec *sp);

/* The batch's last segment is `slot`'s decode row, just added; rows_after decode rows of
 * other sequences follow it. Extends it with drafted rows (and DRAFT records) when the
 * rule says so. Returns the rows added. */
uint32_t kvr_spec_add_drafts(struct kvr_sched *s, struct batch *bt, uint32_t slot,
                             uint32_t rows_after);

/* `sg` (a segment that wanted a token) came back with n_kept tokens, already taken. */
void kvr_spec_observe(struct kvr_sched *s, const struct kvr_seg *sg, uint32_t n_kept);

/* Why speculation is off for the next batch (or NULL): for the debug log and tests. */
const char *kvr_spec_saturated(const struct kvr_sched *s);

#endif
