/* pacing.h - the scheduler's chunking policy: how many prefill rows a batch may carry beside
 * the decoding streams (chunked prefill), from the cost model (costmodel.h).
 *
 * The rule. Prefill rows added to a batch with decode rows may stretch the streams' time
 * between tokens to ITL_SLOWDOWN (1.8) x their decode-only time. The factor grows with the
 * waiting share: the requests waiting for a first token over the streams decoding, averaged
 * over recent batches. It never exceeds what the streams' total budgets afford. A prompt
 * that would miss its first-token budget at that pace (an urgent prompt) may take up to
 * what the budgets afford. So a long prompt never stalls the streams, and a tight budget
 * keeps chunks thin.
 *
 * Pacing owns the cost model and what it learns beside it (the fields marked "Pacing's" in
 * sched_state.h): the mixed batches' error, the prefill rows recent batches carried and the
 * waiting share. sched.c's batch builder and admission.c call it. Pure: no I/O, no clock
 * (time comes in as `now`), one thread at a time (the scheduler's caller). */
#ifndef KVR_BRIDGE_PACING_H
#define KVR_BRIDGE_PACING_H

#include "bridge/costmodel.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_sched;

/* The time between tokens of one sequence when n sequences decode at mean context ctx,
 * every batch also carrying the prefill rows recent batches with decodes carried, ms. */
double kvr_pacing_period_ms(const struct kvr_sched *s, double n, double ctx);

/* The time between tokens of a decoding stream if every batch in the window had shape b,
 * with the stages' times multiplied by f, ms. */
double kvr_pacing_window_ms(const struct kvr_sched *s, struct kvr_cost_shape b, double f);

/* The most prefill rows (at most max_n, from position pos0) a batch of shape cur may take
 * while the streams' time between tokens stays within limit_ms; at least one row. A
 * limit_ms <= 0 means no limit. */
uint32_t kvr_pacing_prefill_fit(const struct kvr_sched *s, struct kvr_cost_shape cur, double pos0,
                                uint32_t max_n, double limit_ms);

/* The time between tokens the streams of a batch carrying `decode` may have once prefill
 * is added (the rule above), ms; 0 (no limit) without decode rows or before the cost model
 * is ready. urgent_too: treat a request not yet admitted as urgent (admission asks). */
double kvr_pacing_chunk_limit_ms(const struct kvr_sched *s, struct kvr_cost_shape decode,
                                 bool urgent_too, uint64_t now);

/* The same rule with a waiting share given instead of the recent one: admission asks for
 * the pace of a queue it models, whose share is its own. */
double kvr_pacing_limit_at_share_ms(const struct kvr_sched *s, struct kvr_cost_shape decode,
                                    double share, uint64_t now);

/* The limit for the batch being built: records the waiting share of this batch when
 * streams decode (n_decoding > 0), then kvr_pacing_chunk_limit_ms. */
double kvr_pacing_batch_limit_ms(struct kvr_sched *s, struct kvr_cost_shape decode,
                                 uint32_t n_decoding, uint64_t now);

/* A batch with decode rows was built: it carried prefill_rows rows (prefill_pairs pairs)
 * beside them. Kept as a moving average for kvr_pacing_period_ms. */
void kvr_pacing_note_mix(struct kvr_sched *s, double prefill_rows, double prefill_pairs);

/* A batch came back: learn its cost. worst_ms is its slowest stage's held time, held_ms
 * every stage's, round_trip_ms the whole trip; `mixed` batches also calibrate chunking. */
void kvr_pacing_observe(struct kvr_sched *s, struct kvr_cost_shape shape, bool mixed,
                        const double *held_ms, double worst_ms, double round_trip_ms);

#endif
