/* bridge.h - the bridge core: the request table, the scheduler that keeps micro-batches in
 * flight in the ring, and the ring's two links (DESIGN.md 6). The HTTP API sits on top.
 *
 * The bridge dials stage 0 (the head) and listens on the plan's bridge address for the tail.
 * A ring thread builds a batch whenever fewer than `microbatches` are in flight: in-band
 * control records first (FREE for finished sequences, OPEN for new ones), then one decode
 * row per ready sequence (earliest deadline first, spread evenly across the batches in
 * flight), then prefill chunks filling what is left of the row width. A sequence's decode
 * row is never in two in-flight batches (token t+1 needs token t); its non-final prefill
 * chunks may be, because stages keep order. Results from the tail are appended to each
 * request's stream and the stages' timing records to the telemetry totals.
 *
 * Admission: a request gets a sequence slot and reserves the KV blocks its prompt plus
 * max_tokens need (on every stage, all stages have the plan's kv_blocks). With a latency
 * budget, the bridge first estimates when the request's first and last tokens would arrive
 * from the measured cost of a batch and the work already queued, and refuses at once a
 * request that would miss it. The wait queue is bounded.
 *
 * Failures (DESIGN.md 8): when a stage reports that it dropped its sequences (a RESET
 * frame), a link drops, or a batch does not come back, the running sequences are held; once
 * a probe has gone round the whole ring again, each is re-prefilled from its prompt plus
 * the tokens it had produced (REPLAY records restore the tail's sampler), so its stream
 * only pauses. A held request ends with KVR_FINISH_ERROR when its total budget runs out or
 * after 30 s. New requests are refused (ring_down) while the ring is not whole.
 *
 * Threads: every public function is thread-safe. A stream is used by one consumer thread
 * (next/cancel/release) while the ring thread produces into it. */
#ifndef KVR_BRIDGE_BRIDGE_H
#define KVR_BRIDGE_BRIDGE_H

#include "core/err.h"
#include "model/sampler.h"
#include "ring/plan.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_bridge;
struct kvr_bridge_stream;

struct kvr_bridge_config {
    const struct kvr_plan *plan; /* copied */
    uint32_t n_embd;             /* the model's width, vocabulary, and end-of-generation */
    uint32_t n_vocab;
    uint32_t max_waiting;        /* bounded wait queue; 0 = 4 * max_seqs */
    bool admission;              /* refuse requests that would miss their budget */
};

struct kvr_bridge_request {
    const int32_t *prompt;       /* copied at submit */
    uint32_t n_prompt;
    uint32_t max_tokens;
    struct kvr_sample_params sampling;
    bool logprobs;
    bool ignore_eos;             /* keep generating past an end-of-generation token */
    uint32_t first_token_ms;     /* latency budget, from submit; 0 = none */
    uint32_t total_ms;
};

enum kvr_bridge_refusal_reason {
    KVR_REFUSE_NONE = 0,
    KVR_REFUSE_FIRST_TOKEN_BUDGET, /* 429: first token would come too late */
    KVR_REFUSE_TOTAL_BUDGET,       /* 429: the answer would finish too late */
    KVR_REFUSE_KV_FULL,            /* 429: the KV blocks it needs are not free */
    KVR_REFUSE_QUEUE_FULL,         /* 503: the wait queue is full */
    KVR_REFUSE_TOO_LONG,           /* 400: prompt + max_tokens beyond the context */
    KVR_REFUSE_RING_DOWN,          /* 503: the ring is not connected */
    KVR_REFUSE_REASON_COUNT
};

struct kvr_bridge_refusal {
    enum kvr_bridge_refusal_reason reason;
    uint32_t retry_after_ms;
    char message[200];
};

const char *kvr_bridge_refusal_name(enum kvr_bridge_refusal_reason reason);

enum kvr_bridge_finish {
    KVR_FINISH_NONE = 0,  /* a token; more may follow */
    KVR_FINISH_LENGTH,    /* max_tokens reached (this event carries the last token) */
    KVR_FINISH_STOP,      /* end-of-generation token (carried, flagged eog) */
    KVR_FINISH_CANCELLED, /* kvr_bridge_cancel was called */
    KVR_FINISH_ERROR,     /* the ring failed and did not recover in time; `message` says */
    KVR_FINISH_COUNT
};

struct kvr_bridge_event {
    bool has_token;
    int32_t token;
    float logprob;
    bool eog;
    enum kvr_bridge_finish finish;
    uint64_t t_ns;          /* when the bridge received it (kvr_now_ns) */
    char message[128];
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

/* Admit a request (0, *stream set) or refuse it (KVR_EAGAIN, *why filled). */
int kvr_bridge_submit(struct kvr_bridge *b, const struct kvr_bridge_request *req,
                      struct kvr_bridge_stream **stream, struct kvr_bridge_refusal *why);
/* Next event of a stream: 0 with *ev filled, or KVR_ETIMEDOUT (at once if timeout_ms is
 * 0). After an event with finish != NONE there are no more. */
int kvr_bridge_next(struct kvr_bridge_stream *s, struct kvr_bridge_event *ev, int timeout_ms);
/* For a caller that follows many streams from one thread: wait until any stream has had an
 * event since *seen (a count the call keeps; start it at 0), or the timeout passes, then
 * set *seen to the current count. Drain the streams with timeout 0 after each return. */
void kvr_bridge_wait_any(struct kvr_bridge *b, uint64_t *seen, int timeout_ms);
/* Stop generating (the client went away or a stop string was hit): the sequence is
 * cancelled in the whole ring and its KV freed. Idempotent. */
void kvr_bridge_cancel(struct kvr_bridge_stream *s);
/* Free a stream (cancels it if still running). */
void kvr_bridge_release(struct kvr_bridge_stream *s);

/* Telemetry. */
struct kvr_bridge_stage_stats {
    uint64_t held_ns, starved_ns, blocked_ns; /* totals over every batch */
    double util;                              /* held fraction over the last ~2 s */
    double starved_frac, blocked_frac;        /* same window */
};

/* Bucket bounds (seconds) of the queue-time histogram: submit until a sequence slot. */
#define KVR_BRIDGE_QUEUE_BUCKETS 10
extern const double kvr_bridge_queue_bounds[KVR_BRIDGE_QUEUE_BUCKETS];

struct kvr_bridge_stats {
    bool ring_up;
    uint32_t n_stages;
    struct kvr_bridge_stage_stats stage[KVR_PLAN_MAX_STAGES];
    uint32_t running;         /* sequences holding a slot */
    uint32_t waiting;         /* admitted, waiting for a slot */
    uint32_t kv_blocks_used;  /* reserved blocks (per stage) */
    uint32_t kv_blocks_total;
    uint64_t batches;         /* batches completed */
    uint64_t prompt_tokens;   /* prefill rows completed */
    uint64_t generated_tokens;
    uint64_t admitted, refused[KVR_REFUSE_REASON_COUNT];
    uint64_t queue_hist[KVR_BRIDGE_QUEUE_BUCKETS + 1]; /* last bucket: +Inf */
    double queue_sum_s;
    uint64_t queue_count;
    double batch_ms_ema;      /* measured round trip of one batch */
    double tokens_per_s;      /* generated tokens over the last ~2 s */
};

void kvr_bridge_stats(struct kvr_bridge *b, struct kvr_bridge_stats *out);
/* Reset the telemetry totals (benchmarks measure a window). */
void kvr_bridge_stats_reset(struct kvr_bridge *b);

#endif
