/* sched.c - the bridge's scheduler (see sched.h).
 *
 * Reading order: streams (events to the caller), sequence slots and KV accounting,
 * admission, the batch builder, result handling, recovery, then the public inputs and
 * outputs. Every function takes the current time from its caller. */
#include "bridge/sched.h"

#include "bridge/kvpool.h"

#include "core/alloc.h"
#include "core/log.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    RING_TIMEOUT_MS = 15000, /* a batch that has not come back by then was lost */
    PROBE_MS = 500,          /* ... while checking a newly connected ring */
    HOLD_MAX_MS = 30000,     /* a sequence held this long by a broken ring fails */
    MIN_PREFILL_ROWS = 1,    /* prefill rows a batch with decodes still takes, to progress */
};

#define WINDOW_NS 2000000000ull /* telemetry fractions are over this window */
#define MS_NS 1000000ull

/* Prefill rows added to batches that carry decode rows may make the decoding streams' time
 * between tokens at most this factor longer (chunk_limit_ms). */
#define ITL_SLOWDOWN 1.8
/* The waiting share that scales it is a mean over the recent batches, not the count of the
 * moment: a request's chunks, and the gaps of the streams beside them, then follow the load
 * of the last several seconds, which admission knows, instead of the requests that happen
 * to arrive after it, which it cannot (fake ring, six seeds: the best any estimate made at
 * admission could do for first tokens went from 0.11-0.16 to 0.06-0.10, capacity the same;
 * bench/README "Ninth pass"). */
#define SHARE_TAU_MS 10000.0

/* The whole-answer estimate's time between tokens is the decoding streams' own lately:
 * every gap as it comes back, weighted by exp(-age / GAP_TAU_MS), and the cost model's
 * period worth GAP_PRIOR gaps (admit). */
#define GAP_TAU_MS 2000.0
#define GAP_PRIOR 5.0

/* First-token estimates are corrected by the recent mean error (outcome / estimate) of those
 * that expected about as many batches before the first token (eta_class): each weighted by
 * exp(-age / ETA_TAU_MS), beside no correction worth ETA_PRIOR of them, so that the errors of
 * a saturated spell do not follow into a light one. The refusal's safety factor stays the
 * high quantile over all estimates (calib_first). */
#define ETA_CLASSES 4
#define ETA_TAU_MS 10000.0
#define ETA_PRIOR 3.0

/* The least safety factor on a prediction: a late answer is worse than a refused one. */
#define ADMIT_MARGIN 1.1

enum seq_state {
    SEQ_FREE,    /* no request */
    SEQ_PREFILL, /* prompt rows still to send */
    SEQ_READY,   /* has its last token back: a decode row may be sent */
    SEQ_WAIT,    /* its token-producing row is in flight */
    SEQ_ENDING,  /* finished or cancelled: FREE must be sent once nothing is in flight */
};

struct seq {
    enum seq_state state;
    struct kvr_sched_req *r; /* the request, until the slot is released */
    uint32_t n_prefilled;    /* prefill rows sent */
    int32_t next_token;      /* SEQ_READY: input of the next decode row */
    uint32_t inflight;       /* in-flight batches containing this sequence */
    uint32_t kv_blocks;      /* blocks it holds in the pool: its whole table, or 0
                                while a recovered sequence waits for blocks */
    /* Prefix cache (prefix_*() below). Its table is s->tables[slot]: the first
     * n_cached / block_tokens entries were found in the cache, the rest allocated. */
    uint32_t n_cached;  /* prompt positions it did not compute */
    uint32_t n_named;   /* table entries published (or found) so far */
    uint64_t last_name; /* name of entry n_named - 1 (the seed before any) */
    bool opened;        /* OPEN has been sent */
    uint32_t bias_sent; /* logit-bias pairs sent since the OPEN (BIAS records);
                           the last prefill chunk waits for all of them */
    bool decoding;      /* its first token has come back */
    bool cancelled;
    /* Recovery (recover()): the prefill is the prompt and then the n_replay tokens it had
     * generated; REPLAY records restore the tail's sampler before its last chunk. */
    uint32_t n_replay;
    uint32_t replay_ids_sent; /* penalty-window ids sent so far (replay_window()) */
    bool replay_pending;      /* REPLAY records still to send: no last chunk yet */
    uint64_t held_since;      /* when a ring failure stopped it; 0 = not held */
};

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
    /* KV blocks (DESIGN.md 12): every stage has the plan's kv_blocks of kv_block_tokens,
     * and the bridge names each block a sequence uses (MAP records), so the pool is the
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
    /* Up only once a batch has come back through every stage after the links came up: the
     * bridge's two links can be up before the links between stages are, and a stage with
     * no downstream drops what it gets. */
    bool ring_up;
    uint64_t hold_start_ns; /* when the current outage began holding sequences */

    /* Telemetry. */
    struct kvr_sched_stats stats;
    uint64_t win_start_ns;
    uint64_t win_held[KVR_PLAN_MAX_STAGES], win_starved[KVR_PLAN_MAX_STAGES],
        win_blocked[KVR_PLAN_MAX_STAGES], win_tokens;
    struct kvr_cost_model cost;   /* batch costs learnt from timing records */
    struct kvr_calib calib_first; /* actual / predicted first-token time */
    /* ... by how many batches the estimate expected (eta_class), lately: its bias depends on
     * them (fake ring, outcome / estimate: median 0.98 under 10 batches, 1.09-1.12 at
     * 10-39, 0.85 at 60 or more, where the thin chunks it assumed thicken as prompts
     * arrive) and on the load, which the decay follows */
    struct kvr_recent first_eta[ETA_CLASSES];
    struct kvr_calib calib_mixed; /* actual / predicted time of batches with prefill
                                     added to decode rows: keeps chunking honest */
    struct kvr_calib calib_total; /* actual / estimated time of whole answers */
    double mix_rows, mix_pairs;   /* prefill rows (and their attention pairs) that batches
                                     with decode rows carried lately (moving averages) */
    struct kvr_recent gaps;       /* the streams' recent gaps between tokens, ms */
    struct kvr_recent share;      /* the waiting share (waiting_share) of recent batches */
    double *admit_scratch;        /* [max_seqs] admission's working memory */
    double *ends_scratch;         /* [max_seqs + max_waiting] ... and prefill_eta's */
    uint32_t *pick_scratch;       /* [max_seqs + 1] the decode picker's */
};

const double kvr_sched_queue_bounds[KVR_SCHED_QUEUE_BUCKETS] = {0.001, 0.005, 0.01, 0.025, 0.05,
                                                                0.1,   0.25,  0.5,  1.0,   5.0};

/* ---- streams ---------------------------------------------------------------------------- */

static void emit(struct kvr_sched *s, struct kvr_sched_req *r, struct kvr_sched_event ev)
{
    if (s->cfg.event)
        s->cfg.event(s->cfg.event_ctx, r, &ev);
}

static void emit_token(struct kvr_sched *s, struct kvr_sched_req *r, int32_t token, float logprob,
                       bool eog, uint64_t now)
{
    emit(s, r,
         (struct kvr_sched_event){.type = KVR_SCHED_EV_TOKEN,
                                  .token = token,
                                  .logprob = logprob,
                                  .eog = eog,
                                  .t_ns = now});
}

static void end_req(struct kvr_sched *s, struct kvr_sched_req *r, enum kvr_gen_finish finish,
                    const char *message, uint64_t now)
{
    if (r->ended)
        return;
    r->ended = true;
    emit(s, r,
         (struct kvr_sched_event){.type = KVR_SCHED_EV_END,
                                  .finish = finish,
                                  .message = message ? message : "",
                                  .t_ns = now});
}

static void detach(struct kvr_sched *s, struct kvr_sched_req *r, uint64_t now)
{
    r->seq = -1;
    r->waiting = false;
    emit(s, r, (struct kvr_sched_event){.type = KVR_SCHED_EV_DETACH, .t_ns = now});
}

/* ---- slots and KV accounting --------------------------------------------------------------- */

static uint32_t blocks_for(const struct kvr_sched *s, uint32_t n_tokens)
{
    return (n_tokens + s->plan->kv_block_tokens - 1) / s->plan->kv_block_tokens;
}

static uint32_t req_blocks(const struct kvr_sched *s, const struct kvr_sched_req *r)
{
    return blocks_for(s, r->req.n_prompt + r->req.max_tokens);
}

/* ---- the prefix cache -------------------------------------------------------------------- */

/* Blocks of a prompt found in the cache, into found[]: whole blocks only, and never the
 * whole prompt, so at least one token is computed and the last one has logits to sample. */
static uint32_t prefix_lookup(const struct kvr_sched *s, const int32_t *prompt, uint32_t n,
                              uint32_t *found)
{
    if (!s->cfg.prefix_cache || n < 2)
        return 0;
    uint32_t max = (n - 1) / s->plan->kv_block_tokens;
    max = max < s->max_blocks_per_seq ? max : s->max_blocks_per_seq;
    return kvr_kv_pool_lookup(&s->pool, s->cache_seed, prompt, n, max, found);
}

/* Of n_found blocks from prefix_lookup, how many are cached (unused, so they count as
 * available until this sequence takes them). */
static uint32_t cached_among(const struct kvr_sched *s, const uint32_t *found, uint32_t n)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++)
        k += s->pool.state[found[i]] == KVR_KV_BLOCK_CACHED;
    return k;
}

/* The blocks a request would take now: n_hit found in the cache, the rest new. Whether
 * the pool has room for the new ones (evicting cached blocks it does not use). */
static bool blocks_fit(const struct kvr_sched *s, const struct kvr_gen_request *req,
                       uint32_t *n_hit)
{
    uint32_t *found = s->found_scratch;
    *n_hit = prefix_lookup(s, req->prompt, req->n_prompt, found);
    uint32_t need = blocks_for(s, req->n_prompt + req->max_tokens) - *n_hit;
    return need <= kvr_kv_pool_available(&s->pool) - cached_among(s, found, *n_hit);
}

/* Give the sequence in `slot` its blocks: the cached prefix, then new ones (all or none).
 * Its prefill starts after the cached positions. */
static bool prefix_take(struct kvr_sched *s, uint32_t slot)
{
    struct seq *q = &s->seqs[slot];
    const struct kvr_sched_req *r = q->r;
    uint32_t n_hit, total = req_blocks(s, r);
    if (!blocks_fit(s, &r->req, &n_hit))
        return false;
    uint32_t *table = s->tables + (size_t)slot * s->max_blocks_per_seq;
    memcpy(table, s->found_scratch, n_hit * sizeof *table);
    kvr_kv_pool_acquire(&s->pool, table, n_hit);
    if (kvr_kv_pool_alloc(&s->pool, table + n_hit, total - n_hit)) { /* blocks_fit said so */
        kvr_kv_pool_release(&s->pool, table, n_hit);
        return false;
    }
    const uint32_t bt = s->plan->kv_block_tokens;
    q->kv_blocks = total;
    q->n_cached = n_hit * bt;
    q->n_prefilled = q->n_cached;
    q->n_named = n_hit;
    q->last_name = s->cache_seed;
    for (uint32_t b = 0; b < n_hit; b++)
        q->last_name = kvr_kv_block_hash(q->last_name, r->req.prompt + (size_t)b * bt, bt);
    return true;
}

static void prefix_drop(struct kvr_sched *s, uint32_t slot)
{
    struct seq *q = &s->seqs[slot];
    kvr_kv_pool_release(&s->pool, s->tables + (size_t)slot * s->max_blocks_per_seq, q->kv_blocks);
    q->kv_blocks = q->n_cached = q->n_named = 0;
}

static void prefill_tokens(const struct seq *q, uint32_t from, uint32_t n, int32_t *out);

/* The stages will have written positions [0, n_written) of the sequence in `slot` once the
 * batch being built has gone through: name its blocks that are now whole, so that a later
 * OPEN (in this batch or a later one: stages keep order) can map them. */
static void prefix_publish(struct kvr_sched *s, uint32_t slot, uint32_t n_written)
{
    struct seq *q = &s->seqs[slot];
    const uint32_t bt = s->plan->kv_block_tokens;
    if (!s->cfg.prefix_cache)
        return;
    const uint32_t *table = s->tables + (size_t)slot * s->max_blocks_per_seq;
    while ((q->n_named + 1) * bt <= n_written && q->n_named < q->kv_blocks) {
        prefill_tokens(q, q->n_named * bt, bt, s->tok_scratch);
        uint64_t name = kvr_kv_block_hash(q->last_name, s->tok_scratch, bt);
        kvr_kv_pool_publish(&s->pool, table[q->n_named], q->last_name, name, s->tok_scratch);
        q->last_name = name;
        q->n_named++;
    }
}

/* MAP records a sequence's OPEN needs: its whole table. */
static uint32_t map_records(const struct seq *q)
{
    return (q->kv_blocks + KVR_WIRE_MAP_IDS - 1) / KVR_WIRE_MAP_IDS;
}

static void emit_map(struct kvr_sched *s, struct batch *bt, const struct seq *q, uint32_t slot)
{
    const uint32_t *table = s->tables + (size_t)slot * s->max_blocks_per_seq;
    for (uint32_t first = 0; first < q->kv_blocks; first += KVR_WIRE_MAP_IDS) {
        uint32_t n = q->kv_blocks - first;
        n = n < KVR_WIRE_MAP_IDS ? n : KVR_WIRE_MAP_IDS;
        struct kvr_wire_ctrl *c = &bt->ctrl[bt->n_ctrl++];
        *c = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_MAP,
                                    .seq = slot,
                                    .map = {.n_cached = q->n_cached, .first = first, .n_ids = n}};
        memcpy(c->map.ids, table + first, n * sizeof *table);
    }
}

uint32_t kvr_sched_flush_cache(struct kvr_sched *s)
{
    return kvr_kv_pool_flush(&s->pool);
}

static int free_slot(const struct kvr_sched *s)
{
    for (uint32_t i = 0; i < s->plan->max_seqs; i++)
        if (s->seqs[i].state == SEQ_FREE)
            return (int)i;
    return -1;
}

static void observe_queue_time(struct kvr_sched *s, double secs)
{
    uint32_t i = 0;
    while (i < KVR_SCHED_QUEUE_BUCKETS && secs > kvr_sched_queue_bounds[i])
        i++;
    s->stats.queue_hist[i]++;
    s->stats.queue_sum_s += secs;
    s->stats.queue_count++;
}

/* Give waiting requests a slot and their KV, oldest first, while both are available. */
static void start_waiting(struct kvr_sched *s, uint64_t now)
{
    while (s->wq_count > 0) {
        struct kvr_sched_req *r = s->waitq[s->wq_head];
        int slot = free_slot(s);
        if (slot < 0)
            return;
        s->seqs[slot] = (struct seq){.state = SEQ_PREFILL, .r = r};
        if (!prefix_take(s, (uint32_t)slot)) {
            s->seqs[slot] = (struct seq){.state = SEQ_FREE};
            return;
        }
        s->wq_head = (s->wq_head + 1) % s->max_waiting;
        s->wq_count--;
        r->waiting = false;
        r->seq = slot;
        r->n_cached = s->seqs[slot].n_cached;
        s->stats.prefix_queries += r->req.n_prompt;
        s->stats.prefix_hits += r->n_cached;
        observe_queue_time(s, (now - r->submit_ns) / 1e9);
        s->n_running++;
    }
}

/* Take a request out of the wait queue, keeping the others' order. */
static void waitq_remove(struct kvr_sched *s, struct kvr_sched_req *r)
{
    uint32_t kept = 0;
    for (uint32_t k = 0; k < s->wq_count; k++) {
        struct kvr_sched_req *w = s->waitq[(s->wq_head + k) % s->max_waiting];
        if (w != r)
            s->waitq[(s->wq_head + kept++) % s->max_waiting] = w;
    }
    s->wq_count = kept;
    r->waiting = false;
}

/* A sequence's request is over: stop producing, and free it in the ring once no batch that
 * contains it is still in flight. */
static void seq_end(struct kvr_sched *s, uint32_t slot, enum kvr_gen_finish finish,
                    const char *message, uint64_t now)
{
    struct seq *q = &s->seqs[slot];
    if (q->state == SEQ_ENDING || q->state == SEQ_FREE)
        return;
    q->state = SEQ_ENDING;
    q->cancelled = finish == KVR_GEN_FINISH_CANCELLED;
    end_req(s, q->r, finish, message, now);
}

/* The slot's FREE record has been built into a batch (or the stages dropped everything):
 * the slot may be reused at once, as the stages see that FREE before any later OPEN. */
static void seq_release(struct kvr_sched *s, uint32_t slot, uint64_t now)
{
    struct seq *q = &s->seqs[slot];
    prefix_drop(s, slot);
    s->n_running--;
    struct kvr_sched_req *r = q->r;
    memset(q, 0, sizeof *q);
    detach(s, r, now);
}

/* ---- the batch builder ---------------------------------------------------------------------- */

static uint64_t seq_deadline(const struct seq *q)
{
    return q->r->deadline_ns;
}

static void open_record(struct kvr_wire_ctrl *c, uint32_t slot, const struct kvr_gen_request *r)
{
    const struct kvr_sample_params *p = &r->sampling;
    *c = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_OPEN,
                                .seq = slot,
                                .flags = r->logprobs ? KVR_WIRE_OPEN_LOGPROBS : 0,
                                .sampling = {.temperature = p->temperature > 0 ? p->temperature : 0,
                                             .top_k = p->top_k > 0 ? p->top_k : 0,
                                             .top_p = p->top_p,
                                             .min_p = p->min_p,
                                             .repeat_penalty = p->repeat_penalty,
                                             .frequency_penalty = p->frequency_penalty,
                                             .presence_penalty = p->presence_penalty,
                                             .repeat_last_n = p->repeat_last_n,
                                             .seed = p->seed}};
}

/* Pick up to `quota` READY sequences, earliest deadline first, into order[]. */
static uint32_t pick_decodes(const struct kvr_sched *s, uint32_t quota, uint32_t *order)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < s->plan->max_seqs; i++) {
        if (s->seqs[i].state != SEQ_READY)
            continue;
        /* Insertion into a sorted prefix of length <= quota. */
        uint64_t d = seq_deadline(&s->seqs[i]);
        uint32_t at = n;
        while (at > 0 && seq_deadline(&s->seqs[order[at - 1]]) > d)
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
static double mean_context(const struct kvr_sched *s)
{
    double sum = 0;
    uint32_t n = 0;
    for (uint32_t i = 0; i < s->plan->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state == SEQ_FREE || q->state == SEQ_ENDING)
            continue;
        sum += q->r->req.n_prompt + q->r->n_generated;
        n++;
    }
    return n ? sum / n : 0;
}

/* The safety factor on the rest of an answer, a sum of many gaps between tokens: how far
 * whole answers were from their raw estimate (the median), with the margin. One gap's own
 * error is no guide: a gap that met a prefill chunk is many times the mean one. */
static double gap_factor(const struct kvr_sched *s)
{
    double mid = s->calib_total.n >= 5 ? s->calib_total.mid : 1.0;
    return ADMIT_MARGIN * (mid > 1 ? mid : 1);
}

/* The gap between tokens of one sequence when n sequences decode: the cost model's, with
 * every batch carrying the prefill rows that batches with decodes carried lately (a
 * stream shares its batches with the prompts that arrive while it decodes). */
static double expected_period(const struct kvr_sched *s, double n, double ctx)
{
    return kvr_cost_period_ms(&s->cost, n, ctx, (struct kvr_cost_shape){s->mix_rows, s->mix_pairs});
}

/* The time between two tokens of a decoding stream if every batch in the window had shape
 * b (a long prompt's chunks go into each of them): a batch goes round the ring (trip), and
 * the slowest stage passes the window's batches one at a time. The stages' times are
 * multiplied by f (what mixed batches really took against the model), the hops are not. */
static double window_period_ms(const struct kvr_sched *s, struct kvr_cost_shape b, double f)
{
    double trip = s->cost.hop_ms, worst = 0;
    for (uint32_t i = 0; i < s->cost.n_stages; i++) {
        double t = f * kvr_cost_stage_ms(&s->cost, i, b);
        trip += t;
        worst = t > worst ? t : worst;
    }
    double pipe = s->plan->microbatches * worst;
    return trip > pipe ? trip : pipe;
}

/* The safety factor on a mixed batch's predicted time: what such batches really took
 * against what the model said, its mean and 1.5 standard deviations. A higher quantile
 * starves prefill (at 3 sd a closed-loop load of short prompts fell from 10 to 2.8 req/s);
 * the mean alone let a 1,500-token prompt raise the decoding streams' p99 gap 2.7x. */
static double mixed_factor(const struct kvr_sched *s)
{
    double sd = sqrt(s->calib_mixed.var);
    double f = s->calib_mixed.n >= 5 ? s->calib_mixed.mean + 1.5 * sd : 1.0;
    return f > 1.0 ? f : 1.0;
}

/* The most prefill rows (at most `max_n`, starting at position pos0) that a batch of shape
 * `cur` may take while the decoding streams' predicted time between tokens stays within
 * limit_ms (chunk_limit_ms); at least MIN_PREFILL_ROWS so prompts always progress.
 * limit_ms <= 0 means no limit. */
static uint32_t prefill_fit(const struct kvr_sched *s, struct kvr_cost_shape cur, double pos0,
                            uint32_t max_n, double limit_ms)
{
    if (limit_ms <= 0 || max_n <= MIN_PREFILL_ROWS)
        return max_n;
    double f = mixed_factor(s);
    uint32_t lo = MIN_PREFILL_ROWS, hi = max_n;
    while (lo < hi) { /* the largest n whose predicted period fits */
        uint32_t mid = lo + (hi - lo + 1) / 2;
        struct kvr_cost_shape t = {cur.rows + mid, cur.pairs + kvr_cost_pairs(pos0, mid)};
        if (window_period_ms(s, t, f) <= limit_ms)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The least time between tokens that the decoding streams can afford and still be on time:
 * for each with a total budget, what is left of it over the tokens it has to make, less
 * ADMIT_MARGIN. A stream that is late even with nothing beside it (it affords less than
 * `alone`, its decode-only gap) sets no limit: holding every prompt back would not save it.
 * INFINITY if none has a budget. */
static double affordable_gap_ms(const struct kvr_sched *s, double alone, uint64_t now)
{
    double limit = INFINITY;
    for (uint32_t i = 0; i < s->plan->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state == SEQ_FREE || q->state == SEQ_ENDING || !q->decoding)
            continue;
        const struct kvr_sched_req *r = q->r;
        if (!r->req.total_ms || r->n_generated >= r->req.max_tokens)
            continue;
        double left_ms = (r->deadline_ns > now ? r->deadline_ns - now : 0) / 1e6;
        double gap = left_ms / (r->req.max_tokens - r->n_generated) / ADMIT_MARGIN;
        if (gap >= alone && gap < limit)
            limit = gap;
    }
    return limit;
}

/* Prefill rows per ms that batches carrying `decode` get when each takes as many as keep
 * the streams' time between tokens within limit_ms. */
static double prefill_rate(const struct kvr_sched *s, struct kvr_cost_shape decode, double pos0,
                           double limit_ms)
{
    uint32_t width =
        s->plan->row_width > decode.rows + 1 ? s->plan->row_width - (uint32_t)decode.rows : 1;
    uint32_t n = prefill_fit(s, decode, pos0, width, limit_ms);
    struct kvr_cost_shape b = {decode.rows + n, decode.pairs + kvr_cost_pairs(pos0, n)};
    return s->plan->microbatches * n / window_period_ms(s, b, mixed_factor(s));
}

/* Whether a sequence still prefilling would miss its first-token budget at `rate` prefill
 * rows per ms but not at full batches (`full_rate`): the rows of the prompts ahead of it
 * (earliest deadline first) and its own, then the last batch's trip, against the time it
 * has left. A prompt that is late even at full batches is not worth stalling the streams. */
static bool prefill_urgent(const struct kvr_sched *s, double rate, double full_rate, double trip,
                           uint64_t now)
{
    for (uint32_t i = 0; i < s->plan->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state != SEQ_PREFILL || !q->r->req.first_token_ms)
            continue;
        double rows = 0;
        for (uint32_t j = 0; j < s->plan->max_seqs; j++) {
            const struct seq *o = &s->seqs[j];
            if (o->state == SEQ_PREFILL && seq_deadline(o) <= seq_deadline(q))
                rows += o->r->req.n_prompt + o->n_replay - o->n_prefilled;
        }
        uint64_t due = q->r->submit_ns + q->r->req.first_token_ms * MS_NS;
        double left_ms = (due > now ? due - now : 0) / 1e6 / ADMIT_MARGIN - trip;
        if (rows / rate > left_ms && rows / full_rate <= left_ms)
            return true;
    }
    return false;
}

/* Requests waiting for a first token over those decoding, when that is more than 1: a
 * prompt's delay counts as much as a stream's, so one long prompt beside eight streams gets
 * thin chunks, thirty prompts beside four streams nearly full batches. */
static double waiting_share(const struct kvr_sched *s)
{
    double n_first = s->wq_count;
    uint32_t n_dec = 0;
    for (uint32_t i = 0; i < s->plan->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        n_first += q->state == SEQ_PREFILL;
        n_dec += q->decoding && (q->state == SEQ_READY || q->state == SEQ_WAIT);
    }
    return n_dec > 0 && n_first > n_dec ? n_first / n_dec : 1.0;
}

/* The time between tokens that the decoding streams of a batch carrying `decode` may have
 * once prefill rows are added to it (chunked prefill): ITL_SLOWDOWN x their decode-only
 * time between tokens, times the waiting share of the recent batches (SHARE_TAU_MS), and
 * never more than the streams' budgets afford (affordable_gap_ms). Only a prompt that would
 * miss its first-token budget at that pace (prefill_urgent) may take more, up to what the
 * budgets afford: a request's first-token budget is as much a promise as the streams'
 * totals. So a long prompt without a pressing budget never stretches the gaps by more than
 * the factor, and a tight budget on a decoding stream keeps chunks shorter still. Admission
 * asks whether a request not yet counted would be urgent (`urgent_too`). 0 (no limit)
 * without decode rows or before the model has data. */
static double chunk_limit_ms(const struct kvr_sched *s, struct kvr_cost_shape decode,
                             bool urgent_too, uint64_t now)
{
    if (decode.rows <= 0 || !kvr_cost_ready(&s->cost))
        return 0;
    double alone = window_period_ms(s, decode, 1.0);
    double afford = affordable_gap_ms(s, alone, now);
    double share = kvr_recent_mean(&s->share, now, SHARE_TAU_MS, 1.0, 1.0);
    double cap = ITL_SLOWDOWN * share * alone;
    if (afford <= cap || urgent_too)
        return afford;
    double rate = prefill_rate(s, decode, 0, cap), full = prefill_rate(s, decode, 0, afford);
    return prefill_urgent(s, rate, full, alone, now) ? afford : cap;
}

/* Rows from..from+n of a sequence's prefill: its prompt, then (after a recovery) the
 * tokens it had generated. */
static void prefill_tokens(const struct seq *q, uint32_t from, uint32_t n, int32_t *out)
{
    const struct kvr_sched_req *r = q->r;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = from + k;
        out[k] = i < r->req.n_prompt ? r->req.prompt[i] : r->generated[i - r->req.n_prompt];
    }
}

/* How many of a recovering sequence's generated tokens the tail's penalty window must hold
 * again: the last ones, as many as the window keeps, if a penalty is on at all. */
static uint32_t replay_window(const struct seq *q)
{
    const struct kvr_sample_params *p = &q->r->req.sampling;
    bool penalty =
        p->repeat_penalty != 1.0f || p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f;
    if (!penalty || p->repeat_last_n == 0)
        return 0;
    return q->n_replay < KVR_SAMPLER_MAX_LAST_N ? q->n_replay : KVR_SAMPLER_MAX_LAST_N;
}

static bool bias_pending(const struct seq *q)
{
    return q->bias_sent < q->r->req.sampling.n_bias;
}

/* Append the BIAS records of a sequence just opened that fit in this batch, with the same
 * room kept as for REPLAY records. */
static void emit_bias(struct kvr_sched *s, struct batch *bt, struct seq *q, uint32_t slot)
{
    const struct kvr_sample_params *p = &q->r->req.sampling;
    while (bias_pending(q) && bt->n_ctrl + s->plan->max_seqs < s->cfg.max_ctrl) {
        struct kvr_wire_ctrl *c = &bt->ctrl[bt->n_ctrl++];
        *c = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_BIAS, .seq = slot};
        uint32_t k = p->n_bias - q->bias_sent;
        k = k < KVR_WIRE_BIAS_PAIRS ? k : KVR_WIRE_BIAS_PAIRS;
        for (uint32_t i = 0; i < k; i++) {
            c->bias.ids[i] = p->bias[q->bias_sent + i].id;
            c->bias.bias[i] = p->bias[q->bias_sent + i].bias;
        }
        c->bias.n = k;
        q->bias_sent += k;
    }
}

/* Append the REPLAY records of a re-opened sequence that fit in this batch, keeping room
 * for the OPEN records other sequences may still need. The first record carries the
 * draws: every sampled (non-greedy) token drew exactly one number (sampler.h). */
static void emit_replay(struct kvr_sched *s, struct batch *bt, struct seq *q, uint32_t slot)
{
    const struct kvr_sched_req *r = q->r;
    uint32_t n_ids = replay_window(q), first = q->n_replay - n_ids;
    while (q->replay_pending && bt->n_ctrl + s->plan->max_seqs < s->cfg.max_ctrl) {
        struct kvr_wire_ctrl *c = &bt->ctrl[bt->n_ctrl++];
        *c = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_REPLAY, .seq = slot};
        if (q->replay_ids_sent == 0)
            c->replay.n_draws = r->req.sampling.temperature > 0 ? q->n_replay : 0;
        uint32_t k = n_ids - q->replay_ids_sent;
        k = k < KVR_WIRE_REPLAY_IDS ? k : KVR_WIRE_REPLAY_IDS;
        memcpy(c->replay.ids, r->generated + first + q->replay_ids_sent, k * sizeof(int32_t));
        c->replay.n_ids = k;
        q->replay_ids_sent += k;
        q->replay_pending = q->replay_ids_sent < n_ids;
    }
}

/* Build the next batch into `bt`. Returns false if there is nothing to send. */
static bool build_batch(struct kvr_sched *s, struct batch *bt, uint64_t now)
{
    const struct kvr_plan *p = s->plan;
    bt->n_ctrl = bt->n_segs = bt->n_rows = 0;
    bt->pairs = 0;
    bt->mixed = false;

    /* 0. After the ring (re)connects or loses a batch, the stages may hold state of
     * sequences the bridge has forgotten: free every slot before anything else. */
    if (s->free_all) {
        for (uint32_t i = 0; i < p->max_seqs; i++)
            bt->ctrl[bt->n_ctrl++] = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_FREE, .seq = i};
        s->free_all = false;
    }
    /* Until that probe has come back through every stage, nothing else goes out: the
     * sequences held by recover() wait for a whole ring. */
    if (!s->ring_up)
        return bt->n_ctrl > 0;

    /* 1. FREE (or CANCEL) for sequences that ended and have nothing in flight. */
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        struct seq *q = &s->seqs[i];
        if (q->state != SEQ_ENDING || q->inflight)
            continue;
        if (q->opened)
            bt->ctrl[bt->n_ctrl++] = (struct kvr_wire_ctrl){
                .type = q->cancelled ? KVR_WIRE_CTRL_CANCEL : KVR_WIRE_CTRL_FREE, .seq = i};
        seq_release(s, i, now);
    }
    /* Sequences held by a recovery take their blocks again before new ones start. */
    for (uint32_t i = 0; i < p->max_seqs; i++)
        if (s->seqs[i].state == SEQ_PREFILL && s->seqs[i].kv_blocks == 0)
            (void)prefix_take(s, i);
    start_waiting(s, now);

    /* 2. Decode rows, spread evenly over the batches in flight. */
    uint32_t n_decoding = 0;
    double dec_ctx = 0; /* their mean context */
    for (uint32_t i = 0; i < p->max_seqs; i++)
        if (s->seqs[i].decoding &&
            (s->seqs[i].state == SEQ_READY || s->seqs[i].state == SEQ_WAIT)) {
            n_decoding++;
            dec_ctx += s->seqs[i].r->req.n_prompt + s->seqs[i].r->n_generated;
        }
    dec_ctx = n_decoding ? dec_ctx / n_decoding : 0;
    uint32_t quota = (n_decoding + p->microbatches - 1) / p->microbatches;
    quota = quota < p->row_width ? quota : p->row_width;
    uint32_t *order = s->pick_scratch;
    uint32_t n_dec = pick_decodes(s, quota ? quota : 1, order);
    for (uint32_t k = 0; k < n_dec; k++) {
        uint32_t i = order[k];
        struct seq *q = &s->seqs[i];
        const struct kvr_sched_req *r = q->r;
        uint32_t pos = r->req.n_prompt + r->n_generated - 1;
        bt->segs[bt->n_segs++] = (struct kvr_seg){i, pos, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
        bt->tokens[bt->n_rows++] = q->next_token;
        bt->pairs += kvr_cost_pairs(pos, 1);
        q->state = SEQ_WAIT;
        q->inflight++;
        prefix_publish(s, i, pos + 1);
    }

    /* 3. Prefill chunks in what is left of the row width, earliest deadline first, but no
     * more rows than keep the decoding streams' time between tokens within what
     * chunk_limit_ms allows, so a long prompt never stalls them (chunked prefill). */
    double dec_pairs = bt->pairs;
    /* A batch without decode rows while streams decode (fewer of them than batches in the
     * window, or all their rows in flight) delays them as much as one with their rows: the
     * streams' next batches queue behind it at every stage. It is limited as if it carried
     * their share of rows. */
    struct kvr_cost_shape dec_shape = {bt->n_rows, bt->pairs};
    if (n_dec == 0 && n_decoding > 0)
        dec_shape = (struct kvr_cost_shape){quota, quota * dec_ctx};
    if (n_decoding > 0)
        kvr_recent_add(&s->share, waiting_share(s), now, SHARE_TAU_MS);
    double limit_ms = chunk_limit_ms(s, dec_shape, false, now);
    bool full = false;
    while (bt->n_rows < p->row_width && !full) {
        int best = -1;
        for (uint32_t i = 0; i < p->max_seqs; i++) {
            const struct seq *q = &s->seqs[i];
            if (q->state != SEQ_PREFILL || q->kv_blocks == 0)
                continue;
            bool in_batch = false;
            for (uint32_t j = 0; j < bt->n_segs && !in_batch; j++)
                in_batch = bt->segs[j].seq == i;
            if (!in_batch && (best < 0 || seq_deadline(q) < seq_deadline(&s->seqs[best])))
                best = (int)i;
        }
        if (best < 0)
            break;
        struct seq *q = &s->seqs[best];
        const struct kvr_gen_request *rq = &q->r->req;
        if (!q->opened) {
            if (bt->n_ctrl + 1 + map_records(q) > s->cfg.max_ctrl)
                break; /* no room for its records: the next batch opens it */
            open_record(&bt->ctrl[bt->n_ctrl++], (uint32_t)best, rq);
            emit_map(s, bt, q, (uint32_t)best);
            q->opened = true;
            q->bias_sent = 0;
        }
        emit_bias(s, bt, q, (uint32_t)best);
        emit_replay(s, bt, q, (uint32_t)best);
        uint32_t left = rq->n_prompt + q->n_replay - q->n_prefilled;
        uint32_t room = p->row_width - bt->n_rows;
        uint32_t n = prefill_fit(s, (struct kvr_cost_shape){bt->n_rows, bt->pairs}, q->n_prefilled,
                                 left < room ? left : room, limit_ms);
        full = n < left; /* the batch is as heavy as it may be */
        if ((q->replay_pending || bias_pending(q)) && n == left)
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
        prefix_publish(s, (uint32_t)best, q->n_prefilled);
        if (last)
            q->state = SEQ_WAIT;
    }
    if (n_dec > 0) {
        s->mix_rows = 0.995 * s->mix_rows + 0.005 * (bt->n_rows - n_dec);
        s->mix_pairs = 0.995 * s->mix_pairs + 0.005 * (bt->pairs - dec_pairs);
    }
    return bt->n_ctrl > 0 || bt->n_segs > 0;
}

/* ---- results ------------------------------------------------------------------------------ */

/* The gauges of recent activity (utilisation, tokens/s) cover the last whole window. A
 * window is closed by the first result or tick after it ends, so with nothing coming back
 * (an idle ring) they fall to 0 within two windows instead of keeping their last value. */
static void roll_window(struct kvr_sched *s, uint64_t now)
{
    if (now - s->win_start_ns < WINDOW_NS)
        return;
    double span = (double)(now - s->win_start_ns);
    for (uint32_t i = 0; i < s->plan->n_stages; i++) {
        s->stats.stage[i].util = s->win_held[i] / span;
        s->stats.stage[i].starved_frac = s->win_starved[i] / span;
        s->stats.stage[i].blocked_frac = s->win_blocked[i] / span;
        s->win_held[i] = s->win_starved[i] = s->win_blocked[i] = 0;
    }
    s->stats.tokens_per_s = s->win_tokens / (span / 1e9);
    s->win_tokens = 0;
    s->win_start_ns = now;
}

/* Whether a gauge of recent activity is not 0 yet (tick must close windows until it is). */
static bool window_active(const struct kvr_sched *s)
{
    if (s->stats.tokens_per_s > 0 || s->win_tokens > 0)
        return true;
    for (uint32_t i = 0; i < s->plan->n_stages; i++)
        if (s->stats.stage[i].util > 0 || s->stats.stage[i].starved_frac > 0 ||
            s->stats.stage[i].blocked_frac > 0 || s->win_held[i] || s->win_starved[i] ||
            s->win_blocked[i])
            return true;
    return false;
}

static void account_timings(struct kvr_sched *s, const struct kvr_wire_frame *f, uint64_t now)
{
    for (uint32_t i = 0; i < f->hdr.n_timings && i < KVR_PLAN_MAX_STAGES; i++) {
        const struct kvr_wire_timing *t = &f->timings[i];
        struct kvr_sched_stage_stats *st = &s->stats.stage[t->stage];
        st->held_ns += t->held_ns;
        st->starved_ns += t->starved_ns;
        st->blocked_ns += t->blocked_ns;
        s->win_held[t->stage] += t->held_ns;
        s->win_starved[t->stage] += t->starved_ns;
        s->win_blocked[t->stage] += t->blocked_ns;
    }
    for (uint32_t i = 0; i < f->n_agent_timings; i++) { /* the decoder checked the index */
        const struct kvr_wire_timing *t = &f->agent_timings[i];
        struct kvr_sched_agent_stats *a = &s->stats.agent[t->stage & ~KVR_WIRE_TIMING_AGENT];
        a->held_ns += t->held_ns;
        a->starved_ns += t->starved_ns;
        a->blocked_ns += t->blocked_ns;
        a->pairs += t->pairs;
    }
    roll_window(s, now);
}

const double kvr_sched_ratio_bounds[KVR_SCHED_RATIO_BUCKETS] = {0.5,  0.75, 0.9, 1.0, 1.1,
                                                                1.25, 1.5,  2.0, 4.0};

static void observe_ratio(uint64_t *hist, double ratio)
{
    uint32_t i = 0;
    while (i < KVR_SCHED_RATIO_BUCKETS && ratio > kvr_sched_ratio_bounds[i])
        i++;
    hist[i]++;
}

/* How admission's estimate (est_first_ms, est_period_ms) compared with what happened, for
 * the first token and, at the last, the whole answer (predicted for the tokens it had).
 * A request held by a ring failure says nothing about the estimate. */
static void observe_estimate(struct kvr_sched *s, struct kvr_sched_req *r, bool last, uint64_t now)
{
    if (r->est_first_ms <= 0 || r->held_once)
        return;
    double actual = (now - r->submit_ns) / 1e6;
    if (r->n_generated == 1)
        observe_ratio(s->stats.first_ratio_hist, r->est_first_ms / (actual > 0 ? actual : 1e-3));
    if (last) {
        double pred = r->est_first_ms + (r->n_generated - 1) * r->est_period_ms;
        observe_ratio(s->stats.total_ratio_hist, pred / (actual > 0 ? actual : 1e-3));
        KVR_DEBUG("bridge: estimate %llu done: %u tokens, first token %.0f ms (estimated %.0f), "
                  "whole %.0f ms (estimated %.0f)",
                  (unsigned long long)r->submit_ns, r->n_generated,
                  (r->first_token_ns - r->submit_ns) / 1e6, r->est_first_ms, actual, pred);
        double raw = r->est_first_ms + (r->n_generated - 1) * r->pred_period_ms;
        kvr_calib_observe(&s->calib_total, actual / raw);
    }
}

/* One token came back for the sequence in `slot` (state SEQ_WAIT). */
static void take_token(struct kvr_sched *s, uint32_t slot, const struct kvr_wire_result *res,
                       uint64_t now)
{
    struct seq *q = &s->seqs[slot];
    struct kvr_sched_req *r = q->r;
    bool eog = (res->flags & KVR_WIRE_RESULT_EOG) != 0;
    /* A token that waited out a ring failure says nothing about the cost model's
     * predictions: it does not calibrate them. */
    bool was_held = q->held_since != 0;
    q->held_since = 0;
    r->generated[r->n_generated] = res->token; /* n_generated < max_tokens while running */
    r->n_generated++;
    if (!was_held && r->n_generated == 1 && r->pred_first_ms > 0 && r->check_first_ms > 0) {
        double ms = (now - r->submit_ns) / 1e6;
        kvr_calib_observe(&s->calib_first, ms / r->check_first_ms);
        kvr_recent_add(&s->first_eta[r->eta_class], ms / r->pred_first_ms, now, ETA_TAU_MS);
    } else if (!was_held && r->n_generated > 1) {
        /* Every gap as it happens, not whole answers when they end: those describe the load
         * of seconds ago (after a saturated spell the first answers of a light one were
         * estimated at its gaps, 1.3-2.3x too long). */
        kvr_recent_add(&s->gaps, (now - r->last_token_ns) / 1e6, now, GAP_TAU_MS);
    }
    r->held_once = r->held_once || was_held;
    r->last_token_ns = now;
    if (r->n_generated == 1)
        r->first_token_ns = now;
    s->stats.generated_tokens++;
    s->win_tokens++;
    emit_token(s, r, res->token, res->logprob, eog, now);
    bool last = r->n_generated >= r->req.max_tokens || (eog && !r->req.ignore_eos);
    observe_estimate(s, r, last, now);
    if (r->n_generated >= r->req.max_tokens)
        seq_end(s, slot, KVR_GEN_FINISH_LENGTH, NULL, now);
    else if (eog && !r->req.ignore_eos)
        seq_end(s, slot, KVR_GEN_FINISH_EOS, NULL, now);
    else {
        q->state = SEQ_READY;
        q->decoding = true;
        q->next_token = res->token;
    }
}

static void log_trip(const struct batch *bt, const struct kvr_wire_frame *f, double ms)
{
    char trip[KVR_PLAN_MAX_STAGES * 32] = "";
    size_t len = 0;
    for (uint32_t i = 0; i < f->hdr.n_timings && len < sizeof trip; i++)
        len += (size_t)snprintf(trip + len, sizeof trip - len, " %.2f/%.2f/%.2f",
                                f->timings[i].starved_ns / 1e6, f->timings[i].blocked_ns / 1e6,
                                f->timings[i].held_ns / 1e6);
    KVR_DEBUG("bridge: batch %llu, %u rows, round trip %.2f ms; per stage "
              "starved/blocked/held ms:%s",
              (unsigned long long)bt->id, bt->n_rows, ms, trip);
}

/* The ring's batch came back: learn its costs. */
static void observe_batch(struct kvr_sched *s, const struct batch *bt,
                          const struct kvr_wire_frame *f, uint64_t now)
{
    double ms = (now - bt->sent_ns) / 1e6;
    if (kvr_log_enabled(KVR_LOG_DEBUG)) /* the batch's trip, for tracing a ring by hand */
        log_trip(bt, f, ms);
    s->stats.batch_ms_ema = s->stats.batch_ms_ema ? 0.9 * s->stats.batch_ms_ema + 0.1 * ms : ms;
    if (bt->n_segs > 0 && f->hdr.n_timings == s->plan->n_stages) {
        double held[KVR_PLAN_MAX_STAGES];
        for (uint32_t i = 0; i < f->hdr.n_timings; i++)
            held[i] = f->timings[i].held_ns / 1e6;
        struct kvr_cost_shape shape = {bt->n_rows, bt->pairs};
        if (bt->mixed && kvr_cost_ready(&s->cost)) {
            double worst = 0;
            for (uint32_t i = 0; i < f->hdr.n_timings; i++)
                worst = held[i] > worst ? held[i] : worst;
            kvr_calib_observe(&s->calib_mixed, worst / kvr_cost_batch_ms(&s->cost, shape));
        }
        kvr_cost_observe(&s->cost, shape, held, ms);
    }
    s->stats.batches++;
}

static void became_up(struct kvr_sched *s, uint64_t now)
{
    s->ring_up = true;
    s->win_start_ns = now;
    KVR_INFO("bridge: ring up (%u stages, %u micro-batches in flight)", s->plan->n_stages,
             s->plan->microbatches);
    if (s->hold_start_ns) {
        uint32_t n_held = 0;
        for (uint32_t i = 0; i < s->plan->max_seqs; i++)
            n_held += s->seqs[i].held_since != 0;
        KVR_WARN("bridge: ring whole again %.0f ms after it failed; re-prefilling %u held "
                 "sequences",
                 (now - s->hold_start_ns) / 1e6, n_held);
        s->hold_start_ns = 0;
    }
}

int kvr_sched_result(struct kvr_sched *s, const struct kvr_wire_frame *f, uint64_t now,
                     struct kvr_err *err)
{
    if (f->hdr.batch_id < s->discard_below)
        return KVR_OK; /* a batch given up for lost that came back after all */
    if (s->n_inflight == 0)
        return kvr_err_set(err, KVR_EPROTO, "result for batch %llu, but none is in flight",
                           (unsigned long long)f->hdr.batch_id);
    struct batch *bt = &s->batches[s->bf_head];
    if (f->hdr.batch_id != bt->id || f->hdr.n_segs != bt->n_segs)
        return kvr_err_set(err, KVR_EPROTO, "result for batch %llu, expected batch %llu",
                           (unsigned long long)f->hdr.batch_id, (unsigned long long)bt->id);
    uint32_t k = 0;
    for (uint32_t i = 0; i < bt->n_segs; i++) {
        const struct kvr_seg *sg = &bt->segs[i];
        struct seq *q = &s->seqs[sg->seq];
        q->inflight--;
        if (sg->flags & KVR_SEG_PREFILL)
            s->stats.prompt_tokens += sg->n_tokens;
        if (!(sg->flags & KVR_SEG_WANTS_TOKEN))
            continue;
        const struct kvr_wire_result *res = &f->results[k++];
        if (q->state == SEQ_WAIT)
            take_token(s, sg->seq, res, now);
        /* else it ended while in flight: the token is dropped */
    }
    observe_batch(s, bt, f, now);
    /* The batch that brings the ring up carries each stage's wait since it started (the
     * ring was not taking work yet): it is not starvation, so it is not counted. */
    if (s->ring_up)
        account_timings(s, f, now);
    s->bf_head = (s->bf_head + 1) % s->plan->microbatches;
    s->n_inflight--;
    if (!s->ring_up)
        became_up(s, now);
    return KVR_OK;
}

/* ---- recovery ------------------------------------------------------------------------------ */

/* The window is emptied; results of the batches in it are stale from now on. */
static void empty_window(struct kvr_sched *s)
{
    s->n_inflight = 0;
    s->bf_head = 0;
    s->discard_below = s->next_batch_id;
    s->free_all = true;
}

/* The ring lost state (a link dropped, a stage dropped its sequences, or a batch never
 * came back): hold every running sequence and start it over once the ring is whole again,
 * from its prompt plus the tokens it had already produced (DESIGN.md 8). Batch invariance
 * makes that prefill compute what the lost decodes would have, and REPLAY records put the
 * tail's sampler back, so the continuation is exactly the text it would have been. The
 * window is emptied, and until a free-all probe comes back only probes go out. */
static void recover(struct kvr_sched *s, const char *why, uint64_t now)
{
    uint32_t n_held = 0;
    for (uint32_t i = 0; i < s->plan->max_seqs; i++) {
        struct seq *q = &s->seqs[i];
        if (q->state == SEQ_FREE)
            continue;
        q->inflight = 0;
        q->opened = false; /* the probe frees it in every stage */
        if (q->state == SEQ_ENDING) {
            seq_release(s, i, now);
            continue;
        }
        prefix_drop(s, i); /* the stages lost every block: taken again when it re-opens */
        q->state = SEQ_PREFILL;
        q->n_prefilled = 0;
        q->decoding = false;
        q->n_replay = q->r->n_generated;
        q->replay_ids_sent = 0;
        q->replay_pending =
            q->n_replay > 0 && (q->r->req.sampling.temperature > 0 || replay_window(q) > 0);
        if (!q->held_since)
            q->held_since = now;
        n_held++;
    }
    empty_window(s);
    kvr_kv_pool_reset(&s->pool); /* no sequence holds a block now, and none is named */
    if (n_held && (!s->hold_start_ns || s->ring_up))
        KVR_WARN("bridge: %s: holding %u sequences until the ring is whole again", why, n_held);
    else
        KVR_DEBUG("bridge: %s (%u sequences held)", why, n_held);
    if (n_held && !s->hold_start_ns)
        s->hold_start_ns = now;
    s->ring_up = false;
}

/* A held request that cannot finish within its budget, or whose ring stays broken for
 * HOLD_MAX_MS, ends with an explicit error: nothing waits forever. Returns the next time
 * one would expire (UINT64_MAX: none is held). */
static uint64_t expire_held(struct kvr_sched *s, uint64_t now)
{
    uint64_t next = UINT64_MAX;
    for (uint32_t i = 0; i < s->plan->max_seqs; i++) {
        struct seq *q = &s->seqs[i];
        if (!q->held_since || q->state == SEQ_FREE || q->state == SEQ_ENDING)
            continue;
        const struct kvr_sched_req *r = q->r;
        uint64_t budget_end = r->req.total_ms ? r->submit_ns + r->req.total_ms * MS_NS : UINT64_MAX;
        uint64_t hold_end = q->held_since + HOLD_MAX_MS * MS_NS;
        if (now >= budget_end)
            seq_end(s, i, KVR_GEN_FINISH_ERROR,
                    "the ring failed and did not recover within the request's budget", now);
        else if (now >= hold_end)
            seq_end(s, i, KVR_GEN_FINISH_ERROR, "the ring failed and did not recover within 30 s",
                    now);
        else {
            uint64_t t = budget_end < hold_end ? budget_end : hold_end;
            next = t < next ? t : next;
        }
    }
    return next;
}

/* ---- admission ---------------------------------------------------------------------------- */

static int refuse(struct kvr_sched *s, struct kvr_refusal *why, enum kvr_refusal_reason reason,
                  uint32_t retry_ms, const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static int refuse(struct kvr_sched *s, struct kvr_refusal *why, enum kvr_refusal_reason reason,
                  uint32_t retry_ms, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    why->reason = reason;
    why->retry_after_ms = retry_ms;
    vsnprintf(why->message, sizeof why->message, fmt, ap);
    va_end(ap);
    s->stats.refused[reason]++;
    return KVR_EAGAIN;
}

/* A retry hint: how late the estimate is, plus a millisecond, at most an hour (an estimate
 * can be absurd while the cost model knows little). */
static uint32_t retry_hint_ms(double late_ms)
{
    return late_ms < 3600000.0 ? (uint32_t)late_ms + 1 : 3600000u;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* When the prompt rows ahead of a new request (its own included, rows_ahead) will have gone
 * through, if batches carrying `decode` take prefill chunks within limit_ms
 * (chunk_limit_ms): in batches one after another at the window's pace, the last one all
 * the way round. The decode rows are those of n_ends sequences, which stop decoding
 * ends[k] ms from now (ascending): each that ends takes 1/W of a row out of every batch, a
 * lighter batch takes more prefill rows (the limit is a factor of the decode-only time
 * between tokens), and once none decodes the batches are full. With fewer sequences
 * decoding than batches in the window, only that many batches carry a decode row (a
 * stream's row is in one batch at a time): of every W batches, n carry one decode row and
 * its chunk, W - n only a chunk, which build_batch limits as if it carried the row. */
struct prefill_eta {
    double room, batches; /* prefill rows a batch now (mean), batches until ours is done */
    double full_ms;       /* the slowest stage's time for such a batch now (mean) */
    double step_ms;       /* one batch after another with the window full, now (mean) */
    double first_ms;      /* from now until the last chunk's token is back */
};

/* One kind of batch in a phase of prefill_eta: its prefill room, the slowest stage's time
 * and the pace at which such batches follow each other with the window full. */
struct eta_batch {
    double room, full_ms, step_ms;
};

static struct eta_batch eta_batch(const struct kvr_sched *s, struct kvr_cost_shape dk, double pos,
                                  double lim)
{
    const struct kvr_plan *p = s->plan;
    uint32_t width = p->row_width > (uint32_t)dk.rows + 1 ? p->row_width - (uint32_t)dk.rows : 1;
    struct eta_batch b;
    b.room = prefill_fit(s, dk, pos, width, lim);
    struct kvr_cost_shape full = {dk.rows + b.room, dk.pairs + kvr_cost_pairs(pos, b.room)};
    b.full_ms = kvr_cost_batch_ms(&s->cost, full);
    /* With the window full, a batch goes out each time one comes back: batches follow each
     * other at the slowest stage's pace, or at a trip over the window if the hops and the
     * other stages cannot keep it busy. */
    double step = kvr_cost_trip_ms(&s->cost, full) / p->microbatches;
    b.step_ms = step > b.full_ms ? step : b.full_ms;
    return b;
}

/* The stage that is slowest for a batch of shape b. */
static uint32_t slowest_stage(const struct kvr_cost_model *m, struct kvr_cost_shape b)
{
    uint32_t k = 0;
    double worst = -1;
    for (uint32_t j = 0; j < m->n_stages; j++) {
        double t = kvr_cost_stage_ms(m, j, b);
        if (t > worst) {
            worst = t;
            k = j;
        }
    }
    return k;
}

/* How long a batch of shape b takes to reach stage k: the stages before it, and their hops. */
static double before_stage_ms(const struct kvr_cost_model *m, uint32_t k, struct kvr_cost_shape b)
{
    double sum = k * m->hop_ms / (m->n_stages + 1);
    for (uint32_t j = 0; j < k; j++)
        sum += kvr_cost_stage_ms(m, j, b);
    return sum;
}

static struct prefill_eta prefill_eta(const struct kvr_sched *s, struct kvr_cost_shape decode,
                                      uint32_t n_prompt, double rows_ahead, double limit_ms,
                                      const double *ends, uint32_t n_ends)
{
    const struct kvr_plan *p = s->plan;
    const struct kvr_cost_model *m = &s->cost;
    double W = p->microbatches;
    double alone0 = decode.rows > 0 ? window_period_ms(s, decode, 1.0) : 0;
    double pair_per_row = decode.rows > 0 ? decode.pairs / decode.rows : 0;
    struct prefill_eta e = {0};
    double t = 0, left = rows_ahead;
    for (uint32_t k = 0;; k++) {
        /* Sequences decoding in this phase, and the decode rows of a batch that has any. */
        double n_dec = k < n_ends ? decode.rows * W * (n_ends - k) / n_ends : 0;
        double b_dec = n_dec < W ? ceil(n_dec - 1e-9) : W; /* batches with decode rows */
        double rows = b_dec > 0 ? (n_dec < W ? 1.0 : n_dec / W) : 0;
        struct kvr_cost_shape dk = {rows, rows * pair_per_row};
        double lim = 0;
        if (rows > 0 && limit_ms > 0)
            lim = isinf(limit_ms) ? limit_ms : limit_ms * window_period_ms(s, dk, 1.0) / alone0;
        struct eta_batch with = eta_batch(s, dk, n_prompt / 2.0, lim);
        struct eta_batch without = with;
        if (b_dec < W)
            without = eta_batch(s, (struct kvr_cost_shape){0, 0}, n_prompt / 2.0, lim);
        double room = (b_dec * with.room + (W - b_dec) * without.room) / W;
        double step = (b_dec * with.step_ms + (W - b_dec) * without.step_ms) / W;
        if (k == 0) {
            e.room = room;
            e.full_ms = (b_dec * with.full_ms + (W - b_dec) * without.full_ms) / W;
            e.step_ms = step;
            /* A busy ring has its window full: the first chunk waits for a batch to come
             * back, half a step on average. */
            t = s->n_inflight >= p->microbatches ? step / 2 : 0;
        }
        double n_b = ceil(left / room - 1e-9);
        n_b = n_b > 1 ? n_b : 1;
        /* The batch with our last chunk goes all the way round; its rows are what is left. */
        double last_rows = left - (n_b - 1) * room;
        last_rows = last_rows > 0 ? last_rows : 1;
        struct kvr_cost_shape last = {dk.rows + last_rows,
                                      dk.pairs + kvr_cost_pairs(n_prompt - last_rows, last_rows)};
        double done = t + (n_b - 1) * step + kvr_cost_trip_ms(m, last);
        if (n_b >= 2 && with.step_ms <= with.full_ms) {
            /* The slowest stage sets the pace, but it starts only when the first full batch
             * has come through the stages before it, and the last batch queues behind the
             * others there instead of passing those stages on its own time. */
            struct kvr_cost_shape full = {dk.rows + with.room,
                                          dk.pairs + kvr_cost_pairs(n_prompt / 2.0, with.room)};
            uint32_t slow = slowest_stage(m, full);
            done += before_stage_ms(m, slow, full) - before_stage_ms(m, slow, last);
        }
        if (k >= n_ends || done <= ends[k]) {
            e.batches += n_b;
            e.first_ms = done;
            return e;
        }
        double fit = ends[k] > t ? floor((ends[k] - t) / step) : 0;
        fit = fit < n_b - 1 ? fit : n_b - 1;
        left -= fit * room;
        t += fit * step;
        e.batches += fit;
    }
}

/* The calibration class of a first-token estimate that expects `batches` batches before
 * the first token: a few (the trip, nearly), tens, and the long waits in thin chunks. */
static uint8_t eta_class(double batches)
{
    return batches < 10 ? 0 : batches < 40 ? 1 : batches < 60 ? 2 : 3;
}

/* Admission (DESIGN.md 6). From the cost model: the new request's first token comes after
 * the prompt rows queued ahead of it (its own included) have gone through in batches of the
 * row width, less the decode rows every batch carries; its last token comes max_tokens - 1
 * token periods later, at the load it adds. It is refused if either misses its budget, or
 * if it would push a running request that is on time past its own deadline. */
static int admit(struct kvr_sched *s, struct kvr_sched_req *r, uint64_t now,
                 struct kvr_refusal *why)
{
    const struct kvr_gen_request *req = &r->req;
    double *pred_first_ms = &r->pred_first_ms;
    uint32_t *n_cached = &r->n_cached;
    *pred_first_ms = r->pred_period_ms = r->est_first_ms = r->est_period_ms = 0;
    r->check_first_ms = 0;
    *n_cached = 0;
    const struct kvr_plan *p = s->plan;
    if ((uint64_t)req->n_prompt + req->max_tokens > p->n_ctx)
        return refuse(s, why, KVR_REFUSE_TOO_LONG, 0,
                      "prompt (%u tokens) + max_tokens (%u) exceed the context of %u",
                      req->n_prompt, req->max_tokens, p->n_ctx);
    if (!s->ring_up)
        return refuse(s, why, KVR_REFUSE_RING_DOWN, 1000, "the ring is down");
    uint32_t need = blocks_for(s, req->n_prompt + req->max_tokens), n_hit;
    bool fits = blocks_fit(s, req, &n_hit);
    uint32_t n_compute = req->n_prompt - n_hit * p->kv_block_tokens; /* rows to prefill */
    *n_cached = n_hit * p->kv_block_tokens;
    if (need > p->kv_blocks)
        return refuse(s, why, KVR_REFUSE_KV_FULL, 0, "needs %u KV blocks, the ring has %u", need,
                      p->kv_blocks);
    if (s->wq_count >= s->max_waiting)
        return refuse(s, why, KVR_REFUSE_QUEUE_FULL, 1000, "wait queue full (%u requests)",
                      s->wq_count);
    if (!kvr_cost_ready(&s->cost))
        return KVR_OK;
    const struct kvr_cost_model *m = &s->cost;
    double W = p->microbatches;
    double n_before = s->n_running + s->wq_count, n_after = n_before + 1;
    if (n_after > p->max_seqs)
        n_after = p->max_seqs;
    double ctx = mean_context(s);
    const struct kvr_cost_shape none = {0, 0};
    double period = expected_period(s, n_after, ctx);

    /* Prompt rows ahead: the unsent prefill of running and waiting requests, and ours. They
     * go in the rows each batch may add to its decode rows (prefill_fit), taken here at the
     * middle of our prompt. */
    double rows_ahead = n_compute;
    for (uint32_t i = 0; i < p->max_seqs; i++)
        if (s->seqs[i].state == SEQ_PREFILL)
            rows_ahead += s->seqs[i].r->req.n_prompt - s->seqs[i].n_prefilled;
    for (uint32_t k = 0; k < s->wq_count; k++) {
        const struct kvr_sched_req *w = s->waitq[(s->wq_head + k) % s->max_waiting];
        rows_ahead += w->req.n_prompt - w->n_cached;
    }
    double per = n_before / W;
    struct kvr_cost_shape decode = {per, per * (ctx + 1)};
    /* When the sequences ahead stop decoding: the running ones after the tokens they have
     * to go, the others (prefilling, waiting) as if they started now. */
    double *ends = s->ends_scratch;
    uint32_t n_ends = 0;
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state != SEQ_FREE)
            ends[n_ends++] = q->state == SEQ_ENDING
                                 ? 0
                                 : ((double)q->r->req.max_tokens - q->r->n_generated) * period;
    }
    for (uint32_t k = 0; k < s->wq_count; k++)
        ends[n_ends++] = s->waitq[(s->wq_head + k) % s->max_waiting]->req.max_tokens * period;
    qsort(ends, n_ends, sizeof *ends, cmp_double);
    /* The chunks beside the streams follow the recent waiting share (chunk_limit_ms), which
     * the requests that arrive while ours waits hardly move. */
    struct prefill_eta eta = prefill_eta(s, decode, req->n_prompt, rows_ahead,
                                         chunk_limit_ms(s, decode, false, now), ends, n_ends);
    double check_ms = eta.first_ms; /* what the budget is checked against */
    double f_first = kvr_calib_factor(&s->calib_first, ADMIT_MARGIN);
    if (req->first_token_ms && f_first * eta.first_ms + period > req->first_token_ms) {
        /* Too slow at the streams' pace, with the estimates' error: the chunking rule gives
         * a prompt that falls behind what the decoding streams' budgets afford
         * (chunk_limit_ms), so the budget is checked at that pace. But the scheduler takes
         * it only if the prompt is late at the streams' pace by its own rule (prefill_urgent:
         * the plain estimate against the budget less ADMIT_MARGIN), and the estimate follows
         * the scheduler: a prompt that pace still brings in on time gets its thin chunks. */
        struct prefill_eta fast = prefill_eta(s, decode, req->n_prompt, rows_ahead,
                                              chunk_limit_ms(s, decode, true, now), ends, n_ends);
        if (fast.first_ms < eta.first_ms) {
            check_ms = fast.first_ms;
            if (eta.first_ms > req->first_token_ms / ADMIT_MARGIN)
                eta = fast;
        }
    }
    double room = eta.room, n_prefill_batches = eta.batches, t_step = eta.step_ms;
    double t_full = eta.full_ms;
    /* No free slot or KV: the requests waiting before us take the first slots that free
     * up, so we wait for the (waiting + 1)-th running request to end. */
    double wait_ms = 0;
    if (s->n_running + s->wq_count >= p->max_seqs || !fits) {
        double *left = s->admit_scratch;
        uint32_t n = 0;
        for (uint32_t i = 0; i < p->max_seqs; i++) {
            const struct seq *q = &s->seqs[i];
            if (q->state == SEQ_FREE)
                continue;
            left[n++] = ((double)q->r->req.max_tokens - q->r->n_generated) * period;
        }
        qsort(left, n, sizeof *left, cmp_double);
        uint32_t k = s->wq_count; /* ahead of us */
        if (n > 0) {
            /* Beyond the running ones, each further wave of max_seqs requests takes about
             * a whole answer. */
            double answer_ms = (double)req->max_tokens * period;
            wait_ms = k < n ? left[k] : left[n - 1] + (double)(k - n + 1) / p->max_seqs * answer_ms;
        }
    }
    double f_period = gap_factor(s);
    double f_total = kvr_calib_factor(&s->calib_total, ADMIT_MARGIN);
    double raw_first = wait_ms + eta.first_ms;
    *pred_first_ms = raw_first;
    double checked_first = wait_ms + check_ms;
    r->check_first_ms = checked_first;
    /* The estimate itself (exported, checked against the outcome): the model corrected by
     * the mean error of the estimates that expected about as many batches. The budgets are
     * checked against a high quantile of the estimates' error instead (kvr_calib_factor):
     * the first token's for the first-token budget, the whole answers' for the total. */
    r->eta_class = eta_class(eta.batches);
    double f_class = kvr_recent_mean(&s->first_eta[r->eta_class], now, ETA_TAU_MS, 1.0, ETA_PRIOR);
    r->est_first_ms = raw_first * f_class;
    /* The whole answer: the first token, then the gaps. A stream's gaps depend less on the
     * load when it starts than on the prompts that arrive while it decodes (they share its
     * batches): at a steady load the streams' recent gaps are the better guide, beside the
     * cost model's period worth GAP_PRIOR of them; with none at all, that period corrected
     * by how far whole answers were from it. */
    double gap_ms = kvr_recent_mean(&s->gaps, now, GAP_TAU_MS, period, GAP_PRIOR);
    r->pred_period_ms = gap_ms;
    double f_answer = s->calib_total.n >= 5 && s->gaps.weight <= 0 ? s->calib_total.mid : 1.0;
    double est_total = (r->est_first_ms + (req->max_tokens - 1) * gap_ms) * f_answer;
    r->est_period_ms =
        req->max_tokens > 1 ? (est_total - r->est_first_ms) / (req->max_tokens - 1) : gap_ms;
    /* The client sees its first text one token late when that token is part of a
     * character (streams never split UTF-8): budget one more period. */
    double first_ms = f_first * checked_first + r->est_period_ms;
    /* The whole answers' high quantile is of actual / raw (observe_estimate): it applies to
     * the raw estimate, not to one already corrected by their median. Its first token is
     * the one the first-token budget was checked at: the pace that rescues a late prompt
     * (with the streams' pace instead test_sched refused 116 and 188 of ~900 at 0.75x on its
     * two mixes, against 74 and 191, and no answer admitted missed 6 s either way). */
    double total_ms = f_total * (checked_first * f_class + (req->max_tokens - 1) * gap_ms);
    if (s->n_running == 0 && s->wq_count == 0) {
        /* An idle ring risks nobody, and a model that has never seen a batch of this shape
         * extrapolates pessimistically: refuse only what cannot be met even by an empty
         * batch's trip and one sequence's period, so the model always gets to learn. */
        first_ms = kvr_cost_trip_ms(m, none);
        total_ms = first_ms + (req->max_tokens - 1) * kvr_cost_period_ms(m, 1, 0, none);
    }
    KVR_DEBUG("bridge: estimate %llu: prompt %u (%u to compute, %.0f rows ahead in %.0f batches "
              "of %.0f), %u running, %u waiting, slot wait %.0f ms, step %.0f ms, period %.1f "
              "ms; first token %.0f ms (raw %.0f, checked %.0f), whole %.0f ms (checked %.0f)",
              (unsigned long long)now, req->n_prompt, n_compute, rows_ahead, n_prefill_batches,
              room, s->n_running, s->wq_count, wait_ms, t_step, period, r->est_first_ms, raw_first,
              first_ms, est_total, total_ms);
    if (!s->cfg.admission) /* estimated (and exported) all the same, never refused */
        return KVR_OK;
    if (req->first_token_ms && first_ms > req->first_token_ms)
        return refuse(s, why, KVR_REFUSE_FIRST_TOKEN_BUDGET,
                      retry_hint_ms(first_ms - req->first_token_ms),
                      "would miss the first-token budget: estimated %.0f ms > %u ms", first_ms,
                      req->first_token_ms);
    if (req->total_ms && total_ms > req->total_ms)
        return refuse(s, why, KVR_REFUSE_TOTAL_BUDGET, retry_hint_ms(total_ms - req->total_ms),
                      "would miss the total budget: estimated %.0f ms > %u ms", total_ms,
                      req->total_ms);

    /* Running requests: our prompt's batches delay them, and every later token comes at
     * the slower period. Refuse if that makes one that is on time late. */
    double period_before = expected_period(s, n_before > 0 ? n_before : 1, ctx);
    double delay = req->n_prompt / room * (t_full - kvr_cost_batch_ms(m, decode));
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state == SEQ_FREE || q->state == SEQ_ENDING || !q->r->req.total_ms)
            continue;
        const struct kvr_sched_req *other = q->r;
        double left_ms = (other->deadline_ns > now ? other->deadline_ns - now : 0) / 1e6;
        double togo = (double)other->req.max_tokens - other->n_generated;
        double on_time = f_period * togo * period_before;
        double with_us = f_period * (delay + togo * period);
        if (on_time <= left_ms && with_us > left_ms)
            return refuse(s, why, KVR_REFUSE_TOTAL_BUDGET, retry_hint_ms(with_us - left_ms),
                          "would make a running request miss its budget (%.0f ms left, "
                          "%.0f ms needed with this one)",
                          left_ms, with_us);
    }
    return KVR_OK;
}

/* ---- inputs --------------------------------------------------------------------------------- */

int kvr_sched_submit(struct kvr_sched *s, struct kvr_sched_req *r, uint64_t now,
                     struct kvr_refusal *why)
{
    memset(why, 0, sizeof *why);
    const struct kvr_gen_request *req = &r->req;
    if (req->n_prompt == 0 || req->max_tokens == 0 || !req->prompt || !r->generated) {
        why->reason = KVR_REFUSE_TOO_LONG;
        snprintf(why->message, sizeof why->message, "empty prompt or max_tokens of 0");
        return KVR_EINVAL;
    }
    r->seq = -1;
    r->waiting = r->ended = false;
    r->n_generated = 0;
    r->last_token_ns = r->first_token_ns = 0;
    r->held_once = false;
    r->submit_ns = now;
    r->deadline_ns = req->total_ms         ? now + req->total_ms * MS_NS
                     : req->first_token_ms ? now + req->first_token_ms * MS_NS
                                           : UINT64_MAX;
    int rc = admit(s, r, now, why);
    if (rc)
        return rc;
    s->waitq[(s->wq_head + s->wq_count) % s->max_waiting] = r;
    s->wq_count++;
    r->waiting = true;
    s->stats.admitted++;
    start_waiting(s, now);
    return KVR_OK;
}

void kvr_sched_cancel(struct kvr_sched *s, struct kvr_sched_req *r, uint64_t now)
{
    if (r->seq >= 0) {
        seq_end(s, (uint32_t)r->seq, KVR_GEN_FINISH_CANCELLED, NULL, now);
    } else if (r->waiting) {
        waitq_remove(s, r);
        end_req(s, r, KVR_GEN_FINISH_CANCELLED, NULL, now);
        detach(s, r, now);
    }
}

void kvr_sched_reset(struct kvr_sched *s, uint32_t stage, uint64_t batch_id, uint64_t now)
{
    /* Everything sent before this arrived may have met the empty stage. A failed batch we
     * have already given up on changes nothing. */
    if (batch_id != KVR_WIRE_RESET_LINK && batch_id < s->discard_below)
        return;
    char why[96];
    snprintf(why, sizeof why, "stage %u dropped its sequences", stage);
    recover(s, why, now);
}

void kvr_sched_link_up(struct kvr_sched *s, uint64_t now)
{
    (void)now;
    s->links_up = true;
    s->free_all = true; /* the free-all batch doubles as the probe: its result marks it up */
}

void kvr_sched_plan_changed(struct kvr_sched *s)
{
    const struct kvr_plan *p = s->plan;
    s->stats.n_stages = p->n_stages;
    memset(s->stats.stage, 0, sizeof s->stats.stage);
    memset(s->win_held, 0, sizeof s->win_held);
    memset(s->win_starved, 0, sizeof s->win_starved);
    memset(s->win_blocked, 0, sizeof s->win_blocked);
    kvr_cost_init(&s->cost, p->n_stages, p->microbatches);
    uint8_t hash[KVR_PLAN_HASH_BYTES];
    kvr_plan_hash(p, hash);
    memcpy(&s->cache_seed, hash, sizeof s->cache_seed);
}

void kvr_sched_link_down(struct kvr_sched *s, const char *why, uint64_t now)
{
    if (s->ring_up)
        KVR_WARN("bridge: ring down: %s", why);
    s->links_up = false;
    recover(s, why, now);
}

uint64_t kvr_sched_tick(struct kvr_sched *s, uint64_t now)
{
    uint64_t next = UINT64_MAX;
    if (!s->ring_up)
        next = expire_held(s, now);
    if (!s->ring_up) { /* a broken ring does nothing: its activity is 0 at once */
        for (uint32_t i = 0; i < s->plan->n_stages; i++) {
            struct kvr_sched_stage_stats *st = &s->stats.stage[i];
            st->util = st->starved_frac = st->blocked_frac = 0;
            s->win_held[i] = s->win_starved[i] = s->win_blocked[i] = 0;
        }
        s->stats.tokens_per_s = 0;
        s->win_tokens = 0;
    }
    roll_window(s, now);
    if (window_active(s) && s->win_start_ns + WINDOW_NS < next)
        next = s->win_start_ns + WINDOW_NS;
    if (s->n_inflight == 0)
        return next;
    /* A batch that never comes back means a stage died without closing its links. */
    uint64_t limit = (s->ring_up ? RING_TIMEOUT_MS : PROBE_MS) * MS_NS;
    uint64_t due = s->batches[s->bf_head].sent_ns + limit;
    if (now < due)
        return due < next ? due : next;
    if (!s->ring_up) {
        /* A stage had no downstream (yet) and dropped the probe: send another. Only probes
         * are in flight while the ring is not up. */
        recover(s, "the ring is not whole yet", now);
    } else {
        /* A stage between head and tail hung or lost the batch without a word (a RESET or
         * a dropped link would have said so): start over with clean stages. */
        KVR_WARN("bridge: a batch did not come back within %d ms", RING_TIMEOUT_MS);
        recover(s, "a stage lost a batch", now);
    }
    return now; /* a probe is due at once */
}

void kvr_sched_shutdown(struct kvr_sched *s, const char *why, uint64_t now)
{
    for (uint32_t i = 0; i < s->plan->max_seqs; i++) {
        struct seq *q = &s->seqs[i];
        if (q->state == SEQ_FREE)
            continue;
        end_req(s, q->r, KVR_GEN_FINISH_ERROR, why, now);
        seq_release(s, i, now);
    }
    while (s->wq_count > 0) {
        struct kvr_sched_req *r = s->waitq[s->wq_head];
        s->wq_head = (s->wq_head + 1) % s->max_waiting;
        s->wq_count--;
        end_req(s, r, KVR_GEN_FINISH_ERROR, why, now);
        detach(s, r, now);
    }
    empty_window(s);
    s->ring_up = false;
    s->links_up = false;
}

/* ---- outputs -------------------------------------------------------------------------------- */

const struct kvr_wire_msg *kvr_sched_next_batch(struct kvr_sched *s, uint64_t now)
{
    if (!s->links_up || s->n_inflight >= s->plan->microbatches)
        return NULL;
    struct batch *bt = &s->batches[(s->bf_head + s->n_inflight) % s->plan->microbatches];
    if (!build_batch(s, bt, now))
        return NULL;
    bt->id = s->next_batch_id++;
    bt->sent_ns = now;
    s->n_inflight++;
    bt->msg = (struct kvr_wire_msg){.type = KVR_WIRE_BATCH,
                                    .batch_id = bt->id,
                                    .ctrl = bt->ctrl,
                                    .n_ctrl = bt->n_ctrl,
                                    .segs = bt->segs,
                                    .n_segs = bt->n_segs,
                                    .payload = KVR_WIRE_PAYLOAD_TOKENS,
                                    .payload_data = bt->tokens,
                                    .payload_bytes = (size_t)bt->n_rows * sizeof(int32_t)};
    return &bt->msg;
}

bool kvr_sched_ring_up(const struct kvr_sched *s)
{
    return s->ring_up;
}

bool kvr_sched_batch_live(const struct kvr_sched *s, uint64_t batch_id)
{
    return s->n_inflight > 0 && batch_id >= s->batches[s->bf_head].id &&
           batch_id < s->next_batch_id && batch_id >= s->discard_below;
}

void kvr_sched_stats(const struct kvr_sched *s, struct kvr_sched_stats *out)
{
    *out = s->stats;
    out->ring_up = s->ring_up;
    out->running = s->n_running;
    out->waiting = s->wq_count;
    out->kv_blocks_used = s->pool.n_used;
    out->kv_blocks_cached = s->pool.n_cached;
    out->prefix_evicted = s->pool.n_evicted;
    out->inflight = s->n_inflight;
}

int kvr_sched_check(const struct kvr_sched *s, struct kvr_err *err)
{
    const struct kvr_plan *p = s->plan;
    uint32_t running = 0;
    if (s->n_inflight > p->microbatches)
        return kvr_err_set(err, KVR_EINVAL, "%u batches in flight, window %u", s->n_inflight,
                           p->microbatches);
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state == SEQ_FREE) {
            if (q->r || q->inflight || q->kv_blocks)
                return kvr_err_set(err, KVR_EINVAL, "free slot %u holds state", i);
            continue;
        }
        running++;
        if (!q->r || q->r->seq != (int)i || q->r->waiting)
            return kvr_err_set(err, KVR_EINVAL, "slot %u and its request disagree", i);
        bool blockless = q->kv_blocks == 0 && !q->opened; /* held by a recovery */
        if (q->kv_blocks != req_blocks(s, q->r) && !blockless)
            return kvr_err_set(err, KVR_EINVAL, "slot %u holds %u blocks, needs %u", i,
                               q->kv_blocks, req_blocks(s, q->r));
        const uint32_t *table = s->tables + (size_t)i * s->max_blocks_per_seq;
        for (uint32_t b = 0; b < q->kv_blocks; b++)
            if (s->pool.state[table[b]] != KVR_KV_BLOCK_USED)
                return kvr_err_set(err, KVR_EINVAL, "slot %u uses block %u, not in use", i,
                                   table[b]);
        if (q->n_cached % p->kv_block_tokens || q->n_cached >= q->r->req.n_prompt + q->n_replay)
            return kvr_err_set(err, KVR_EINVAL, "slot %u: %u cached positions of %u", i,
                               q->n_cached, q->r->req.n_prompt);
        uint32_t in_window = 0, decoding = 0;
        for (uint32_t b = 0; b < s->n_inflight; b++) {
            const struct batch *bt = &s->batches[(s->bf_head + b) % p->microbatches];
            for (uint32_t k = 0; k < bt->n_segs; k++) {
                if (bt->segs[k].seq != i)
                    continue;
                in_window++;
                decoding += (bt->segs[k].flags & KVR_SEG_WANTS_TOKEN) != 0;
            }
        }
        if (in_window != q->inflight)
            return kvr_err_set(err, KVR_EINVAL, "slot %u: %u batches in flight, counted %u", i,
                               in_window, q->inflight);
        if (decoding > 1)
            return kvr_err_set(err, KVR_EINVAL, "slot %u wants a token from %u batches", i,
                               decoding);
        if (decoding == 1 && q->state != SEQ_WAIT && q->state != SEQ_ENDING)
            return kvr_err_set(err, KVR_EINVAL, "slot %u has a token coming but is not waiting", i);
        if (q->r->n_generated > q->r->req.max_tokens)
            return kvr_err_set(err, KVR_EINVAL, "slot %u generated past max_tokens", i);
    }
    int rc = kvr_kv_pool_check(&s->pool, err);
    if (rc)
        return rc;
    /* Every block in use is in some slot's table, as often as its reference count says. */
    uint32_t refs = 0;
    for (uint32_t i = 0; i < p->max_seqs; i++)
        refs += s->seqs[i].kv_blocks;
    uint32_t pool_refs = 0;
    for (uint32_t b = 0; b < s->pool.n_blocks; b++)
        pool_refs += s->pool.refs[b];
    if (refs != pool_refs)
        return kvr_err_set(err, KVR_EINVAL,
                           "KV blocks: slots hold %u references, the pool "
                           "counts %u",
                           refs, pool_refs);
    if (running != s->n_running)
        return kvr_err_set(err, KVR_EINVAL, "%u slots in use, counted %u", running, s->n_running);
    if (s->wq_count > s->max_waiting)
        return kvr_err_set(err, KVR_EINVAL, "wait queue over capacity");
    for (uint32_t k = 0; k < s->wq_count; k++) {
        const struct kvr_sched_req *r = s->waitq[(s->wq_head + k) % s->max_waiting];
        if (!r->waiting || r->seq != -1 || r->ended)
            return kvr_err_set(err, KVR_EINVAL, "waiting request %u is not waiting", k);
    }
    return KVR_OK;
}

/* ---- life cycle ----------------------------------------------------------------------------- */

void kvr_sched_destroy(struct kvr_sched *s)
{
    if (!s)
        return;
    for (uint32_t i = 0; s->batches && i < s->plan->microbatches; i++) {
        kvr_free(s->batches[i].ctrl);
        kvr_free(s->batches[i].segs);
        kvr_free(s->batches[i].tokens);
    }
    kvr_free(s->batches);
    kvr_kv_pool_fini(&s->pool);
    kvr_free(s->tables);
    kvr_free(s->found_scratch);
    kvr_free(s->tok_scratch);
    kvr_free(s->admit_scratch);
    kvr_free(s->ends_scratch);
    kvr_free(s->pick_scratch);
    kvr_free(s->seqs);
    kvr_free(s->waitq);
    kvr_free(s);
}

int kvr_sched_create(struct kvr_sched **out, const struct kvr_sched_config *cfg,
                     struct kvr_err *err)
{
    *out = NULL;
    const struct kvr_plan *p = cfg->plan;
    /* A batch carries a free-all probe (max_seqs records), or FREE records for every slot
     * and then the OPEN and MAP records of one sequence as long as its context; OPEN
     * records need room beside REPLAY records (emit_replay keeps max_seqs free). */
    uint32_t max_blocks = (p->n_ctx + p->kv_block_tokens - 1) / p->kv_block_tokens;
    uint32_t open_ctrl = 1 + (max_blocks + KVR_WIRE_MAP_IDS - 1) / KVR_WIRE_MAP_IDS;
    if (cfg->max_ctrl < p->max_seqs + open_ctrl)
        return kvr_err_set(err, KVR_EINVAL, "sched: max_ctrl %u < max_seqs %u + %u", cfg->max_ctrl,
                           p->max_seqs, open_ctrl);
    struct kvr_sched *s = kvr_calloc(1, sizeof *s);
    if (!s)
        return kvr_err_set(err, KVR_ENOMEM, "sched: out of memory");
    s->plan = p;
    s->cfg = *cfg;
    s->max_waiting = cfg->max_waiting ? cfg->max_waiting : 4 * p->max_seqs;
    s->seqs = kvr_calloc(p->max_seqs, sizeof *s->seqs);
    s->waitq = kvr_calloc(s->max_waiting, sizeof *s->waitq);
    s->batches = kvr_calloc(p->microbatches, sizeof *s->batches);
    s->admit_scratch = kvr_calloc(p->max_seqs, sizeof *s->admit_scratch);
    s->ends_scratch = kvr_calloc((size_t)p->max_seqs + s->max_waiting, sizeof *s->ends_scratch);
    s->pick_scratch = kvr_calloc(p->max_seqs + 1, sizeof *s->pick_scratch);
    s->max_blocks_per_seq = max_blocks;
    s->tables = kvr_calloc((size_t)p->max_seqs * max_blocks, sizeof *s->tables);
    s->found_scratch = kvr_calloc(max_blocks, sizeof *s->found_scratch);
    s->tok_scratch = kvr_calloc(p->kv_block_tokens, sizeof *s->tok_scratch);
    if (!s->seqs || !s->waitq || !s->batches || !s->admit_scratch || !s->ends_scratch ||
        !s->pick_scratch || !s->tables || !s->found_scratch || !s->tok_scratch)
        goto nomem;
    int rc = kvr_kv_pool_init(&s->pool, p->kv_blocks, p->kv_block_tokens, err);
    if (rc) {
        kvr_sched_destroy(s);
        return rc;
    }
    uint8_t hash[KVR_PLAN_HASH_BYTES];
    kvr_plan_hash(p, hash);
    memcpy(&s->cache_seed, hash, sizeof s->cache_seed);
    for (uint32_t i = 0; i < p->microbatches; i++) {
        struct batch *bt = &s->batches[i];
        bt->ctrl = kvr_calloc(cfg->max_ctrl, sizeof *bt->ctrl);
        bt->segs = kvr_calloc(p->row_width, sizeof *bt->segs);
        bt->tokens = kvr_calloc(p->row_width, sizeof *bt->tokens);
        if (!bt->ctrl || !bt->segs || !bt->tokens)
            goto nomem;
    }
    s->stats.n_stages = p->n_stages;
    s->stats.n_agents = p->n_agents;
    s->stats.kv_blocks_total = p->kv_blocks;
    kvr_cost_init(&s->cost, p->n_stages, p->microbatches);
    *out = s;
    return KVR_OK;
nomem:
    kvr_sched_destroy(s);
    return kvr_err_set(err, KVR_ENOMEM, "sched: out of memory");
}
