/* telemetry.h - the bridge's live picture of the ring for the console (docs/API.md):
 * what each micro-batch carried and how long every stage held, starved and blocked on it,
 * when the ring was lost and whole again, and one JSON snapshot of all that beside the
 * scheduler's counters, for GET /v1/telemetry.
 *
 * Pure: no I/O, no threads, no clock (times come in as ns on the caller's monotonic clock),
 * no allocation after kvr_telemetry_create, so the scheduler can feed it on its hot path and
 * tests can drive it directly (tests/unit/test_telemetry.c).
 *
 * Data flow:
 *
 *   scheduler, as a batch's RESULT is applied   kvr_telemetry_record_batch  ─┐
 *   scheduler, as it holds / re-prefills         kvr_telemetry_ring_event   ─┤ ring buffers
 *                                                                            │ (the last
 *   an SSE client, every interval, under the     kvr_telemetry_take  ◀──────┘  TRACES / EVENTS)
 *   same lock: copies into its own snapshot        + plan + sched stats
 *   ... then without the lock                    kvr_telemetry_json  -> text
 *
 * Every reader keeps its own cursor (struct kvr_telemetry_reader), so any number of pages
 * see every batch once; a reader that falls more than KVR_TELEMETRY_TRACES behind, or gets
 * more than KVR_TELEMETRY_SNAPSHOT_TRACES in one interval, is told how many it missed.
 *
 * Ownership: struct kvr_telemetry is the caller's (create/destroy); a snapshot is a plain
 * value the reader owns (about 330 KiB: allocate it once per connection, not on a stack; the
 * ring buffers take about 550 KiB).
 *
 * Threads: none of its own. The caller serialises record/event/take on one telemetry (the
 * bridge's mutex, which the scheduler's calls already hold); kvr_telemetry_json reads only
 * the snapshot and may run on any thread. */
#ifndef KVR_BRIDGE_TELEMETRY_H
#define KVR_BRIDGE_TELEMETRY_H

#include "bridge/sched.h"
#include "core/err.h"
#include "core/sbuf.h"
#include "model/engine.h"
#include "ring/plan.h"
#include "ring/wire.h"

#include <stdbool.h>
#include <stdint.h>

#define KVR_TELEMETRY_TRACES 128         /* batches kept: 1.3 s at 100 batches/s */
#define KVR_TELEMETRY_EVENTS 32          /* ring events kept */
#define KVR_TELEMETRY_SEQS 64            /* sequences one trace names; more are counted */
#define KVR_TELEMETRY_AGENTS 16          /* agent records one trace keeps; more are counted */
#define KVR_TELEMETRY_SNAPSHOT_TRACES 64 /* batches one snapshot carries (the newest) */
#define KVR_TELEMETRY_WHY_BYTES 160

/* GET /v1/telemetry?interval_ms=N: the period between snapshots, clamped to these bounds,
 * so one page costs the bridge at most 10 snapshots a second. */
#define KVR_TELEMETRY_MIN_INTERVAL_MS 100
#define KVR_TELEMETRY_DEFAULT_INTERVAL_MS 250
#define KVR_TELEMETRY_MAX_INTERVAL_MS 10000

/* ---- what the scheduler feeds ------------------------------------------------------------- */

/* A returned batch, as the scheduler knows it when its RESULT is applied. Everything is
 * borrowed for the call only. */
struct kvr_telemetry_batch {
    uint64_t batch_id;
    uint64_t sent_ns;           /* when the bridge sent it to the head */
    uint64_t returned_ns;       /* when its RESULT was applied */
    const struct kvr_seg *segs; /* [n_segs] its membership (one segment per sequence) */
    uint32_t n_segs;
    const uint64_t *req_ids; /* [min(n_segs, KVR_TELEMETRY_SEQS)] request id of segment
                                i's sequence (0: unknown), or NULL when none is known */
    uint32_t n_ctrl;         /* control records it carried (OPEN, FREE, MAP, ...) */
    const struct kvr_wire_timing *timings; /* [n_timings] record i from stage i */
    uint32_t n_timings;
    const struct kvr_wire_timing *agent_timings; /* [n_agent_timings] */
    uint32_t n_agent_timings;
};

enum kvr_telemetry_event_type {
    KVR_TELEMETRY_EV_LOST,      /* the ring broke: its running sequences are held */
    KVR_TELEMETRY_EV_RECOVERED, /* whole again: the held sequences are re-prefilled */
    KVR_TELEMETRY_EV_TYPE_COUNT
};

/* ---- what a reader gets ------------------------------------------------------------------- */

enum kvr_telemetry_kind {
    KVR_TELEMETRY_PREFILL, /* a prompt chunk (KVR_SEG_PREFILL) */
    KVR_TELEMETRY_DECODE,  /* one generated token fed back (KVR_SEG_DECODE) */
    KVR_TELEMETRY_KIND_COUNT
};

struct kvr_telemetry_seq {
    uint64_t req_id; /* 0: unknown */
    uint32_t seq;    /* slot */
    uint32_t n_rows;
    uint8_t kind;    /* enum kvr_telemetry_kind */
    bool last_chunk; /* the last prefill chunk: its first token comes back with it */
};

struct kvr_telemetry_time {
    uint64_t held_ns, starved_ns, blocked_ns;
    uint32_t agent; /* agent records: the agent's index; stages: 0 */
    uint32_t pairs; /* agent records: (row, expert) pairs computed; stages: 0 */
};

struct kvr_telemetry_trace {
    uint64_t serial; /* 1, 2, ... in the order recorded: the readers' cursor */
    uint64_t batch_id;
    uint64_t sent_ns, returned_ns;
    uint32_t n_ctrl;
    uint32_t n_rows_prefill, n_rows_decode; /* over every segment, named or not */
    uint32_t n_seqs, n_seqs_more;           /* seqs[0 .. n_seqs) named, n_seqs_more not */
    struct kvr_telemetry_seq seqs[KVR_TELEMETRY_SEQS];
    uint32_t n_stages; /* timing records, record i from stage i */
    struct kvr_telemetry_time stage[KVR_PLAN_MAX_STAGES];
    uint32_t n_agents, n_agents_more;
    struct kvr_telemetry_time agent[KVR_TELEMETRY_AGENTS];
};

struct kvr_telemetry_event {
    uint64_t serial; /* 1, 2, ... */
    uint64_t t_ns;
    uint8_t type;       /* enum kvr_telemetry_event_type */
    int32_t stage;      /* the stage to blame, -1: not known */
    uint32_t n_held;    /* sequences held (LOST) or re-prefilled (RECOVERED) */
    uint64_t outage_ns; /* RECOVERED: since the LOST that began the outage; else 0 */
    char why[KVR_TELEMETRY_WHY_BYTES];
};

/* A stage as the shell sees it (bridge.h struct kvr_bridge_stage_state), for the lanes. */
struct kvr_telemetry_stage_state {
    char state[16]; /* "up", "down", "connecting", "connected", "unknown" */
    uint64_t since_ns;
    char last_error[KVR_TELEMETRY_WHY_BYTES]; /* "" if none */
};

/* Each reader's position in the two ring buffers; start zeroed. */
struct kvr_telemetry_reader {
    uint64_t trace_serial; /* last trace serial delivered */
    uint64_t event_serial;
};

/* Everything one snapshot says: copied under the lock by kvr_telemetry_take, serialised
 * after it by kvr_telemetry_json. */
struct kvr_telemetry_snapshot {
    uint64_t now_ns;
    uint32_t interval_ms; /* the stream's period, echoed for the page */
    struct kvr_plan_summary {
        uint32_t epoch, n_stages, n_agents;
        uint32_t row_width, microbatches, max_seqs, n_ctx, kv_block_tokens, kv_blocks;
        uint32_t n_threads; /* the plan's default */
        struct {
            char addr[KVR_PLAN_ADDR_BYTES];
            uint32_t first_layer, last_layer, n_threads;
        } stage[KVR_PLAN_MAX_STAGES];
        struct {
            char addr[KVR_PLAN_ADDR_BYTES];
            uint32_t n_threads, n_holds;
            struct kvr_plan_hold holds[KVR_PLAN_MAX_HOLDS];
        } agent[KVR_PLAN_MAX_AGENTS];
    } plan;
    struct kvr_sched_stats stats;
    uint32_t n_stage_states; /* 0: the shell gave none */
    struct kvr_telemetry_stage_state stage_state[KVR_PLAN_MAX_STAGES];
    uint32_t n_traces;
    uint64_t traces_missed; /* recorded since the last snapshot but not in this one */
    struct kvr_telemetry_trace traces[KVR_TELEMETRY_SNAPSHOT_TRACES]; /* oldest first */
    uint32_t n_events;
    uint64_t events_missed;
    struct kvr_telemetry_event events[KVR_TELEMETRY_EVENTS]; /* oldest first */
};

/* ---- calls -------------------------------------------------------------------------------- */

struct kvr_telemetry;

/* Allocates both ring buffers (nothing afterwards). */
int kvr_telemetry_create(struct kvr_telemetry **out, struct kvr_err *err);
void kvr_telemetry_destroy(struct kvr_telemetry *t);

/* A batch came back (call once per applied RESULT, before the window slot is reused). */
void kvr_telemetry_record_batch(struct kvr_telemetry *t, const struct kvr_telemetry_batch *b);
/* The ring was lost (stage: -1 when it cannot be pinned on one) or is whole again. `why`
 * may be NULL; it is cut to KVR_TELEMETRY_WHY_BYTES. For RECOVERED, the outage is measured
 * from the oldest LOST since the previous RECOVERED. */
void kvr_telemetry_ring_event(struct kvr_telemetry *t, enum kvr_telemetry_event_type type,
                              int32_t stage, uint32_t n_held, const char *why, uint64_t now_ns);

/* Fill `snap` for `reader`: the plan's shape, the scheduler's stats (`stats` may be
 * &snap->stats, filled in place, or NULL), the stage states (states may be NULL, n_states 0), and
 * the traces and events recorded since the reader's last snapshot (the newest
 * KVR_TELEMETRY_SNAPSHOT_TRACES; the rest counted as missed); the reader's cursors advance. Only
 * memory copies: meant to run under the lock. */
void kvr_telemetry_take(const struct kvr_telemetry *t, struct kvr_telemetry_reader *reader,
                        const struct kvr_plan *plan, const struct kvr_sched_stats *stats,
                        const struct kvr_telemetry_stage_state *states, uint32_t n_states,
                        uint64_t now_ns, struct kvr_telemetry_snapshot *snap);

/* Append the snapshot as one line of JSON (no newline) to `out` (docs/API.md gives
 * the format). Returns 0, or KVR_ENOMEM (out->failed is then set). */
int kvr_telemetry_json(const struct kvr_telemetry_snapshot *snap, struct kvr_sbuf *out);

/* The same as one server-sent event: "event: snapshot\ndata: <json>\n\n". */
int kvr_telemetry_sse(const struct kvr_telemetry_snapshot *snap, struct kvr_sbuf *out);

/* The stream's period from the query argument `interval_ms` (NULL when absent): a whole
 * number of ms clamped to [MIN, MAX]; absent or not a number gives the default. */
uint32_t kvr_telemetry_interval_ms(const char *arg);

/* The names the JSON uses: "prefill"/"decode", "lost"/"recovered", and the refusal reasons
 * ("first_token_budget", ...; NULL for KVR_REFUSE_NONE or out of range). */
const char *kvr_telemetry_kind_name(enum kvr_telemetry_kind kind);
const char *kvr_telemetry_event_name(enum kvr_telemetry_event_type type);
const char *kvr_telemetry_refusal_name(enum kvr_refusal_reason reason);

#endif
