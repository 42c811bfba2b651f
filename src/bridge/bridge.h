/* bridge.h - the bridge: the shell that runs the scheduler (sched.h) against the ring's
 * two links and hands its streams to consumers (DESIGN.md 6).
 *
 * The bridge dials stage 0 (the head) and listens on the plan's bridge address for the
 * tail. Its ring thread feeds the scheduler every input (results, RESETs, links going up
 * or down, time) and sends the batches it builds while the head has credits; every
 * decision (admission, KV, batch building, recovery) is the scheduler's, and is described
 * in sched.h. Consumers submit requests and pull one event per token from their stream.
 * A ring broken for longer than the configured grace period is re-planned over the stages
 * that still answer (replan_after_ms below): the bridge's plan is then the new one.
 *
 * Its streams are the HTTP layer's (service.h): struct kvr_gen_stream, with next, cancel
 * and release as service.h's ops describe them, so service_ring.c hands them over as they
 * are.
 *
 * Threads: every public function is thread-safe (one mutex guards the scheduler and the
 * streams). A stream is used by one consumer thread (next/cancel/release) while the ring
 * thread produces into it. */
#ifndef KVR_BRIDGE_BRIDGE_H
#define KVR_BRIDGE_BRIDGE_H

#include "bridge/request.h"
#include "bridge/sched.h"
#include "core/err.h"
#include "model/gguf.h"
#include "ring/plan.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_bridge;
struct kvr_gen_stream; /* a request's stream (service.h), owned by the bridge */

struct kvr_bridge_config {
    const struct kvr_plan *plan; /* copied */
    uint32_t n_embd;             /* the model's width, vocabulary, and end-of-generation */
    uint32_t n_vocab;
    uint32_t max_waiting;    /* bounded wait queue; 0 = 4 * max_seqs */
    bool admission;          /* refuse requests that would miss their budget */
    bool no_prefix_cache;    /* compute every prompt whole (sched.h prefix_cache) */
    enum kvr_spec_mode spec; /* speculation (sched.h; KVR_SPEC_OFF unless the caller asks) */
    /* Re-planning (DESIGN.md 8, docs/PLAN.md "Re-planning"): once the ring has been up, a
     * ring broken for replan_after_ms makes the bridge probe every stage over a control
     * link and, if some do not answer, re-plan the ring over those that do (each loads its
     * new layers from its own copy of the model), then recover the held sequences as after
     * any failure. 0 = never. Needs `gguf` (the model file, borrowed: the layer costs). */
    uint32_t replan_after_ms;
    const struct kvr_gguf *gguf;
};

int kvr_bridge_create(struct kvr_bridge **out, const struct kvr_bridge_config *cfg,
                      struct kvr_err *err);
/* Stops the ring thread: no more batches, no reconnecting, but the links stay open, so a
 * ring being shut down stage by stage sees no lost link. Idempotent. */
void kvr_bridge_stop(struct kvr_bridge *b);
/* Stops the ring thread, closes the links, fails open streams. Streams must be released
 * before or after; a stream outlives the bridge only for kvr_bridge_release. */
void kvr_bridge_destroy(struct kvr_bridge *b);

/* Whether both links are authenticated and the ring is taking batches. */
bool kvr_bridge_ring_up(const struct kvr_bridge *b);
/* Wait until the ring is up or the timeout passes. */
bool kvr_bridge_wait_up(struct kvr_bridge *b, int timeout_ms);

/* Each stage as the bridge sees it (GET /health): the head and the tail through its own
 * links, the others through the ring (up once a batch has gone round; down when one sent a
 * RESET; unknown while the ring is broken for a reason it cannot pin on one of them). */
enum kvr_stage_state {
    KVR_STAGE_UNKNOWN,
    KVR_STAGE_CONNECTING, /* never connected yet (the head: being dialled; the tail: the
                             bridge waits for it to dial in) */
    KVR_STAGE_CONNECTED,  /* its link to the bridge is up; the ring is not whole yet */
    KVR_STAGE_UP,         /* the ring is whole */
    KVR_STAGE_DOWN,       /* lost (its link dropped, or it dropped its sequences) */
    KVR_STAGE_STATE_COUNT
};

struct kvr_bridge_stage_state {
    char addr[KVR_PLAN_ADDR_BYTES]; /* where the stage listens (the current plan's) */
    uint32_t first_layer, last_layer;
    enum kvr_stage_state state;
    uint64_t since_ns;    /* kvr_now_ns() when it entered this state */
    char last_error[160]; /* the last failure seen for it, "" if none */
};

const char *kvr_stage_state_name(enum kvr_stage_state state);
/* out[0 .. n) for the n stages of the current plan (a re-plan changes it); returns n. */
uint32_t kvr_bridge_stage_states(struct kvr_bridge *b, struct kvr_bridge_stage_state *out);

/* Admit a request (0, *stream set) or refuse it (a negative status, *why filled: KVR_EAGAIN
 * for the scheduler's refusals). */
int kvr_bridge_submit(struct kvr_bridge *b, const struct kvr_gen_request *req,
                      struct kvr_gen_stream **stream, struct kvr_refusal *why);
/* Next event of a stream: 0 with *ev filled, or KVR_ETIMEDOUT (at once if timeout_ms is
 * 0), or KVR_ECLOSED once the event carrying a finish was returned, or once the scheduler
 * has ended a cancelled stream (no event for that). A stream that fails ends with an ERROR
 * event of its own (token -1, error_status 503, `error` says why). */
int kvr_bridge_next(struct kvr_gen_stream *s, struct kvr_gen_event *ev, uint32_t timeout_ms);
/* For a caller that follows many streams from one thread: wait until any stream has had an
 * event since *seen (a count the call keeps; start it at 0), or the timeout passes, then
 * set *seen to the current count. Drain the streams with timeout 0 after each return. */
void kvr_bridge_wait_any(struct kvr_bridge *b, uint64_t *seen, int timeout_ms);
/* Stop generating (the client went away or a stop string was hit): the sequence is
 * cancelled in the whole ring and its KV freed. Idempotent. */
void kvr_bridge_cancel(struct kvr_gen_stream *s);
/* Free a stream (cancels it if still running). */
void kvr_bridge_release(struct kvr_gen_stream *s);

/* Telemetry (sched.h). */
void kvr_bridge_stats(struct kvr_bridge *b, struct kvr_sched_stats *out);
/* Forget the cached KV blocks no sequence uses (sched.h kvr_sched_flush_cache). */
uint32_t kvr_bridge_flush_cache(struct kvr_bridge *b);

/* The console (service.h estimate and telemetry). Admission's estimate of an admitted
 * stream, in ms from submit (sched.h struct kvr_estimate): its first token, and its last
 * if all max_tokens come; and the request's id. False when admission made none. */
bool kvr_bridge_estimate(struct kvr_gen_stream *s, double *first_ms, double *total_ms,
                         uint64_t *id);
/* The stream's speculation counters (service.h spec). */
void kvr_bridge_spec(struct kvr_gen_stream *s, uint32_t *drafted, uint32_t *accepted,
                     uint32_t *steps);
/* GET /v1/telemetry: fill `snap` for `reader` under the bridge's lock (telemetry.h
 * kvr_telemetry_take): the current plan, the scheduler's stats, each stage's state, and
 * what the reader has not seen yet. */
struct kvr_telemetry_reader;
struct kvr_telemetry_snapshot;
void kvr_bridge_telemetry(struct kvr_bridge *b, struct kvr_telemetry_reader *reader,
                          struct kvr_telemetry_snapshot *snap);

#endif
