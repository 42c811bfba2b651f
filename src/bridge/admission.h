/* admission.h - the scheduler's admission: estimates of a new request's first and last
 * token, the refusal rules, and the learning of the estimates' error (DESIGN.md 6).
 *
 * The estimate. The first token comes after the prompt rows ahead of the request (its own
 * included) have gone through, in the prefill room pacing (pacing.h) leaves beside the
 * decoding streams. A request that must wait for a slot or KV is estimated by a model of
 * the queue instead: the slots free up as the running requests' tokens to go come at the
 * measured pace, the requests waiting before it take them in order, and the prompts go
 * through one lane in that order (not a worst case: a request that stops early only frees
 * its slot sooner). The last token comes
 * max_tokens - 1 gaps later: the streams' recent gaps, beside the cost model's period. The
 * raw estimates are corrected by the recent error of estimates like them, and kept in the
 * request's struct kvr_estimate (sched.h), which the outcome later checks.
 *
 * The refusal rules, in order: a prompt beyond the context (TOO_LONG), a ring that is down,
 * a request needing more KV blocks than the ring has, a full wait queue; then, once the
 * cost model is ready and cfg.admission is on, a first token or a whole answer that would
 * miss its budget, and a request that would make an on-time running request late.
 * Budgets are checked against a high quantile of the estimates' error: a late answer is
 * worse than a refused one. A refusal says whether a retry could help (struct kvr_refusal
 * never): a budget that the request alone on an idle ring would miss, a request beyond the
 * context or the ring's KV can never succeed, and gets no retry hint.
 *
 * Admission owns the fields marked "Admission's" in sched_state.h. sched.c calls it; one
 * thread at a time (the scheduler's caller). */
#ifndef KVR_BRIDGE_ADMISSION_H
#define KVR_BRIDGE_ADMISSION_H

#include "bridge/request.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_sched;
struct kvr_sched_req;

/* Estimate r (filling r->est and r->n_cached) and admit it (KVR_OK) or refuse it
 * (KVR_EAGAIN, *why filled, stats.refused counted). Changes nothing else. */
int kvr_admission_admit(struct kvr_sched *s, struct kvr_sched_req *r, uint64_t now,
                        struct kvr_refusal *why);

/* The running request r took its n_generated-th token now. A first token calibrates the
 * first-token estimates, a later one adds a gap; was_held (a ring failure held it since
 * its last token) says nothing about either. */
void kvr_admission_observe_token(struct kvr_sched *s, struct kvr_sched_req *r, bool was_held,
                                 uint64_t now);

/* How r's estimate compared with what happened: its first token (n_generated == 1) and,
 * at its last token (`last`), its whole answer. */
void kvr_admission_observe_estimate(struct kvr_sched *s, struct kvr_sched_req *r, bool last,
                                    uint64_t now);

#endif
