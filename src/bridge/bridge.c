/* bridge.c - request table, scheduler and ring links of the bridge (see bridge.h).
 *
 * Reading order: streams (what a consumer sees), sequence slots and KV accounting,
 * admission, the batch builder, result handling, the links, the ring thread, then the
 * public API.
 *
 * One mutex (b->lock) guards every request, slot and counter. The ring thread holds it
 * while it builds a batch or applies a result, never while it does I/O. */
#include "bridge/bridge.h"

#include "bridge/costmodel.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"
#include "ring/credit.h"
#include "ring/net.h"
#include "ring/wire.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum {
    POLL_MS = 50,
    TAIL_CREDITS = 4,        /* result frames the tail may send ahead of our reading */
    HANDSHAKE_MS = 3000,
    RING_TIMEOUT_MS = 15000, /* a batch that has not come back by then was lost */
    PROBE_MS = 500,          /* ... while checking a newly connected ring */
    HOLD_MAX_MS = 30000,     /* a sequence held this long by a broken ring fails */
    WINDOW_NS = 2000000000,  /* telemetry fractions are over this window */
    MIN_PREFILL_ROWS = 1,    /* prefill rows a batch with decodes still takes, to progress */
};

/* A batch that carries decode rows may take at most this factor longer because of the
 * prefill rows added to it. */
#define PREFILL_SLOWDOWN 1.8

/* ---- streams ---------------------------------------------------------------------------- */

struct token_event {
    int32_t token;
    float logprob;
    uint8_t eog;
    uint64_t t_ns;
};

struct kvr_bridge_stream {
    struct kvr_bridge *b;
    int32_t *prompt;                /* [n_prompt], owned */
    struct kvr_bridge_request req;  /* req.prompt points at `prompt` */
    int seq;                        /* slot, or -1 while waiting / after it ended */
    uint64_t submit_ns;
    uint64_t deadline_ns;           /* for earliest-deadline-first; UINT64_MAX: none */
    /* Produced by the ring thread, consumed by next(): a FIFO of token events. */
    struct token_event *events;     /* [max_tokens] */
    int32_t *generated;             /* [max_tokens] every token so far, in order: after a
                                       ring failure it is re-prefilled behind the prompt */
    uint32_t ev_head, ev_count;
    uint32_t n_generated;
    double pred_first_ms;           /* admission's raw first-token estimate (0: none) */
    uint64_t last_token_ns;
    enum kvr_bridge_finish finish;  /* set once the stream has ended */
    bool finish_delivered;
    bool cancel_requested;
    bool released;
    bool waiting;                   /* in the wait queue */
    char message[128];
    pthread_cond_t cond;
};

/* ---- sequence slots ----------------------------------------------------------------------- */

enum seq_state {
    SEQ_FREE,     /* no request */
    SEQ_PREFILL,  /* prompt rows still to send */
    SEQ_READY,    /* has its last token back: a decode row may be sent */
    SEQ_WAIT,     /* its token-producing row is in flight */
    SEQ_ENDING,   /* finished or cancelled: FREE must be sent once nothing is in flight */
};

struct seq {
    enum seq_state state;
    struct kvr_bridge_stream *stream; /* NULL once the consumer released it */
    uint32_t n_prefilled;             /* prompt rows sent */
    int32_t next_token;               /* SEQ_READY: input of the next decode row */
    uint32_t inflight;                /* in-flight batches containing this sequence */
    uint32_t kv_blocks;               /* reserved at admission */
    bool opened;                      /* OPEN has been sent */
    bool decoding;                    /* its first token has come back */
    bool cancelled;
    /* Recovery (recover()): the prefill is the prompt and then the n_replay tokens it had
     * generated; REPLAY records restore the tail's sampler before its last chunk. */
    uint32_t n_replay;
    uint32_t replay_ids_sent;         /* penalty-window ids sent so far (replay_window()) */
    bool replay_pending;              /* REPLAY records still to send: no last chunk yet */
    uint64_t held_since;              /* when a ring failure stopped it; 0 = not held */
};

struct batch {
    uint64_t id;
    uint64_t sent_ns;
    uint32_t n_ctrl, n_segs, n_rows;
    double pairs;                     /* attention pairs (costmodel.h) */
    bool mixed;                       /* decode rows and prefill rows together */
    struct kvr_wire_ctrl *ctrl;       /* [max_ctrl] */
    struct kvr_seg *segs;             /* [row_width] */
    int32_t *tokens;                  /* [row_width] */
};

struct kvr_bridge {
    struct kvr_plan plan;
    struct kvr_bridge_config cfg;
    struct kvr_wire_limits head_limits; /* what stage 0 accepts */
    struct kvr_wire_limits tail_limits; /* what we accept from the tail */

    pthread_mutex_t lock;
    pthread_cond_t up_cond;
    /* kvr_bridge_wait_any: a count of stream events, and its waiters. */
    uint64_t n_events;
    uint32_t any_waiters;
    pthread_cond_t any_cond;
    struct seq *seqs;                 /* [max_seqs] */
    struct kvr_bridge_stream **waitq; /* [max_waiting] FIFO of admitted, slotless requests */
    uint32_t wq_head, wq_count, max_waiting;
    uint32_t kv_used;                 /* blocks reserved per stage */
    uint32_t n_running;

    /* In-flight window: a FIFO of batches, oldest first. */
    struct batch *batches;            /* [microbatches] */
    uint32_t bf_head, n_inflight;
    uint64_t next_batch_id;
    uint64_t discard_below;           /* results of batches older than this are stale */
    bool free_all;                    /* the next batch frees every slot in every stage */
    uint64_t hold_start_ns;           /* when the current outage began holding sequences */

    /* Links, owned by the ring thread. */
    int listen_fd;
    struct kvr_link head, tail;
    bool have_head, have_tail;
    uint32_t head_credits;            /* frames stage 0 has room for (credit.h) */
    /* Up only once a batch has come back through every stage after the links connected:
     * the bridge's two links can be up before the links between stages are, and a stage
     * with no downstream drops what it gets. */
    atomic_bool ring_up;
    int wake_pipe[2];
    atomic_bool stop;
    pthread_t thread;
    bool thread_started;

    /* Telemetry. */
    struct kvr_bridge_stats stats;
    uint64_t win_start_ns;
    uint64_t win_held[KVR_PLAN_MAX_STAGES], win_starved[KVR_PLAN_MAX_STAGES],
        win_blocked[KVR_PLAN_MAX_STAGES], win_tokens;
    struct kvr_cost_model cost;       /* batch costs learnt from timing records */
    struct kvr_calib calib_first;     /* actual / predicted first-token time */
    struct kvr_calib calib_period;    /* actual / predicted gap between tokens */
    struct kvr_calib calib_mixed;     /* actual / predicted time of batches with prefill
                                         added to decode rows: keeps chunking honest */
    double *admit_scratch;            /* [max_seqs] admission's working memory */
};

static void wake(struct kvr_bridge *b)
{
    char c = 1;
    ssize_t n = write(b->wake_pipe[1], &c, 1);
    (void)n; /* a full pipe already means "wake up" */
}

const char *kvr_bridge_refusal_name(enum kvr_bridge_refusal_reason reason)
{
    static const char *const names[KVR_REFUSE_REASON_COUNT] = {
        "none", "first_token_budget", "total_budget", "kv_full", "queue_full", "too_long",
        "ring_down"};
    return (unsigned)reason < KVR_REFUSE_REASON_COUNT ? names[reason] : "unknown";
}

/* A stream has something new: wake kvr_bridge_wait_any. Caller holds b->lock. */
static void note_event(struct kvr_bridge *b)
{
    b->n_events++;
    if (b->any_waiters)
        pthread_cond_broadcast(&b->any_cond);
}

/* Queue a token (or the end) for the consumer. Caller holds b->lock. */
static void stream_push(struct kvr_bridge_stream *s, int32_t token, float logprob, bool eog,
                        uint64_t now)
{
    uint32_t cap = s->req.max_tokens;
    if (s->ev_count < cap) {
        s->events[(s->ev_head + s->ev_count) % cap] =
            (struct token_event){token, logprob, eog, now};
        s->ev_count++;
    }
    pthread_cond_signal(&s->cond);
    note_event(s->b);
}

static void stream_end(struct kvr_bridge_stream *s, enum kvr_bridge_finish finish,
                       const char *message)
{
    if (s->finish != KVR_FINISH_NONE)
        return;
    s->finish = finish;
    if (message)
        snprintf(s->message, sizeof s->message, "%s", message);
    pthread_cond_signal(&s->cond);
    note_event(s->b);
}

static void stream_free(struct kvr_bridge_stream *s)
{
    pthread_cond_destroy(&s->cond);
    kvr_free(s->events);
    kvr_free(s->generated);
    kvr_free(s->prompt);
    kvr_free(s);
}

/* ---- slots and KV accounting --------------------------------------------------------------- */

static uint32_t blocks_for(const struct kvr_bridge *b, uint32_t n_tokens)
{
    return (n_tokens + b->plan.kv_block_tokens - 1) / b->plan.kv_block_tokens;
}

static int free_slot(const struct kvr_bridge *b)
{
    for (uint32_t i = 0; i < b->plan.max_seqs; i++)
        if (b->seqs[i].state == SEQ_FREE)
            return (int)i;
    return -1;
}

const double kvr_bridge_queue_bounds[KVR_BRIDGE_QUEUE_BUCKETS] = {
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0};

static void observe_queue_time(struct kvr_bridge *b, double secs)
{
    uint32_t i = 0;
    while (i < KVR_BRIDGE_QUEUE_BUCKETS && secs > kvr_bridge_queue_bounds[i])
        i++;
    b->stats.queue_hist[i]++;
    b->stats.queue_sum_s += secs;
    b->stats.queue_count++;
}

/* Give waiting requests a slot and their KV, oldest first, while both are available. */
static void start_waiting(struct kvr_bridge *b)
{
    while (b->wq_count > 0) {
        struct kvr_bridge_stream *s = b->waitq[b->wq_head];
        uint32_t need = blocks_for(b, s->req.n_prompt + s->req.max_tokens);
        int slot = free_slot(b);
        if (slot < 0 || b->kv_used + need > b->plan.kv_blocks)
            return;
        b->wq_head = (b->wq_head + 1) % b->max_waiting;
        b->wq_count--;
        s->waiting = false;
        struct seq *q = &b->seqs[slot];
        *q = (struct seq){.state = SEQ_PREFILL, .stream = s, .kv_blocks = need};
        s->seq = slot;
        observe_queue_time(b, (kvr_now_ns() - s->submit_ns) / 1e9);
        b->kv_used += need;
        b->n_running++;
    }
}

/* Take a request out of the wait queue, keeping the others' order. */
static void waitq_remove(struct kvr_bridge *b, struct kvr_bridge_stream *s)
{
    uint32_t kept = 0;
    for (uint32_t k = 0; k < b->wq_count; k++) {
        struct kvr_bridge_stream *w = b->waitq[(b->wq_head + k) % b->max_waiting];
        if (w != s)
            b->waitq[(b->wq_head + kept++) % b->max_waiting] = w;
    }
    b->wq_count = kept;
    s->waiting = false;
}

/* A sequence's request is over: stop producing, and free it in the ring once no batch that
 * contains it is still in flight. Caller holds b->lock. */
static void seq_end(struct kvr_bridge *b, uint32_t slot, enum kvr_bridge_finish finish,
                    const char *message)
{
    struct seq *q = &b->seqs[slot];
    if (q->state == SEQ_ENDING || q->state == SEQ_FREE)
        return;
    q->state = SEQ_ENDING;
    q->cancelled = finish == KVR_FINISH_CANCELLED;
    if (q->stream)
        stream_end(q->stream, finish, message);
}

/* The slot's FREE record has been built into a batch: the slot may be reused at once, as
 * the stages see that FREE before any later OPEN of the slot. */
static void seq_release(struct kvr_bridge *b, uint32_t slot)
{
    struct seq *q = &b->seqs[slot];
    b->kv_used -= q->kv_blocks;
    b->n_running--;
    if (q->stream) {
        q->stream->seq = -1;
        if (q->stream->released)
            stream_free(q->stream);
    }
    memset(q, 0, sizeof *q);
}

/* ---- the batch builder ---------------------------------------------------------------------- */

static uint64_t seq_deadline(const struct seq *q)
{
    return q->stream ? q->stream->deadline_ns : UINT64_MAX;
}

static void open_record(struct kvr_wire_ctrl *c, uint32_t slot,
                        const struct kvr_bridge_request *r)
{
    const struct kvr_sample_params *p = &r->sampling;
    *c = (struct kvr_wire_ctrl){
        .type = KVR_WIRE_CTRL_OPEN, .seq = slot,
        .flags = r->logprobs ? KVR_WIRE_OPEN_LOGPROBS : 0,
        .sampling = {.temperature = p->temperature > 0 ? p->temperature : 0,
                     .top_k = p->top_k > 0 ? p->top_k : 0, .top_p = p->top_p,
                     .min_p = p->min_p, .repeat_penalty = p->repeat_penalty,
                     .frequency_penalty = p->frequency_penalty,
                     .presence_penalty = p->presence_penalty,
                     .repeat_last_n = p->repeat_last_n, .seed = p->seed}};
}

/* Pick up to `quota` READY sequences, earliest deadline first, into order[]. */
static uint32_t pick_decodes(struct kvr_bridge *b, uint32_t quota, uint32_t *order)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < b->plan.max_seqs; i++) {
        if (b->seqs[i].state != SEQ_READY)
            continue;
        /* Insertion into a sorted prefix of length <= quota. */
        uint64_t d = seq_deadline(&b->seqs[i]);
        uint32_t at = n;
        while (at > 0 && seq_deadline(&b->seqs[order[at - 1]]) > d)
            at--;
        if (at >= quota)
            continue;
        uint32_t end = n < quota ? n : quota - 1;
        memmove(order + at + 1, order + at, (end - at) * sizeof *order);
        order[at] = i;
        if (n < quota)
            n++;
    }
    return n;
}

/* Mean context (positions) of the running sequences: what a decode row attends over. */
static double mean_context(const struct kvr_bridge *b)
{
    double sum = 0;
    uint32_t n = 0;
    for (uint32_t i = 0; i < b->plan.max_seqs; i++) {
        const struct seq *q = &b->seqs[i];
        if (q->state == SEQ_FREE || q->state == SEQ_ENDING || !q->stream)
            continue;
        sum += q->stream->req.n_prompt + q->stream->n_generated;
        n++;
    }
    return n ? sum / n : 0;
}

/* The most prefill rows (at most `max_n`, starting at position pos0) that a batch of shape
 * `cur` may take while the cost model predicts it stays within limit_ms; at least
 * MIN_PREFILL_ROWS so prompts always progress. limit_ms <= 0 means no limit. */
static uint32_t prefill_fit(const struct kvr_bridge *b, struct kvr_cost_shape cur,
                            double pos0, uint32_t max_n, double limit_ms)
{
    if (limit_ms <= 0 || max_n <= MIN_PREFILL_ROWS)
        return max_n;
    /* What such batches really took against what the model said: its mean and 1.5
     * standard deviations. A higher quantile starves prefill (at 3 sd a closed-loop load
     * of short prompts fell from 10 to 2.8 req/s); the mean alone let a 1,500-token prompt
     * raise the decoding streams' p99 gap 2.7x. 1.5 sd kept it at 1.4x for 5.7 req/s. */
    double sd = sqrt(b->calib_mixed.var);
    double f = b->calib_mixed.n >= 5 ? b->calib_mixed.mean + 1.5 * sd : 1.0;
    f = f > 1.0 ? f : 1.0;
    uint32_t lo = MIN_PREFILL_ROWS, hi = max_n;
    while (lo < hi) { /* the largest n whose predicted time fits */
        uint32_t mid = lo + (hi - lo + 1) / 2;
        struct kvr_cost_shape t = {cur.rows + mid, cur.pairs + kvr_cost_pairs(pos0, mid)};
        if (kvr_cost_batch_ms(&b->cost, t) * f <= limit_ms)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The time a batch that carries `decode` may take once prefill rows are added to it: within
 * PREFILL_SLOWDOWN of its decode-only time. 0 (no limit) without decode rows or before the
 * model has data. */
static double prefill_limit_ms(const struct kvr_bridge *b, struct kvr_cost_shape decode)
{
    if (decode.rows <= 0 || !kvr_cost_ready(&b->cost))
        return 0;
    return PREFILL_SLOWDOWN * kvr_cost_batch_ms(&b->cost, decode);
}

/* Rows from..from+n of a sequence's prefill: its prompt, then (after a recovery) the
 * tokens it had generated. */
static void prefill_tokens(const struct seq *q, uint32_t from, uint32_t n, int32_t *out)
{
    const struct kvr_bridge_stream *s = q->stream;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = from + k;
        out[k] = i < s->req.n_prompt ? s->prompt[i] : s->generated[i - s->req.n_prompt];
    }
}

/* How many of a recovering sequence's generated tokens the tail's penalty window must hold
 * again: the last ones, as many as the window keeps, if a penalty is on at all. */
static uint32_t replay_window(const struct seq *q)
{
    const struct kvr_sample_params *p = &q->stream->req.sampling;
    bool penalty = p->repeat_penalty != 1.0f || p->frequency_penalty != 0.0f ||
                   p->presence_penalty != 0.0f;
    if (!penalty || p->repeat_last_n == 0)
        return 0;
    return q->n_replay < KVR_SAMPLER_MAX_LAST_N ? q->n_replay : KVR_SAMPLER_MAX_LAST_N;
}

/* Append the REPLAY records of a re-opened sequence that fit in this batch, keeping room
 * for the OPEN records other sequences may still need. The first record carries the
 * draws: every sampled (non-greedy) token drew exactly one number (sampler.h). */
static void emit_replay(struct kvr_bridge *b, struct batch *bt, struct seq *q, uint32_t slot)
{
    const struct kvr_bridge_stream *s = q->stream;
    uint32_t n_ids = replay_window(q), first = q->n_replay - n_ids;
    while (q->replay_pending && bt->n_ctrl + b->plan.max_seqs < b->head_limits.max_ctrl) {
        struct kvr_wire_ctrl *c = &bt->ctrl[bt->n_ctrl++];
        *c = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_REPLAY, .seq = slot};
        if (q->replay_ids_sent == 0)
            c->replay.n_draws = s->req.sampling.temperature > 0 ? q->n_replay : 0;
        uint32_t k = n_ids - q->replay_ids_sent;
        k = k < KVR_WIRE_REPLAY_IDS ? k : KVR_WIRE_REPLAY_IDS;
        memcpy(c->replay.ids, s->generated + first + q->replay_ids_sent, k * sizeof(int32_t));
        c->replay.n_ids = k;
        q->replay_ids_sent += k;
        q->replay_pending = q->replay_ids_sent < n_ids;
    }
}

/* Build the next batch into `bt`. Returns false if there is nothing to send. Caller holds
 * b->lock. */
static bool build_batch(struct kvr_bridge *b, struct batch *bt, uint32_t *scratch)
{
    const struct kvr_plan *p = &b->plan;
    bt->n_ctrl = bt->n_segs = bt->n_rows = 0;
    bt->pairs = 0;
    bt->mixed = false;

    /* 0. After the ring (re)connects or loses a batch, the stages may hold state of
     * sequences the bridge has forgotten: free every slot before anything else. */
    if (b->free_all) {
        for (uint32_t i = 0; i < p->max_seqs; i++)
            bt->ctrl[bt->n_ctrl++] = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_FREE,
                                                            .seq = i};
        b->free_all = false;
    }
    /* Until that probe has come back through every stage, nothing else goes out: the
     * sequences held by recover() wait for a whole ring. */
    if (!atomic_load(&b->ring_up))
        return bt->n_ctrl > 0;

    /* 1. FREE (or CANCEL) for sequences that ended and have nothing in flight. */
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        struct seq *q = &b->seqs[i];
        if (q->state != SEQ_ENDING || q->inflight)
            continue;
        if (q->opened)
            bt->ctrl[bt->n_ctrl++] = (struct kvr_wire_ctrl){
                .type = q->cancelled ? KVR_WIRE_CTRL_CANCEL : KVR_WIRE_CTRL_FREE, .seq = i};
        seq_release(b, i);
    }
    start_waiting(b);

    /* 2. Decode rows, spread evenly over the batches in flight. */
    uint32_t n_decoding = 0;
    for (uint32_t i = 0; i < p->max_seqs; i++)
        if (b->seqs[i].decoding &&
            (b->seqs[i].state == SEQ_READY || b->seqs[i].state == SEQ_WAIT))
            n_decoding++;
    uint32_t quota = (n_decoding + p->microbatches - 1) / p->microbatches;
    quota = quota < p->row_width ? quota : p->row_width;
    uint32_t n_dec = pick_decodes(b, quota ? quota : 1, scratch);
    for (uint32_t k = 0; k < n_dec; k++) {
        uint32_t i = scratch[k];
        struct seq *q = &b->seqs[i];
        struct kvr_bridge_stream *s = q->stream;
        uint32_t pos = s->req.n_prompt + s->n_generated - 1;
        bt->segs[bt->n_segs++] = (struct kvr_seg){i, pos, 1,
                                                  KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
        bt->tokens[bt->n_rows++] = q->next_token;
        bt->pairs += kvr_cost_pairs(pos, 1);
        q->state = SEQ_WAIT;
        q->inflight++;
    }

    /* 3. Prefill chunks in what is left of the row width, earliest deadline first, but no
     * more rows than keep this batch within PREFILL_SLOWDOWN of its decode-only cost, so
     * a long prompt never stalls the streams that are decoding (chunked prefill). */
    double limit_ms = prefill_limit_ms(b, (struct kvr_cost_shape){bt->n_rows, bt->pairs});
    bool full = false;
    while (bt->n_rows < p->row_width && !full) {
        int best = -1;
        for (uint32_t i = 0; i < p->max_seqs; i++) {
            const struct seq *q = &b->seqs[i];
            if (q->state != SEQ_PREFILL)
                continue;
            bool in_batch = false;
            for (uint32_t j = 0; j < bt->n_segs && !in_batch; j++)
                in_batch = bt->segs[j].seq == i;
            if (!in_batch && (best < 0 || seq_deadline(q) < seq_deadline(&b->seqs[best])))
                best = (int)i;
        }
        if (best < 0)
            break;
        struct seq *q = &b->seqs[best];
        const struct kvr_bridge_request *r = &q->stream->req;
        if (!q->opened) {
            open_record(&bt->ctrl[bt->n_ctrl++], (uint32_t)best, r);
            q->opened = true;
        }
        emit_replay(b, bt, q, (uint32_t)best);
        uint32_t left = r->n_prompt + q->n_replay - q->n_prefilled, room = p->row_width - bt->n_rows;
        uint32_t n = prefill_fit(b, (struct kvr_cost_shape){bt->n_rows, bt->pairs},
                                 q->n_prefilled, left < room ? left : room, limit_ms);
        full = n < left; /* the batch is as heavy as it may be */
        if (q->replay_pending && n == left)
            n--; /* the tail must have its sampler back before the last chunk */
        if (n == 0)
            break; /* out of room for REPLAY records: the next batch goes on */
        bool last = n == left;
        bt->segs[bt->n_segs++] = (struct kvr_seg){
            (uint32_t)best, q->n_prefilled, n,
            KVR_SEG_PREFILL | (last ? KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN : 0)};
        prefill_tokens(q, q->n_prefilled, n, bt->tokens + bt->n_rows);
        bt->mixed = bt->mixed || limit_ms > 0;
        bt->n_rows += n;
        bt->pairs += kvr_cost_pairs(q->n_prefilled, n);
        q->n_prefilled += n;
        q->inflight++;
        if (last)
            q->state = SEQ_WAIT;
    }
    return bt->n_ctrl > 0 || bt->n_segs > 0;
}

/* ---- results ------------------------------------------------------------------------------ */


static void account_timings(struct kvr_bridge *b, const struct kvr_wire_frame *f)
{
    for (uint32_t i = 0; i < f->hdr.n_timings && i < KVR_PLAN_MAX_STAGES; i++) {
        const struct kvr_wire_timing *t = &f->timings[i];
        struct kvr_bridge_stage_stats *st = &b->stats.stage[t->stage];
        st->held_ns += t->held_ns;
        st->starved_ns += t->starved_ns;
        st->blocked_ns += t->blocked_ns;
        b->win_held[t->stage] += t->held_ns;
        b->win_starved[t->stage] += t->starved_ns;
        b->win_blocked[t->stage] += t->blocked_ns;
    }
    uint64_t now = kvr_now_ns();
    if (now - b->win_start_ns >= WINDOW_NS) {
        double span = (double)(now - b->win_start_ns);
        for (uint32_t i = 0; i < b->plan.n_stages; i++) {
            b->stats.stage[i].util = b->win_held[i] / span;
            b->stats.stage[i].starved_frac = b->win_starved[i] / span;
            b->stats.stage[i].blocked_frac = b->win_blocked[i] / span;
            b->win_held[i] = b->win_starved[i] = b->win_blocked[i] = 0;
        }
        b->stats.tokens_per_s = b->win_tokens / (span / 1e9);
        b->win_tokens = 0;
        b->win_start_ns = now;
    }
}

/* Apply a RESULT frame to the oldest in-flight batch. Caller holds b->lock. Returns false
 * if the frame does not match it (the ring lost or reordered a batch). */
static bool apply_result(struct kvr_bridge *b, const struct kvr_wire_frame *f,
                         struct kvr_err *err)
{
    if (f->hdr.batch_id < b->discard_below)
        return true; /* a batch given up for lost that came back after all */
    if (b->n_inflight == 0) {
        kvr_err_set(err, KVR_EPROTO, "result for batch %llu, but none is in flight",
                    (unsigned long long)f->hdr.batch_id);
        return false;
    }
    struct batch *bt = &b->batches[b->bf_head];
    if (f->hdr.batch_id != bt->id || f->hdr.n_segs != bt->n_segs) {
        kvr_err_set(err, KVR_EPROTO, "result for batch %llu, expected batch %llu",
                    (unsigned long long)f->hdr.batch_id, (unsigned long long)bt->id);
        return false;
    }
    uint64_t now = kvr_now_ns();
    double period_now = 0;
    if (kvr_cost_ready(&b->cost))
        period_now = kvr_cost_period_ms(&b->cost, b->n_running, mean_context(b),
                                        (struct kvr_cost_shape){0, 0});
    uint32_t r = 0;
    for (uint32_t i = 0; i < bt->n_segs; i++) {
        const struct kvr_seg *sg = &bt->segs[i];
        struct seq *q = &b->seqs[sg->seq];
        q->inflight--;
        if (sg->flags & KVR_SEG_PREFILL)
            b->stats.prompt_tokens += sg->n_tokens;
        if (!(sg->flags & KVR_SEG_WANTS_TOKEN))
            continue;
        const struct kvr_wire_result *res = &f->results[r++];
        if (q->state != SEQ_WAIT || !q->stream)
            continue; /* ended while in flight: the token is dropped */
        struct kvr_bridge_stream *s = q->stream;
        bool eog = (res->flags & KVR_WIRE_RESULT_EOG) != 0;
        /* A token that waited out a ring failure says nothing about the cost model's
         * predictions: it does not calibrate them. */
        bool was_held = q->held_since != 0;
        q->held_since = 0;
        s->generated[s->n_generated] = res->token; /* n_generated < max_tokens while running */
        s->n_generated++;
        if (!was_held && s->n_generated == 1 && s->pred_first_ms > 0)
            kvr_calib_observe(&b->calib_first,
                              (now - s->submit_ns) / 1e6 / s->pred_first_ms);
        else if (!was_held && s->n_generated > 1 && period_now > 0)
            kvr_calib_observe(&b->calib_period, (now - s->last_token_ns) / 1e6 / period_now);
        s->last_token_ns = now;
        b->stats.generated_tokens++;
        b->win_tokens++;
        stream_push(s, res->token, res->logprob, eog, now);
        if (s->n_generated >= s->req.max_tokens)
            seq_end(b, sg->seq, KVR_FINISH_LENGTH, NULL);
        else if (eog && !s->req.ignore_eos)
            seq_end(b, sg->seq, KVR_FINISH_STOP, NULL);
        else {
            q->state = SEQ_READY;
            q->decoding = true;
            q->next_token = res->token;
        }
    }
    double ms = (now - bt->sent_ns) / 1e6;
    if (kvr_log_enabled(KVR_LOG_DEBUG)) { /* the batch's trip, for tracing a ring by hand */
        char trip[KVR_PLAN_MAX_STAGES * 32] = "";
        size_t len = 0;
        for (uint32_t i = 0; i < f->hdr.n_timings && len < sizeof trip; i++)
            len += (size_t)snprintf(trip + len, sizeof trip - len, " %.2f/%.2f/%.2f",
                                    f->timings[i].starved_ns / 1e6,
                                    f->timings[i].blocked_ns / 1e6, f->timings[i].held_ns / 1e6);
        KVR_DEBUG("bridge: batch %llu, %u rows, round trip %.2f ms; per stage "
                  "starved/blocked/held ms:%s", (unsigned long long)bt->id, bt->n_rows, ms, trip);
    }
    b->stats.batch_ms_ema = b->stats.batch_ms_ema ? 0.9 * b->stats.batch_ms_ema + 0.1 * ms : ms;
    if (bt->n_segs > 0 && f->hdr.n_timings == b->plan.n_stages) {
        double held[KVR_PLAN_MAX_STAGES];
        for (uint32_t i = 0; i < f->hdr.n_timings; i++)
            held[i] = f->timings[i].held_ns / 1e6;
        struct kvr_cost_shape shape = {bt->n_rows, bt->pairs};
        if (bt->mixed && kvr_cost_ready(&b->cost)) {
            double worst = 0;
            for (uint32_t i = 0; i < f->hdr.n_timings; i++)
                worst = held[i] > worst ? held[i] : worst;
            kvr_calib_observe(&b->calib_mixed, worst / kvr_cost_batch_ms(&b->cost, shape));
        }
        kvr_cost_observe(&b->cost, shape, held, ms);
    }
    b->stats.batches++;
    /* The batch that brings the ring up carries each stage's wait since it started (the
     * ring was not taking work yet): it is not starvation, so it is not counted. */
    if (atomic_load(&b->ring_up))
        account_timings(b, f);
    b->bf_head = (b->bf_head + 1) % b->plan.microbatches;
    b->n_inflight--;
    if (!atomic_load(&b->ring_up)) {
        atomic_store(&b->ring_up, true);
        b->win_start_ns = now;
        pthread_cond_broadcast(&b->up_cond);
        KVR_INFO("bridge: ring up (%u stages, %u micro-batches in flight)", b->plan.n_stages,
                 b->plan.microbatches);
        if (b->hold_start_ns) {
            uint32_t n_held = 0;
            for (uint32_t i = 0; i < b->plan.max_seqs; i++)
                n_held += b->seqs[i].held_since != 0;
            KVR_WARN("bridge: ring whole again %.0f ms after it failed; re-prefilling %u held "
                     "sequences", (now - b->hold_start_ns) / 1e6, n_held);
            b->hold_start_ns = 0;
        }
    }
    return true;
}

/* The ring lost state (a link dropped, a stage dropped its sequences, or a batch never
 * came back): hold every running sequence and start it over once the ring is whole again,
 * from its prompt plus the tokens it had already produced (DESIGN.md 8). Batch invariance
 * makes that prefill compute what the lost decodes would have, and REPLAY records put the
 * tail's sampler back, so the continuation is exactly the text it would have been. The
 * window is emptied, and until a free-all probe comes back only probes go out. Caller
 * holds b->lock. */
static void recover(struct kvr_bridge *b, const char *why)
{
    uint64_t now = kvr_now_ns();
    uint32_t n_held = 0;
    for (uint32_t i = 0; i < b->plan.max_seqs; i++) {
        struct seq *q = &b->seqs[i];
        if (q->state == SEQ_FREE)
            continue;
        q->inflight = 0;
        q->opened = false; /* the probe frees it in every stage */
        if (q->state == SEQ_ENDING) {
            seq_release(b, i);
            continue;
        }
        q->state = SEQ_PREFILL;
        q->n_prefilled = 0;
        q->decoding = false;
        q->n_replay = q->stream->n_generated;
        q->replay_ids_sent = 0;
        q->replay_pending = q->n_replay > 0 && (q->stream->req.sampling.temperature > 0 ||
                                                replay_window(q) > 0);
        if (!q->held_since)
            q->held_since = now;
        n_held++;
    }
    b->n_inflight = 0;
    b->bf_head = 0;
    b->discard_below = b->next_batch_id;
    b->free_all = true;
    if (n_held && (!b->hold_start_ns || atomic_load(&b->ring_up)))
        KVR_WARN("bridge: %s: holding %u sequences until the ring is whole again", why, n_held);
    else
        KVR_DEBUG("bridge: %s (%u sequences held)", why, n_held);
    if (n_held && !b->hold_start_ns)
        b->hold_start_ns = now;
    atomic_store(&b->ring_up, false);
}

/* A held request that cannot finish within its budget, or whose ring stays broken for
 * HOLD_MAX_MS, ends with an explicit error: nothing waits forever. Caller holds b->lock. */
static void expire_held(struct kvr_bridge *b)
{
    uint64_t now = kvr_now_ns();
    for (uint32_t i = 0; i < b->plan.max_seqs; i++) {
        struct seq *q = &b->seqs[i];
        if (!q->held_since || q->state == SEQ_FREE || q->state == SEQ_ENDING)
            continue;
        const struct kvr_bridge_stream *s = q->stream;
        if (s->req.total_ms && now >= s->submit_ns + (uint64_t)s->req.total_ms * 1000000ull)
            seq_end(b, i, KVR_FINISH_ERROR,
                    "the ring failed and did not recover within the request's budget");
        else if (now - q->held_since >= (uint64_t)HOLD_MAX_MS * 1000000ull)
            seq_end(b, i, KVR_FINISH_ERROR, "the ring failed and did not recover within 30 s");
    }
}

/* The ring broke: every running request ends with an error (nothing is dropped silently),
 * and the window is emptied. Caller holds b->lock. */
static void fail_running(struct kvr_bridge *b, const char *why)
{
    for (uint32_t i = 0; i < b->plan.max_seqs; i++) {
        struct seq *q = &b->seqs[i];
        if (q->state == SEQ_FREE)
            continue;
        if (q->stream)
            stream_end(q->stream, KVR_FINISH_ERROR, why);
        q->inflight = 0;
        q->opened = false; /* the stages dropped every sequence with the link */
        q->state = SEQ_ENDING;
        seq_release(b, i);
    }
    b->n_inflight = 0;
    b->bf_head = 0;
    b->discard_below = b->next_batch_id;
    b->free_all = true;
}

/* ---- links ---------------------------------------------------------------------------------- */

static void ring_down(struct kvr_bridge *b, const char *why)
{
    if (atomic_load(&b->ring_up))
        KVR_WARN("bridge: ring down: %s", why);
    atomic_store(&b->ring_up, false);
    if (b->have_head)
        kvr_link_fini(&b->head);
    if (b->have_tail)
        kvr_link_fini(&b->tail);
    b->have_head = b->have_tail = false;
    pthread_mutex_lock(&b->lock);
    recover(b, why);
    pthread_mutex_unlock(&b->lock);
}

/* Bring both links up: accept the tail, dial the head. Called by the ring thread while the
 * ring is down; returns quickly either way. */
static void try_connect(struct kvr_bridge *b)
{
    struct kvr_err err = {0};
    if (!b->have_tail) {
        int fd;
        char peer[KVR_NET_PEER_BYTES];
        if (kvr_net_accept(b->listen_fd, kvr_net_deadline(POLL_MS), &fd, peer, sizeof peer,
                           &err) == 0) {
            if (kvr_link_init(&b->tail, fd, peer, &b->tail_limits, KVR_LINK_RECV, &err) == 0 &&
                kvr_link_handshake_server(&b->tail, &b->plan, KVR_AUTH_ROLE_BRIDGE, 0,
                                          HANDSHAKE_MS, &err) == 0) {
                b->have_tail = true;
                KVR_INFO("bridge: tail connected from %s", peer);
            } else {
                KVR_WARN("bridge: refused connection from %s: %s", peer, err.msg);
                kvr_link_fini(&b->tail);
            }
        }
    }
    if (!b->have_head) {
        int fd;
        const char *addr = b->plan.stages[0].addr;
        if (kvr_net_connect(addr, kvr_net_deadline(500), &fd, &err) == 0) {
            if (kvr_link_init(&b->head, fd, addr, &b->head_limits, KVR_LINK_SEND, &err) == 0 &&
                kvr_link_handshake_client(&b->head, &b->plan, KVR_AUTH_ROLE_BRIDGE, 0,
                                          HANDSHAKE_MS, &err) == 0) {
                b->have_head = true;
                KVR_INFO("bridge: head %s connected", addr);
            } else {
                KVR_WARN("bridge: head %s: %s", addr, err.msg);
                kvr_link_fini(&b->head);
                kvr_sleep_ns(200 * 1000000ull);
            }
        } else {
            kvr_sleep_ns(POLL_MS * 1000000ull);
        }
    }
    if (b->have_head && b->have_tail) {
        b->head_credits = 0;
        if (kvr_credit_grant(b->tail.fd, TAIL_CREDITS)) {
            ring_down(b, "the tail went away");
            return;
        }
        /* The FREE-all batch doubles as the probe: its result marks the ring up. */
        pthread_mutex_lock(&b->lock);
        b->free_all = true;
        pthread_mutex_unlock(&b->lock);
        KVR_INFO("bridge: links up; waiting for a batch to go round the ring");
    }
}

static int send_batch(struct kvr_bridge *b, struct batch *bt, struct kvr_err *err)
{
    struct kvr_wire_msg msg = {
        .type = KVR_WIRE_BATCH, .batch_id = bt->id, .ctrl = bt->ctrl, .n_ctrl = bt->n_ctrl,
        .segs = bt->segs, .n_segs = bt->n_segs, .payload = KVR_WIRE_PAYLOAD_TOKENS,
        .payload_data = bt->tokens, .payload_bytes = (size_t)bt->n_rows * sizeof(int32_t)};
    return kvr_link_send(&b->head, &msg, kvr_net_deadline(RING_TIMEOUT_MS), err);
}

/* ---- the ring thread ------------------------------------------------------------------------ */

static void *ring_main(void *arg)
{
    struct kvr_bridge *b = arg;
    uint32_t *scratch = kvr_calloc(b->plan.max_seqs + 1, sizeof *scratch);
    while (!atomic_load(&b->stop)) {
        if (!atomic_load(&b->ring_up)) {
            pthread_mutex_lock(&b->lock);
            expire_held(b);
            pthread_mutex_unlock(&b->lock);
        }
        if (!b->have_head || !b->have_tail) {
            try_connect(b);
            continue;
        }
        /* Fill the window. */
        struct kvr_err err = {0};
        for (;;) {
            pthread_mutex_lock(&b->lock);
            struct batch *bt = NULL;
            if (b->n_inflight < b->plan.microbatches && b->head_credits > 0) {
                uint32_t slot = (b->bf_head + b->n_inflight) % b->plan.microbatches;
                bt = &b->batches[slot];
                if (build_batch(b, bt, scratch)) {
                    bt->id = b->next_batch_id++;
                    bt->sent_ns = kvr_now_ns();
                    b->n_inflight++;
                } else {
                    bt = NULL;
                }
            }
            pthread_mutex_unlock(&b->lock);
            if (!bt)
                break;
            b->head_credits--;
            if (send_batch(b, bt, &err)) {
                ring_down(b, err.msg);
                break;
            }
        }
        if (!b->have_head || !b->have_tail)
            continue; /* ring_down */
        /* Wait for a result, a credit from the head, or a wake-up. */
        struct pollfd pfd[3] = {{b->tail.fd, POLLIN, 0}, {b->wake_pipe[0], POLLIN, 0},
                                {b->head.fd, POLLIN, 0}};
        int n = poll(pfd, 3, POLL_MS);
        if (n > 0 && (pfd[1].revents & POLLIN)) {
            char buf[64];
            while (read(b->wake_pipe[0], buf, sizeof buf) > 0) {
            }
        }
        if (n > 0 && (pfd[2].revents & (POLLIN | POLLHUP | POLLERR))) {
            int rc = kvr_credit_take(b->head.fd, &b->head_credits, 0);
            if (rc) {
                ring_down(b, rc == KVR_ECLOSED ? "the head closed its link"
                                               : "the head sent garbage instead of credits");
                continue;
            }
        }
        if (n > 0 && (pfd[0].revents & (POLLIN | POLLHUP | POLLERR))) {
            const struct kvr_wire_frame *f;
            int rc = kvr_link_recv(&b->tail, kvr_net_deadline(POLL_MS), &f, &err);
            if (rc == KVR_ETIMEDOUT)
                continue;
            if (rc) {
                ring_down(b, rc == KVR_ECLOSED ? "the tail closed its link" : err.msg);
                continue;
            }
            if (f->hdr.type == KVR_WIRE_GOODBYE) {
                ring_down(b, "the tail said goodbye");
                continue;
            }
            if (f->hdr.type == KVR_WIRE_RESET) {
                /* A stage dropped its sequences (stage.h): everything sent before this
                 * arrived may have met the empty stage. A failed batch we have already
                 * given up on changes nothing. */
                pthread_mutex_lock(&b->lock);
                if (f->hdr.batch_id == KVR_WIRE_RESET_LINK || f->hdr.batch_id >= b->discard_below) {
                    char why[96];
                    snprintf(why, sizeof why, "stage %u dropped its sequences", f->hdr.arg);
                    recover(b, why);
                }
                pthread_mutex_unlock(&b->lock);
                continue;
            }
            if (f->hdr.type != KVR_WIRE_RESULT)
                continue;
            pthread_mutex_lock(&b->lock);
            bool ok = apply_result(b, f, &err);
            pthread_mutex_unlock(&b->lock);
            if (!ok)
                ring_down(b, err.msg);
            else if (kvr_credit_grant(b->tail.fd, 1))
                ring_down(b, "the tail went away");
            continue;
        }
        /* A batch that never comes back means a stage died without closing its links. */
        bool up = atomic_load(&b->ring_up);
        pthread_mutex_lock(&b->lock);
        bool late = b->n_inflight > 0 &&
                    kvr_now_ns() - b->batches[b->bf_head].sent_ns >
                        (uint64_t)(up ? RING_TIMEOUT_MS : PROBE_MS) * 1000000ull;
        if (late && !up) {
            /* A stage had no downstream (yet) and dropped the probe: send another. Only
             * probes are in flight while the ring is not up. */
            recover(b, "the ring is not whole yet");
            late = false;
        }
        if (late) {
            /* A stage between head and tail hung or lost the batch without a word (a
             * RESET or a dropped link would have said so): start over with clean stages. */
            KVR_WARN("bridge: a batch did not come back within %d ms", RING_TIMEOUT_MS);
            recover(b, "a stage lost a batch");
        }
        pthread_mutex_unlock(&b->lock);
    }
    kvr_free(scratch);
    return NULL;
}

/* ---- public API ------------------------------------------------------------------------------ */

void kvr_bridge_stop(struct kvr_bridge *b)
{
    if (!b)
        return;
    atomic_store(&b->stop, true);
    if (b->thread_started) {
        wake(b);
        pthread_join(b->thread, NULL);
        b->thread_started = false;
    }
}

void kvr_bridge_destroy(struct kvr_bridge *b)
{
    if (!b)
        return;
    kvr_bridge_stop(b);
    if (b->have_head)
        kvr_link_fini(&b->head);
    if (b->have_tail)
        kvr_link_fini(&b->tail);
    if (b->seqs) {
        pthread_mutex_lock(&b->lock);
        fail_running(b, "the bridge is shutting down");
        while (b->wq_count > 0) {
            struct kvr_bridge_stream *s = b->waitq[b->wq_head];
            b->wq_head = (b->wq_head + 1) % b->max_waiting;
            b->wq_count--;
            s->waiting = false;
            stream_end(s, KVR_FINISH_ERROR, "the bridge is shutting down");
            if (s->released)
                stream_free(s);
        }
        pthread_mutex_unlock(&b->lock);
    }
    if (b->listen_fd >= 0)
        close(b->listen_fd);
    for (int i = 0; i < 2; i++)
        if (b->wake_pipe[i] >= 0)
            close(b->wake_pipe[i]);
    for (uint32_t i = 0; b->batches && i < b->plan.microbatches; i++) {
        kvr_free(b->batches[i].ctrl);
        kvr_free(b->batches[i].segs);
        kvr_free(b->batches[i].tokens);
    }
    kvr_free(b->batches);
    kvr_free(b->admit_scratch);
    kvr_free(b->seqs);
    kvr_free(b->waitq);
    pthread_mutex_destroy(&b->lock);
    pthread_cond_destroy(&b->up_cond);
    pthread_cond_destroy(&b->any_cond);
    kvr_plan_wipe(&b->plan);
    kvr_free(b);
}

int kvr_bridge_create(struct kvr_bridge **out, const struct kvr_bridge_config *cfg,
                      struct kvr_err *err)
{
    *out = NULL;
    struct kvr_bridge *b = kvr_calloc(1, sizeof *b);
    if (!b)
        return kvr_err_set(err, KVR_ENOMEM, "bridge: out of memory");
    b->plan = *cfg->plan;
    b->cfg = *cfg;
    b->cfg.plan = &b->plan;
    b->listen_fd = -1;
    b->wake_pipe[0] = b->wake_pipe[1] = -1;
    pthread_mutex_init(&b->lock, NULL);
    pthread_cond_init(&b->up_cond, NULL);
    pthread_cond_init(&b->any_cond, NULL);
    const struct kvr_plan *p = &b->plan;
    int rc;
    if ((rc = kvr_wire_limits_init(&b->head_limits, p, cfg->n_embd, cfg->n_vocab, 0, err)) ||
        (rc = kvr_wire_limits_init(&b->tail_limits, p, cfg->n_embd, cfg->n_vocab,
                                   KVR_WIRE_RECV_BRIDGE, err)))
        goto fail;
    b->max_waiting = cfg->max_waiting ? cfg->max_waiting : 4 * p->max_seqs;
    b->seqs = kvr_calloc(p->max_seqs, sizeof *b->seqs);
    b->waitq = kvr_calloc(b->max_waiting, sizeof *b->waitq);
    b->batches = kvr_calloc(p->microbatches, sizeof *b->batches);
    b->admit_scratch = kvr_calloc(p->max_seqs, sizeof *b->admit_scratch);
    if (!b->seqs || !b->waitq || !b->batches || !b->admit_scratch) {
        rc = kvr_err_set(err, KVR_ENOMEM, "bridge: out of memory");
        goto fail;
    }
    for (uint32_t i = 0; i < p->microbatches; i++) {
        struct batch *bt = &b->batches[i];
        bt->ctrl = kvr_calloc(b->head_limits.max_ctrl, sizeof *bt->ctrl);
        bt->segs = kvr_calloc(p->row_width, sizeof *bt->segs);
        bt->tokens = kvr_calloc(p->row_width, sizeof *bt->tokens);
        if (!bt->ctrl || !bt->segs || !bt->tokens) {
            rc = kvr_err_set(err, KVR_ENOMEM, "bridge: out of memory");
            goto fail;
        }
    }
    b->stats.n_stages = p->n_stages;
    b->stats.kv_blocks_total = p->kv_blocks;
    kvr_cost_init(&b->cost, p->n_stages, p->microbatches);
    if (pipe(b->wake_pipe) != 0) {
        rc = kvr_err_set(err, KVR_EIO, "bridge: pipe: %s", strerror(errno));
        goto fail;
    }
    fcntl(b->wake_pipe[0], F_SETFL, O_NONBLOCK);
    fcntl(b->wake_pipe[1], F_SETFL, O_NONBLOCK);
    if ((rc = kvr_net_listen(p->bridge_addr, 16, &b->listen_fd, NULL, err)))
        goto fail;
    if (pthread_create(&b->thread, NULL, ring_main, b) != 0) {
        rc = kvr_err_set(err, KVR_ENOMEM, "bridge: cannot start the ring thread");
        goto fail;
    }
    b->thread_started = true;
    *out = b;
    return KVR_OK;

fail:
    kvr_bridge_destroy(b);
    return rc;
}

bool kvr_bridge_ring_up(const struct kvr_bridge *b) { return atomic_load(&b->ring_up); }

bool kvr_bridge_wait_up(struct kvr_bridge *b, int timeout_ms)
{
    uint64_t deadline = kvr_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    while (!atomic_load(&b->ring_up) && kvr_now_ns() < deadline)
        kvr_sleep_ns(10 * 1000000ull);
    return atomic_load(&b->ring_up);
}

static int refuse(struct kvr_bridge *b, struct kvr_bridge_refusal *why,
                  enum kvr_bridge_refusal_reason reason, uint32_t retry_ms, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static int refuse(struct kvr_bridge *b, struct kvr_bridge_refusal *why,
                  enum kvr_bridge_refusal_reason reason, uint32_t retry_ms, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    why->reason = reason;
    why->retry_after_ms = retry_ms;
    vsnprintf(why->message, sizeof why->message, fmt, ap);
    va_end(ap);
    b->stats.refused[reason]++;
    return KVR_EAGAIN;
}

/* The least safety factor on a prediction: a late answer is worse than a refused one. */
#define ADMIT_MARGIN 1.1

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Admission (DESIGN.md 6). From the cost model: the new request's first token comes after
 * the prompt rows queued ahead of it (its own included) have gone through in batches of the
 * row width, less the decode rows every batch carries; its last token comes max_tokens - 1
 * token periods later, at the load it adds. It is refused if either misses its budget, or
 * if it would push a running request that is on time past its own deadline. */
static int admit(struct kvr_bridge *b, const struct kvr_bridge_request *req,
                 struct kvr_bridge_refusal *why, double *pred_first_ms)
{
    *pred_first_ms = 0;
    const struct kvr_plan *p = &b->plan;
    if ((uint64_t)req->n_prompt + req->max_tokens > p->n_ctx)
        return refuse(b, why, KVR_REFUSE_TOO_LONG, 0,
                      "prompt (%u tokens) + max_tokens (%u) exceed the context of %u",
                      req->n_prompt, req->max_tokens, p->n_ctx);
    if (!atomic_load(&b->ring_up))
        return refuse(b, why, KVR_REFUSE_RING_DOWN, 1000, "the ring is down");
    uint32_t need = blocks_for(b, req->n_prompt + req->max_tokens);
    if (need > p->kv_blocks)
        return refuse(b, why, KVR_REFUSE_KV_FULL, 0,
                      "needs %u KV blocks, the ring has %u", need, p->kv_blocks);
    if (b->wq_count >= b->max_waiting)
        return refuse(b, why, KVR_REFUSE_QUEUE_FULL, 1000,
                      "wait queue full (%u requests)", b->wq_count);
    if (!b->cfg.admission || !kvr_cost_ready(&b->cost))
        return KVR_OK;
    const struct kvr_cost_model *m = &b->cost;
    double W = p->microbatches;
    double n_before = b->n_running + b->wq_count, n_after = n_before + 1;
    if (n_after > p->max_seqs)
        n_after = p->max_seqs;
    double ctx = mean_context(b);
    const struct kvr_cost_shape none = {0, 0};
    double period = kvr_cost_period_ms(m, n_after, ctx, none);

    /* Prompt rows ahead: the unsent prefill of running and waiting requests, and ours. They
     * go in the rows each batch may add to its decode rows (prefill_fit), taken here at the
     * middle of our prompt. */
    double rows_ahead = req->n_prompt;
    for (uint32_t i = 0; i < p->max_seqs; i++)
        if (b->seqs[i].state == SEQ_PREFILL && b->seqs[i].stream)
            rows_ahead += b->seqs[i].stream->req.n_prompt - b->seqs[i].n_prefilled;
    for (uint32_t k = 0; k < b->wq_count; k++)
        rows_ahead += b->waitq[(b->wq_head + k) % b->max_waiting]->req.n_prompt;
    double per = n_before / W;
    struct kvr_cost_shape decode = {per, per * (ctx + 1)};
    uint32_t width = p->row_width > (uint32_t)per + 1 ? p->row_width - (uint32_t)per : 1;
    double room = prefill_fit(b, decode, req->n_prompt / 2.0, width, prefill_limit_ms(b, decode));
    struct kvr_cost_shape full = {decode.rows + room,
                                  decode.pairs + kvr_cost_pairs(req->n_prompt / 2.0, room)};
    double n_prefill_batches = (double)(uint64_t)((rows_ahead + room - 1) / room);
    double t_full = kvr_cost_batch_ms(m, full);

    /* No free slot or KV: the requests waiting before us take the first slots that free
     * up, so we wait for the (waiting + 1)-th running request to end. */
    double wait_ms = 0;
    if (b->n_running + b->wq_count >= p->max_seqs || b->kv_used + need > p->kv_blocks) {
        double *left = b->admit_scratch;
        uint32_t n = 0;
        for (uint32_t i = 0; i < p->max_seqs; i++) {
            const struct seq *q = &b->seqs[i];
            if (q->state == SEQ_FREE || !q->stream)
                continue;
            left[n++] = ((double)q->stream->req.max_tokens - q->stream->n_generated) * period;
        }
        qsort(left, n, sizeof *left, cmp_double);
        uint32_t k = b->wq_count; /* ahead of us */
        if (n > 0) {
            /* Beyond the running ones, each further wave of max_seqs requests takes about
             * a whole answer. */
            double answer_ms = (double)req->max_tokens * period;
            wait_ms = k < n ? left[k]
                            : left[n - 1] + (double)(k - n + 1) / p->max_seqs * answer_ms;
        }
    }
    double f_first = kvr_calib_factor(&b->calib_first, ADMIT_MARGIN);
    double f_period = kvr_calib_factor(&b->calib_period, ADMIT_MARGIN);
    double raw_first = wait_ms + n_prefill_batches * t_full + kvr_cost_trip_ms(m, full);
    *pred_first_ms = raw_first;
    /* The client sees its first text one token late when that token is part of a
     * character (streams never split UTF-8): budget one more period. */
    double first_ms = f_first * raw_first + f_period * period;
    double total_ms = first_ms + f_period * (req->max_tokens - 1) * period;
    if (b->n_running == 0 && b->wq_count == 0) {
        /* An idle ring risks nobody, and a model that has never seen a batch of this shape
         * extrapolates pessimistically: refuse only what cannot be met even by an empty
         * batch's trip and one sequence's period, so the model always gets to learn. */
        first_ms = kvr_cost_trip_ms(m, none);
        total_ms = first_ms + (req->max_tokens - 1) * kvr_cost_period_ms(m, 1, 0, none);
    }
    if (req->first_token_ms && first_ms > req->first_token_ms)
        return refuse(b, why, KVR_REFUSE_FIRST_TOKEN_BUDGET,
                      (uint32_t)(first_ms - req->first_token_ms) + 1,
                      "would miss the first-token budget: estimated %.0f ms > %u ms",
                      first_ms, req->first_token_ms);
    if (req->total_ms && total_ms > req->total_ms)
        return refuse(b, why, KVR_REFUSE_TOTAL_BUDGET,
                      (uint32_t)(total_ms - req->total_ms) + 1,
                      "would miss the total budget: estimated %.0f ms > %u ms", total_ms,
                      req->total_ms);

    /* Running requests: our prompt's batches delay them, and every later token comes at
     * the slower period. Refuse if that makes one that is on time late. */
    double period_before = kvr_cost_period_ms(m, n_before > 0 ? n_before : 1, ctx, none);
    double delay = req->n_prompt / room * (t_full - kvr_cost_batch_ms(m, decode));
    uint64_t now = kvr_now_ns();
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        const struct seq *q = &b->seqs[i];
        const struct kvr_bridge_stream *s = q->stream;
        if (q->state == SEQ_FREE || q->state == SEQ_ENDING || !s || !s->req.total_ms)
            continue;
        double left_ms = (s->deadline_ns > now ? s->deadline_ns - now : 0) / 1e6;
        double togo = (double)s->req.max_tokens - s->n_generated;
        double on_time = f_period * togo * period_before;
        double with_us = f_period * (delay + togo * period);
        if (on_time <= left_ms && with_us > left_ms)
            return refuse(b, why, KVR_REFUSE_TOTAL_BUDGET, (uint32_t)(with_us - left_ms) + 1,
                          "would make a running request miss its budget (%.0f ms left, "
                          "%.0f ms needed with this one)", left_ms, with_us);
    }
    return KVR_OK;
}

int kvr_bridge_submit(struct kvr_bridge *b, const struct kvr_bridge_request *req,
                      struct kvr_bridge_stream **stream, struct kvr_bridge_refusal *why)
{
    *stream = NULL;
    memset(why, 0, sizeof *why);
    if (req->n_prompt == 0 || req->max_tokens == 0) {
        why->reason = KVR_REFUSE_TOO_LONG;
        snprintf(why->message, sizeof why->message, "empty prompt or max_tokens of 0");
        return KVR_EINVAL;
    }
    struct kvr_bridge_stream *s = kvr_calloc(1, sizeof *s);
    if (!s)
        return KVR_ENOMEM;
    s->prompt = kvr_malloc((size_t)req->n_prompt * sizeof(int32_t));
    s->events = kvr_calloc(req->max_tokens, sizeof *s->events);
    s->generated = kvr_calloc(req->max_tokens, sizeof *s->generated);
    if (!s->prompt || !s->events || !s->generated) {
        kvr_free(s->prompt);
        kvr_free(s->events);
        kvr_free(s->generated);
        kvr_free(s);
        return KVR_ENOMEM;
    }
    memcpy(s->prompt, req->prompt, (size_t)req->n_prompt * sizeof(int32_t));
    s->b = b;
    s->req = *req;
    s->req.prompt = s->prompt;
    s->seq = -1;
    s->submit_ns = kvr_now_ns();
    s->deadline_ns = req->total_ms ? s->submit_ns + (uint64_t)req->total_ms * 1000000ull
                     : req->first_token_ms
                         ? s->submit_ns + (uint64_t)req->first_token_ms * 1000000ull
                         : UINT64_MAX;
    pthread_cond_init(&s->cond, NULL);

    pthread_mutex_lock(&b->lock);
    int rc = admit(b, req, why, &s->pred_first_ms);
    if (rc == KVR_OK) {
        b->waitq[(b->wq_head + b->wq_count) % b->max_waiting] = s;
        b->wq_count++;
        s->waiting = true;
        b->stats.admitted++;
        start_waiting(b);
    }
    pthread_mutex_unlock(&b->lock);
    if (rc) {
        stream_free(s);
        return rc;
    }
    wake(b);
    *stream = s;
    return KVR_OK;
}

void kvr_bridge_wait_any(struct kvr_bridge *b, uint64_t *seen, int timeout_ms)
{
    struct timespec ts = kvr_deadline_after_ms(timeout_ms > 0 ? (uint32_t)timeout_ms : 0);
    pthread_mutex_lock(&b->lock);
    b->any_waiters++;
    while (b->n_events == *seen)
        if (pthread_cond_timedwait(&b->any_cond, &b->lock, &ts) == ETIMEDOUT)
            break;
    b->any_waiters--;
    *seen = b->n_events;
    pthread_mutex_unlock(&b->lock);
}

int kvr_bridge_next(struct kvr_bridge_stream *s, struct kvr_bridge_event *ev, int timeout_ms)
{
    struct kvr_bridge *b = s->b;
    struct timespec ts = kvr_deadline_after_ms(timeout_ms > 0 ? (uint32_t)timeout_ms : 0);
    memset(ev, 0, sizeof *ev);
    pthread_mutex_lock(&b->lock);
    while (timeout_ms > 0 && s->ev_count == 0 &&
           (s->finish == KVR_FINISH_NONE || s->finish_delivered))
        if (pthread_cond_timedwait(&s->cond, &b->lock, &ts) == ETIMEDOUT)
            break;
    int rc = KVR_OK;
    if (s->ev_count > 0) {
        const struct token_event *e = &s->events[s->ev_head];
        ev->has_token = true;
        ev->token = e->token;
        ev->logprob = e->logprob;
        ev->eog = e->eog;
        ev->t_ns = e->t_ns;
        s->ev_head = (s->ev_head + 1) % s->req.max_tokens;
        s->ev_count--;
        if (s->ev_count == 0 && s->finish != KVR_FINISH_NONE) {
            ev->finish = s->finish;
            s->finish_delivered = true;
        }
    } else if (s->finish != KVR_FINISH_NONE && !s->finish_delivered) {
        ev->finish = s->finish;
        ev->t_ns = kvr_now_ns();
        snprintf(ev->message, sizeof ev->message, "%s", s->message);
        s->finish_delivered = true;
    } else {
        rc = KVR_ETIMEDOUT;
    }
    pthread_mutex_unlock(&b->lock);
    return rc;
}

void kvr_bridge_cancel(struct kvr_bridge_stream *s)
{
    struct kvr_bridge *b = s->b;
    pthread_mutex_lock(&b->lock);
    s->cancel_requested = true;
    if (s->seq >= 0) {
        seq_end(b, (uint32_t)s->seq, KVR_FINISH_CANCELLED, NULL);
    } else {
        if (s->waiting)
            waitq_remove(b, s);
        stream_end(s, KVR_FINISH_CANCELLED, NULL);
    }
    pthread_mutex_unlock(&b->lock);
    wake(b);
}

void kvr_bridge_release(struct kvr_bridge_stream *s)
{
    if (!s)
        return;
    struct kvr_bridge *b = s->b;
    kvr_bridge_cancel(s);
    pthread_mutex_lock(&b->lock);
    s->released = true;
    bool in_use = s->seq >= 0; /* seq_release frees it once its FREE is sent */
    pthread_mutex_unlock(&b->lock);
    if (!in_use)
        stream_free(s);
}

void kvr_bridge_stats(struct kvr_bridge *b, struct kvr_bridge_stats *out)
{
    pthread_mutex_lock(&b->lock);
    *out = b->stats;
    out->ring_up = atomic_load(&b->ring_up);
    out->running = b->n_running;
    out->waiting = b->wq_count;
    out->kv_blocks_used = b->kv_used;
    pthread_mutex_unlock(&b->lock);
}

void kvr_bridge_stats_reset(struct kvr_bridge *b)
{
    pthread_mutex_lock(&b->lock);
    for (uint32_t i = 0; i < KVR_PLAN_MAX_STAGES; i++) {
        b->stats.stage[i].held_ns = b->stats.stage[i].starved_ns = 0;
        b->stats.stage[i].blocked_ns = 0;
    }
    b->stats.batches = b->stats.prompt_tokens = b->stats.generated_tokens = 0;
    pthread_mutex_unlock(&b->lock);
}
