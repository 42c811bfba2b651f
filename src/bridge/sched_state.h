/* sched_state.h - the scheduler's state, shared by its three rooms (private to them).
 *
 * sched.c owns this struct: it creates it, keeps the request table, the slots, the wait
 * queue, the window of batches in flight and the telemetry. admission.c (admission.h),
 * pacing.c (pacing.h) and spec_policy.c (spec_policy.h) read it and update only the fields
 * marked as theirs. Nothing outside these files (and sched_check.c) includes this header. One
 * thread at a time: the scheduler's caller. */
#ifndef KVR_BRIDGE_SCHED_STATE_H
#define KVR_BRIDGE_SCHED_STATE_H

#include "bridge/costmodel.h"
#include "bridge/kvpool.h"
#include "bridge/sched.h"

#include <stdbool.h>
#include <stdint.h>

#define MS_NS 1000000ull

/* The least safety factor on a prediction: a late answer is worse than a refused one. */
#define ADMIT_MARGIN 1.1

/* First-token estimates are corrected per class of expected batches, and requests that
 * wait for a slot or KV in a class of their own (admission.c). */
#define ETA_CLASSES 5

/* When a slot frees up in admission's model of the queue, and the KV blocks it returns. */
struct slot_free {
    double at_ms;    /* from now */
    uint32_t blocks; /* blocks it holds */
};

enum seq_state {
    SEQ_FREE,    /* no request */
    SEQ_PREFILL, /* prompt rows still to send */
    SEQ_READY,   /* has its last token back: a decode row may be sent */
    SEQ_WAIT,    /* its token-producing row is in flight */
    SEQ_ENDING,  /* finished or cancelled: FREE must be sent once nothing is in flight */
};

/* One sequence slot. */
struct seq {
    enum seq_state state;
    struct kvr_sched_req *r; /* the request, until the slot is released */
    uint32_t n_prefilled;    /* prefill rows sent */
    int32_t next_token;      /* SEQ_READY: input of the next decode row */
    uint32_t inflight;       /* in-flight batches containing this sequence */
    uint32_t kv_blocks;      /* blocks it holds in the pool: its whole table, or 0
                                while a recovered sequence waits for blocks */
    /* Prefix cache. Its table is s->tables[slot]: the first n_cached / block_tokens
     * entries were found in the cache, the rest allocated. */
    uint32_t n_cached;  /* prompt positions it did not compute */
    uint32_t n_named;   /* table entries published (or found) so far */
    uint64_t last_name; /* name of entry n_named - 1 (the seed before any) */
    bool opened;        /* OPEN has been sent */
    uint32_t bias_sent; /* logit-bias pairs sent since the OPEN (BIAS records);
                           the last prefill chunk waits for all of them */
    /* Grammar bytes sent since the OPEN (GRAMMAR records); REPLAY records and the last
     * prefill chunk wait for all of them. */
    uint32_t grammar_sent;
    bool decoding; /* its first token has come back */
    bool cancelled;
    /* Recovery: the prefill is the prompt, then the n_replay tokens it had generated.
     * REPLAY records restore the tail's sampler before its last chunk. */
    uint32_t n_replay;
    uint32_t replay_ids_sent; /* penalty-window ids sent so far */
    bool replay_pending;      /* REPLAY records still to send: no last chunk yet */
    uint64_t held_since;      /* when a ring failure stopped it; 0 = not held */
};

/* One batch of the in-flight window. */
struct batch {
    uint64_t id;
    uint64_t sent_ns;
    uint32_t n_ctrl, n_segs, n_rows;
    double pairs;               /* attention pairs (costmodel.h) */
    bool mixed;                 /* decode rows and prefill rows together */
    struct kvr_wire_ctrl *ctrl; /* [max_ctrl] */
    struct kvr_seg *segs;       /* [row_width] */
    int32_t *tokens;            /* [row_width] */
    struct kvr_wire_msg msg;    /* what the shell sends: points at the arrays above */
};

struct kvr_sched {
    const struct kvr_plan *plan;
    struct kvr_sched_config cfg;
    struct seq *seqs;             /* [max_seqs] */
    struct kvr_sched_req **waitq; /* [max_waiting] FIFO of admitted, slotless requests */
    uint32_t wq_head, wq_count, max_waiting;
    uint32_t n_running;
    /* KV blocks (DESIGN.md 12). Every stage has the plan's kv_blocks of kv_block_tokens.
     * The bridge names each block a sequence uses (MAP records), so the pool is the
     * layout of every stage's cache. */
    struct kvr_kv_pool pool;
    uint32_t max_blocks_per_seq; /* ceil(n_ctx / kv_block_tokens) */
    uint32_t *tables;            /* [max_seqs][max_blocks_per_seq] each slot's blocks */
    uint32_t *found_scratch;     /* [max_blocks_per_seq] lookups' */
    int32_t *tok_scratch;        /* [kv_block_tokens] publishing's */
    uint64_t cache_seed;         /* the first block's "before": plan (and model) hash */

    /* In-flight window: a FIFO of batches, oldest first. */
    struct batch *batches; /* [microbatches] */
    uint32_t bf_head, n_inflight;
    uint64_t next_batch_id;
    uint64_t discard_below; /* results of batches older than this are stale */
    bool free_all;          /* the next batch frees every slot in every stage */
    bool links_up;          /* the shell has both links: batches may go out */
    /* Up only once a batch has come back through every stage after the links came up.
     * The bridge's two links can be up before the links between stages are, and a stage
     * with no downstream drops what it gets. */
    bool ring_up;
    uint64_t hold_start_ns; /* when the current outage began holding sequences */

    /* Telemetry. */
    struct kvr_sched_stats stats;
    uint64_t win_start_ns;
    uint64_t win_held[KVR_PLAN_MAX_STAGES], win_starved[KVR_PLAN_MAX_STAGES],
        win_blocked[KVR_PLAN_MAX_STAGES], win_tokens;
    uint32_t *pick_scratch; /* [max_seqs + 1] the decode picker's */

    /* Pacing's (pacing.c). */
    struct kvr_cost_model cost;   /* batch costs learnt from timing records */
    struct kvr_calib calib_mixed; /* actual / predicted time of batches with prefill
                                     added to decode rows: keeps chunking honest */
    double mix_rows, mix_pairs;   /* prefill rows (and their attention pairs) that batches
                                     with decode rows carried lately (moving averages) */
    struct kvr_recent share;      /* the waiting share of recent batches */

    /* Admission's (admission.c). */
    struct kvr_calib calib_first; /* actual / checked first-token time */
    /* Actual / raw first-token time, lately, by eta_class. The bias depends on how many
     * batches the estimate expected, and on the load, which the decay follows. */
    struct kvr_recent first_eta[ETA_CLASSES];
    struct kvr_calib calib_total;    /* actual / estimated time of whole answers */
    struct kvr_recent gaps;          /* the streams' recent gaps between tokens, ms */
    struct slot_free *admit_scratch; /* [max_seqs] the queue model's slots */
    double *lane_scratch;            /* [max_seqs + max_waiting] ... and its prompt lane */
    double *ends_scratch;            /* [max_seqs + max_waiting] when streams stop decoding */

    /* The console's telemetry (cfg.telemetry; sched.c's "telemetry" section). */
    uint64_t next_req_id; /* the last id submit gave */
    uint32_t reset_blame; /* 1 + the stage the RESET being handled blames; 0: none */
    bool tel_lost;        /* a LOST was recorded and its RECOVERED not yet */

    struct kvr_spec *spec; /* spec_policy.c's: drafts, acceptance (NULL: speculation off) */
};

/* Blocks for n_tokens positions. */
static inline uint32_t blocks_for(const struct kvr_sched *s, uint32_t n_tokens)
{
    return (n_tokens + s->plan->kv_block_tokens - 1) / s->plan->kv_block_tokens;
}

/* Blocks a request reserves: its prompt and every token it may generate. */
static inline uint32_t req_blocks(const struct kvr_sched *s, const struct kvr_sched_req *r)
{
    return blocks_for(s, r->req.n_prompt + r->req.max_tokens);
}

/* The earliest-deadline-first key of a running sequence. */
static inline uint64_t seq_deadline(const struct seq *q)
{
    return q->r->deadline_ns;
}

/* Whether a request's blocks fit in the pool now (evicting cached blocks it does not use),
 * and how many of its prompt's blocks the prefix cache holds (*n_hit). sched.c. */
bool kvr_sched_blocks_fit(const struct kvr_sched *s, const struct kvr_gen_request *req,
                          uint32_t *n_hit);

/* The console's telemetry (sched_trace.c); each does nothing without cfg.telemetry. A batch
 * came back (before its results are applied, while its sequences still have their
 * requests); recover() holds n_held sequences (one loss per outage, blamed on the stage a
 * RESET named); the ring is whole again. */
struct kvr_wire_frame;
void kvr_sched_trace_batch(struct kvr_sched *s, const struct batch *bt,
                           const struct kvr_wire_frame *f, uint64_t now);
void kvr_sched_trace_lost(struct kvr_sched *s, uint32_t n_held, const char *why, uint64_t now);
void kvr_sched_trace_recovered(struct kvr_sched *s, uint64_t now);

#endif
