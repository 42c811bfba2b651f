/* sched.h - the bridge's scheduler as a pure state machine (DESIGN.md 6 and 8).
 *
 * It does no I/O, takes no lock, starts no thread and reads no clock: time comes in as
 * `now` (ns on any monotonic clock). The shell (bridge.c) owns the sockets, feeds it events
 * and sends what it builds. So every decision can be driven, replayed and fuzzed with a
 * fake clock (tests/unit/test_sched.c, tests/fuzz/fuzz_sched.c). It only logs.
 *
 * Three rooms:
 *   sched.c      the request table (slots, the bounded wait queue, KV blocks and the prefix
 *                cache of kvpool.h), the window of batches in flight, the batch builder,
 *                result handling and recovery;
 *   admission.h  whether a request comes in: its estimates (struct kvr_estimate below) and
 *                the refusal rules;
 *   pacing.h     how many prefill rows a batch may carry beside the decoding streams
 *                (chunked prefill), with the cost model of costmodel.h.
 * Their shared state is in sched_state.h, which only those three files include.
 *
 * Inputs                                  Outputs
 *   kvr_sched_submit   a request            a refusal (at once), or later:
 *   kvr_sched_cancel   the consumer quits   stream events (the `event` callback): tokens,
 *   kvr_sched_result   a RESULT frame         then exactly one end, then a detach
 *   kvr_sched_reset    a RESET frame        kvr_sched_next_batch: the next BATCH to send
 *   kvr_sched_link_up / _down               kvr_sched_tick: when to call tick again
 *   kvr_sched_tick     time passes
 *
 * The window. Up to `microbatches` batches are in flight. The shell asks for the next one
 * (kvr_sched_next_batch) whenever the head has a credit, and sends it before it calls
 * anything else. A batch carries, in order:
 *   - control records: FREE or CANCEL for sequences that ended and have nothing in
 *     flight, OPEN (with MAP and BIAS) for new ones, REPLAY after a recovery;
 *   - one decode row per ready sequence, earliest deadline first, spread evenly over the
 *     window;
 *   - prefill chunks in the rest of the row width, as many rows as pacing allows.
 * A sequence's decode row is never in two batches in flight. Its non-final prefill chunks
 * may be, because stages keep order. A slot is reused only after its FREE has gone into a
 * batch, so every stage sees FREE before the slot's next OPEN.
 *
 * Ring state. The ring is up only once a batch has come back through every stage after
 * the links came up: kvr_sched_link_up sends a free-all probe first. The ring recovers on
 * a RESET, a dropped link, a result that does not match the oldest batch in flight, or a
 * batch that has not come back in time (tick). Recovery holds the running sequences. Once
 * a probe has gone round again, they are re-prefilled from prompt + generated tokens, and
 * REPLAY records restore the tail's sampler, so their streams only pause. A held request
 * ends with KVR_GEN_FINISH_ERROR when its total budget runs out or after 30 s.
 *
 * Requests and ownership. The caller allocates a struct kvr_sched_req, fills its request
 * (the prompt must stay valid) and `generated` ([max_tokens] ids of storage), and submits
 * it. The scheduler keeps a pointer until it reports KVR_SCHED_EV_DETACH; then the caller
 * may free it. A refused request is never referenced after submit returns.
 *
 * Threads: none of its own. The caller serialises every call (bridge.c holds one mutex),
 * and the event callback runs inside the call that caused it. */
#ifndef KVR_BRIDGE_SCHED_H
#define KVR_BRIDGE_SCHED_H

#include "bridge/costmodel.h"
#include "bridge/draft.h"
#include "bridge/request.h"
#include "core/err.h"
#include "ring/plan.h"
#include "ring/wire.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_sched;
struct kvr_telemetry; /* telemetry.h */

/* ---- requests and their streams ------------------------------------------------------- */

/* Admission's estimates of one request (admission.h), made at submit and checked against
 * the outcome. All 0 when the cost model was not ready (no estimate). */
struct kvr_estimate {
    double raw_first_ms;     /* the cost model's first-token time from submit (0: none) */
    double raw_period_ms;    /* the streams' recent gap between tokens beside the cost
                                model's period at the load it adds, worth a few gaps */
    double checked_first_ms; /* the raw first-token time the budget was checked at: the
                                urgent pace if that rescues a late prompt (pacing.h) */
    double first_ms;         /* the first token's time from submit, corrected by the recent
                                mean error of estimates of its eta_class */
    double period_ms;        /* such that first_ms + (n - 1) x period_ms is the estimate
                                for n tokens */
    uint8_t eta_class;       /* which first-token calibration its outcome feeds: by the
                                batches admission expected before the first token */
};

struct kvr_sched_req {
    /* Set by the caller before submit, read-only afterwards. */
    struct kvr_gen_request req; /* req.prompt must outlive the DETACH */
    int32_t *generated;         /* [req.max_tokens] storage for the tokens so far: a
                                   recovery re-prefills them behind the prompt */
    void *user;                 /* the caller's, untouched */
    uint64_t prompt_of;         /* 0, or the id of an earlier request with the same prompt
                                   (request.h same_prompt_as): this one leaves the wait
                                   queue only once that one's prompt is all in batches */
    /* The scheduler's; the caller may read them inside the event callback. */
    uint64_t submit_ns;
    uint64_t deadline_ns; /* earliest-deadline-first key; UINT64_MAX: none */
    uint64_t first_token_ns;
    uint64_t last_token_ns;
    struct kvr_estimate est; /* admission's estimates (admission.h) */
    bool held_once;          /* a ring failure held it: its times say nothing */
    uint32_t n_cached;       /* prompt positions found in the prefix cache (admission's
                                estimate, then what its slot got) */
    uint32_t n_generated;
    uint32_t spec_drafted;  /* drafted tokens sent with its decode rows (spec_policy.h) */
    uint32_t spec_accepted; /* ... of them the tail kept */
    uint32_t spec_steps;    /* decode rows that carried drafts */
    int seq;                /* slot, or -1 while waiting / once it ended */
    bool waiting;           /* in the wait queue */
    bool ended;             /* the END event has been reported */
    uint64_t id;            /* set by submit: 1, 2, ... (the telemetry names batches' rows by it) */
};

enum kvr_sched_event_type {
    KVR_SCHED_EV_TOKEN,  /* a generated token */
    KVR_SCHED_EV_END,    /* the stream ended (finish, message): no token follows */
    KVR_SCHED_EV_DETACH, /* the scheduler forgot the request: the caller may free it */
    KVR_SCHED_EV_TYPE_COUNT
};

/* TOKEN and END carry the stream's one event type, struct kvr_gen_event (request.h):
 *   TOKEN  gen.token, gen.logprob and gen.top (when asked for), gen.eog, gen.t_ns;
 *          gen.finish is NONE
 *          (the END that follows the last token says why it was the last);
 *   END    gen.finish (LENGTH, EOS, CANCELLED or ERROR), gen.error (why, for ERROR),
 *          gen.t_ns; gen.token is -1 and gen.error_status 0 (the shell chooses it).
 * DETACH is the scheduler's own notice and carries only gen.t_ns. */
struct kvr_sched_event {
    enum kvr_sched_event_type type;
    struct kvr_gen_event gen;
};

typedef void (*kvr_sched_event_fn)(void *ctx, struct kvr_sched_req *r,
                                   const struct kvr_sched_event *ev);

/* Refusals: struct kvr_refusal (request.h). */

/* ---- telemetry ------------------------------------------------------------------------ */

struct kvr_sched_stage_stats {
    uint64_t held_ns, starved_ns, blocked_ns; /* totals over every batch */
    double util;                              /* held fraction over the last ~2 s */
    double starved_frac, blocked_frac;        /* same window */
};

/* Bucket bounds of the estimate histograms: admission's estimate / what happened, for the
 * first token and for the whole answer (1 is exact, above 1 pessimistic). */
#define KVR_SCHED_RATIO_BUCKETS 9
extern const double kvr_sched_ratio_bounds[KVR_SCHED_RATIO_BUCKETS];

/* Bucket bounds (seconds) of the queue-time histogram: submit until a sequence slot. */
#define KVR_SCHED_QUEUE_BUCKETS 15
extern const double kvr_sched_queue_bounds[KVR_SCHED_QUEUE_BUCKETS];

/* One expert agent's load (docs/EXPERTS.md), from the agent records the stages append to
 * every batch they used it for (ring/wire.h): totals over every stage it served. */
struct kvr_sched_agent_stats {
    uint64_t held_ns, starved_ns, blocked_ns;
    uint64_t pairs; /* (row, expert) pairs it computed */
};

struct kvr_sched_stats {
    bool ring_up;
    uint32_t n_stages;
    struct kvr_sched_stage_stats stage[KVR_PLAN_MAX_STAGES];
    uint32_t n_agents; /* the plan's expert agents */
    struct kvr_sched_agent_stats agent[KVR_PLAN_MAX_AGENTS];
    uint32_t running;          /* sequences holding a slot */
    uint32_t waiting;          /* admitted, waiting for a slot */
    uint32_t kv_blocks_used;   /* blocks running sequences use (per stage; shared once) */
    uint32_t kv_blocks_cached; /* blocks only the prefix cache holds (evictable) */
    uint32_t kv_blocks_total;
    uint64_t prefix_queries; /* prompt tokens of sequences started (vLLM's queries) */
    uint64_t prefix_hits;    /* ... of them found in the prefix cache */
    uint64_t prefix_evicted; /* cached blocks evicted to make room */
    uint32_t inflight;       /* batches in the window */
    uint64_t batches;        /* batches completed */
    uint64_t prompt_tokens;  /* prefill rows completed */
    uint64_t generated_tokens;
    uint64_t admitted, refused[KVR_REFUSE_REASON_COUNT];
    /* Of refused[], those that no retry could help (struct kvr_refusal never), and those of
     * TOTAL_BUDGET refused because a running request would have become late. */
    uint64_t refused_never[KVR_REFUSE_REASON_COUNT];
    uint64_t refused_for_running;
    uint64_t queue_hist[KVR_SCHED_QUEUE_BUCKETS + 1]; /* last bucket: +Inf */
    double queue_sum_s;
    uint64_t queue_count;
    uint64_t first_ratio_hist[KVR_SCHED_RATIO_BUCKETS + 1]; /* last bucket: +Inf */
    uint64_t total_ratio_hist[KVR_SCHED_RATIO_BUCKETS + 1];
    double batch_ms_ema; /* measured round trip of one batch */
    double tokens_per_s; /* generated tokens over the last ~2 s */
    /* The estimate ratios observed, summed (the histograms' _sum). */
    double first_ratio_sum, total_ratio_sum;
    /* Speculation (spec_policy.h), by draft source: tokens drafted, accepted, and the
     * decode rows that carried them (vLLM's spec_decode_num_* counters). */
    uint64_t spec_drafted[KVR_DRAFT_SOURCE_COUNT];
    uint64_t spec_accepted[KVR_DRAFT_SOURCE_COUNT];
    uint64_t spec_steps[KVR_DRAFT_SOURCE_COUNT];
};

/* ---- life cycle ----------------------------------------------------------------------- */

/* Speculation (issue 37, spec_policy.h): drafted tokens ride decode rows while the ring
 * has spare rows. */
enum kvr_spec_mode {
    KVR_SPEC_OFF = 0, /* never: every decode row carries one token */
    KVR_SPEC_AUTO,    /* when the ring's telemetry says it pays */
    KVR_SPEC_MODE_COUNT
};

/* "off" or "auto" into *out: 0, or KVR_EINVAL (spec_policy.c). */
int kvr_sched_spec_parse(const char *s, enum kvr_spec_mode *out);

struct kvr_sched_config {
    const struct kvr_plan *plan; /* borrowed; must outlive the scheduler */
    uint32_t max_ctrl;           /* control records a batch may carry (the head's limits) */
    uint32_t max_waiting;        /* bounded wait queue; 0 = 4 * max_seqs */
    bool admission;              /* refuse requests that would miss their budget */
    bool prefix_cache;           /* reuse the KV blocks of earlier prompts (DESIGN.md 12) */
    enum kvr_spec_mode spec;     /* speculation (spec_policy.h) */
    kvr_sched_event_fn event;    /* stream events; called inside the call that causes them */
    void *event_ctx;
    struct kvr_telemetry *telemetry; /* borrowed, may be NULL: every returned batch, and each
                                        loss and recovery of the ring, is recorded into it */
};

/* Allocates everything it will ever need (nothing afterwards). */
int kvr_sched_create(struct kvr_sched **out, const struct kvr_sched_config *cfg,
                     struct kvr_err *err);
/* Frees it; requests it still references are not detached (call kvr_sched_shutdown). */
void kvr_sched_destroy(struct kvr_sched *s);

/* ---- inputs --------------------------------------------------------------------------- */

/* Admit a request (0; it waits for a slot or starts at once) or refuse it (KVR_EAGAIN, or
 * KVR_EINVAL for an empty one, with *why filled; nothing is kept). */
int kvr_sched_submit(struct kvr_sched *s, struct kvr_sched_req *r, uint64_t now,
                     struct kvr_refusal *why);
/* The consumer does not want more: END(CANCELLED) unless it ended already; the sequence is
 * cancelled in the ring once nothing of it is in flight. Idempotent. */
void kvr_sched_cancel(struct kvr_sched *s, struct kvr_sched_req *r, uint64_t now);
/* A RESULT frame from the tail. KVR_EPROTO (err says why) if it does not match the oldest
 * batch in flight: the ring lost or reordered a batch, and the shell must drop its links
 * (then kvr_sched_link_down). Results of batches given up for lost are ignored. */
int kvr_sched_result(struct kvr_sched *s, const struct kvr_wire_frame *f, uint64_t now,
                     struct kvr_err *err);
/* A RESET frame: `stage` dropped its sequences, because its upstream changed (batch_id
 * KVR_WIRE_RESET_LINK) or it could not run batch_id. */
void kvr_sched_reset(struct kvr_sched *s, uint32_t stage, uint64_t batch_id, uint64_t now);
/* Both links are up (and credits granted): probe the ring with a free-all batch. */
void kvr_sched_link_up(struct kvr_sched *s, uint64_t now);
/* A link dropped: hold the running sequences until the ring is whole again. */
void kvr_sched_link_down(struct kvr_sched *s, const char *why, uint64_t now);
/* The plan (the config's, which the shell owns) was replaced by a re-plan of the ring
 * (propose.h kvr_plan_replan) while its links were down: the stage count, the cost model
 * and the prefix cache's seed follow the new plan. The widths are the same. */
void kvr_sched_plan_changed(struct kvr_sched *s);
/* Time passes: a batch that has not come back in time means a lost batch (or, while the
 * ring forms, a dropped probe: another goes out); held requests past their budget fail.
 * Returns the next `now` at which tick has something to do, or UINT64_MAX. */
uint64_t kvr_sched_tick(struct kvr_sched *s, uint64_t now);
/* The bridge stops: every running and waiting request ends with ERROR(why) and is
 * detached; the window is emptied. */
void kvr_sched_shutdown(struct kvr_sched *s, const char *why, uint64_t now);

/* ---- outputs -------------------------------------------------------------------------- */

/* The next batch to send, or NULL when the window is full or there is nothing to send. The
 * message (type BATCH, token payload) and its arrays stay valid until the batch's result
 * is applied or a recovery empties the window. */
const struct kvr_wire_msg *kvr_sched_next_batch(struct kvr_sched *s, uint64_t now);

bool kvr_sched_ring_up(const struct kvr_sched *s);
/* Forget every cached block nobody uses (they become free); returns how many. The stages
 * need not know: the bridge alone decides which blocks a sequence maps. */
uint32_t kvr_sched_flush_cache(struct kvr_sched *s);
/* Whether batch_id is in the window (its result would be applied, not ignored). */
bool kvr_sched_batch_live(const struct kvr_sched *s, uint64_t batch_id);
void kvr_sched_stats(const struct kvr_sched *s, struct kvr_sched_stats *out);

/* Check the internal invariants (tests and fuzzing): KV blocks reserved equal the sum over
 * the slots, the in-flight counts equal the window's contents, no sequence decodes in two
 * in-flight batches, the wait queue and slots agree with the requests. KVR_EINVAL with a
 * message naming the first broken one. */
int kvr_sched_check(const struct kvr_sched *s, struct kvr_err *err);

#endif
