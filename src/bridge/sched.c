/* sched.c - the bridge's scheduler: the request table, the slots, the wait queue, the
 * batch builder, results and recovery (see sched.h). Admission (admission.c) decides
 * whether a request comes in; pacing (pacing.c) how much prefill a batch may carry.
 *
 * Reading order: streams (events to the caller), slots and KV blocks, the batch builder,
 * results, recovery, then the public inputs, outputs and life cycle. Every function takes
 * the current time from its caller. */
#include "bridge/sched.h"

#include "bridge/admission.h"
#include "bridge/kvpool.h"
#include "bridge/pacing.h"
#include "bridge/sched_state.h"
#include "bridge/spec_policy.h"
#include "bridge/telemetry.h"
#include "core/alloc.h"
#include "core/log.h"

#include <stdio.h>
#include <string.h>

enum {
    RING_TIMEOUT_MS = 15000, /* a batch that has not come back by then was lost */
    PROBE_MS = 500,          /* ... while checking a newly connected ring */
    HOLD_MAX_MS = 30000,     /* a sequence held this long by a broken ring fails */
};

#define WINDOW_NS 2000000000ull /* telemetry fractions are over this window */

/* Up to the default budgets (60 s to the first token, 600 s in all), so that a long wait is
 * not just +Inf. */
const double kvr_sched_queue_bounds[KVR_SCHED_QUEUE_BUCKETS] = {
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0};

/* ---- streams ---------------------------------------------------------------------------- */

static void emit(struct kvr_sched *s, struct kvr_sched_req *r, const struct kvr_sched_event *ev)
{
    if (s->cfg.event)
        s->cfg.event(s->cfg.event_ctx, r, ev);
}

static void emit_token(struct kvr_sched *s, struct kvr_sched_req *r,
                       const struct kvr_wire_result *res, bool eog, uint64_t now)
{
    struct kvr_sched_event ev = {.type = KVR_SCHED_EV_TOKEN,
                                 .gen = {.token = res->token,
                                         .logprob = res->logprob,
                                         .n_top = res->n_top,
                                         .eog = eog,
                                         .finish = KVR_GEN_FINISH_NONE,
                                         .t_ns = now}};
    memcpy(ev.gen.top, res->top, res->n_top * sizeof *res->top);
    emit(s, r, &ev);
}

static void end_req(struct kvr_sched *s, struct kvr_sched_req *r, enum kvr_gen_finish finish,
                    const char *message, uint64_t now)
{
    if (r->ended)
        return;
    r->ended = true;
    struct kvr_sched_event ev = {.type = KVR_SCHED_EV_END,
                                 .gen = {.token = -1, .finish = finish, .t_ns = now}};
    snprintf(ev.gen.error, sizeof ev.gen.error, "%s", message ? message : "");
    emit(s, r, &ev);
}

static void detach(struct kvr_sched *s, struct kvr_sched_req *r, uint64_t now)
{
    r->seq = -1;
    r->waiting = false;
    struct kvr_sched_event ev = {.type = KVR_SCHED_EV_DETACH, .gen = {.token = -1, .t_ns = now}};
    emit(s, r, &ev);
}

/* ---- slots and KV accounting --------------------------------------------------------------- */

/* ---- the prefix cache -------------------------------------------------------------------- */

/* Blocks of a prompt found in the cache, into found[]. Only whole blocks count, and never
 * the whole prompt: the last token must be computed to have logits to sample. */
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

/* The blocks a request would take now: n_hit found in the cache, the rest new. */
bool kvr_sched_blocks_fit(const struct kvr_sched *s, const struct kvr_gen_request *req,
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
    if (!kvr_sched_blocks_fit(s, &r->req, &n_hit))
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

/* Once the batch being built has gone through, the stages hold positions [0, n_written)
 * of the sequence in `slot`. Name its blocks that are now whole, so a later OPEN can map
 * them: in this batch or a later one, since stages keep order. */
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

/* Whether the request r shares its prompt with (prompt_of) still has prompt rows to put in
 * a batch: r waits for them, to find the prompt's blocks in the prefix cache. */
static bool prompt_pending(const struct kvr_sched *s, const struct kvr_sched_req *r)
{
    for (uint32_t i = 0; r->prompt_of && s->cfg.prefix_cache && i < s->plan->max_seqs; i++)
        if (s->seqs[i].r && s->seqs[i].r->id == r->prompt_of)
            return s->seqs[i].state == SEQ_PREFILL;
    return false;
}

/* Give waiting requests a slot and their KV, oldest first, while both are available. A
 * choice of n > 1 waits for its first choice's prompt (prompt_pending). */
static void start_waiting(struct kvr_sched *s, uint64_t now)
{
    while (s->wq_count > 0) {
        struct kvr_sched_req *r = s->waitq[s->wq_head];
        int slot = free_slot(s);
        if (slot < 0 || prompt_pending(s, r))
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

/* The slot's FREE record is in a batch, or the stages dropped everything. The slot may be
 * reused at once: the stages see that FREE before any later OPEN. */
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

/* OPEN carries the request's sampling parameters as they are, with greedy and "off" in the
 * wire's one spelling (0); the logit bias follows in BIAS records, not in the OPEN. */
static void open_record(struct kvr_wire_ctrl *c, uint32_t slot, const struct kvr_gen_request *r)
{
    uint32_t top = r->top_logprobs < KVR_LOGPROBS_MAX_TOP ? r->top_logprobs : KVR_LOGPROBS_MAX_TOP;
    *c = (struct kvr_wire_ctrl){
        .type = KVR_WIRE_CTRL_OPEN,
        .seq = slot,
        .flags = r->logprobs ? KVR_WIRE_OPEN_LOGPROBS | top << KVR_WIRE_TOP_SHIFT : 0,
        .sampling = r->sampling};
    struct kvr_sample_params *p = &c->sampling;
    p->temperature = p->temperature > 0 ? p->temperature : 0;
    p->top_k = p->top_k > 0 ? p->top_k : 0;
    p->n_bias = 0;
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
 * again. These are the last ones, as many as the window keeps, and none without a
 * penalty. */
static uint32_t replay_window(const struct seq *q)
{
    const struct kvr_sample_params *p = &q->r->req.sampling;
    bool penalty =
        p->repeat_penalty != 1.0f || p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f;
    if (q->r->req.grammar_bytes) /* the tail's grammar state replays from every token */
        return q->n_replay;
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

static bool grammar_pending(const struct seq *q)
{
    return q->grammar_sent < q->r->req.grammar_bytes;
}

/* Append the GRAMMAR records of a sequence just opened that fit in this batch, with the
 * same room kept as for BIAS records. */
static void emit_grammar(struct kvr_sched *s, struct batch *bt, struct seq *q, uint32_t slot)
{
    const struct kvr_gen_request *rq = &q->r->req;
    while (grammar_pending(q) && bt->n_ctrl + s->plan->max_seqs < s->cfg.max_ctrl) {
        struct kvr_wire_ctrl *c = &bt->ctrl[bt->n_ctrl++];
        *c = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_GRAMMAR, .seq = slot};
        uint32_t k = rq->grammar_bytes - q->grammar_sent;
        k = k < KVR_WIRE_GRAMMAR_BYTES ? k : KVR_WIRE_GRAMMAR_BYTES;
        c->grammar.offset = q->grammar_sent;
        c->grammar.total = rq->grammar_bytes;
        memcpy(c->grammar.text, rq->grammar + q->grammar_sent, k);
        q->grammar_sent += k;
    }
}

/* Append the REPLAY records of a re-opened sequence that fit in this batch, keeping room
 * for the OPEN records other sequences may still need. The first record carries the
 * draws: every sampled (non-greedy) token drew exactly one number (sampler.h). */
static void emit_replay(struct kvr_sched *s, struct batch *bt, struct seq *q, uint32_t slot)
{
    const struct kvr_sched_req *r = q->r;
    uint32_t n_ids = replay_window(q), first = q->n_replay - n_ids;
    while (q->replay_pending && !grammar_pending(q) &&
           bt->n_ctrl + s->plan->max_seqs < s->cfg.max_ctrl) {
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

/* Step 0 of a batch: after the ring (re)connects or loses a batch, the stages may hold
 * sequences the bridge has forgotten, so a probe frees every slot first. */
static void add_probe(struct kvr_sched *s, struct batch *bt)
{
    if (!s->free_all)
        return;
    for (uint32_t i = 0; i < s->plan->max_seqs; i++)
        bt->ctrl[bt->n_ctrl++] = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_FREE, .seq = i};
    s->free_all = false;
}

/* Step 1: FREE (or CANCEL) for sequences that ended and have nothing in flight. Their
 * slots and blocks go first to the sequences a recovery held, then to waiting requests. */
static void add_ends(struct kvr_sched *s, struct batch *bt, uint64_t now)
{
    const struct kvr_plan *p = s->plan;
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        struct seq *q = &s->seqs[i];
        if (q->state != SEQ_ENDING || q->inflight)
            continue;
        if (q->opened)
            bt->ctrl[bt->n_ctrl++] = (struct kvr_wire_ctrl){
                .type = q->cancelled ? KVR_WIRE_CTRL_CANCEL : KVR_WIRE_CTRL_FREE, .seq = i};
        seq_release(s, i, now);
    }
    for (uint32_t i = 0; i < p->max_seqs; i++)
        if (s->seqs[i].state == SEQ_PREFILL && s->seqs[i].kv_blocks == 0)
            (void)prefix_take(s, i);
    start_waiting(s, now);
}

/* The decode rows of a batch. */
struct decode_rows {
    uint32_t n_decoding; /* streams decoding (ready or in flight) */
    double ctx;          /* their mean context */
    uint32_t quota;      /* decode rows per batch: the streams spread over the window */
    uint32_t n_dec;      /* decode rows in this batch */
    uint32_t rows;       /* ... with their drafted rows (spec_policy.h) */
    double pairs;        /* their attention pairs */
};

/* Step 2: one decode row per ready stream, earliest deadline first, spread evenly over
 * the batches in flight. */
static struct decode_rows add_decodes(struct kvr_sched *s, struct batch *bt)
{
    const struct kvr_plan *p = s->plan;
    struct decode_rows d = {0};
    for (uint32_t i = 0; i < p->max_seqs; i++)
        if (s->seqs[i].decoding &&
            (s->seqs[i].state == SEQ_READY || s->seqs[i].state == SEQ_WAIT)) {
            d.n_decoding++;
            d.ctx += s->seqs[i].r->req.n_prompt + s->seqs[i].r->n_generated;
        }
    d.ctx = d.n_decoding ? d.ctx / d.n_decoding : 0;
    d.quota = (d.n_decoding + p->microbatches - 1) / p->microbatches;
    d.quota = d.quota < p->row_width ? d.quota : p->row_width;
    uint32_t *order = s->pick_scratch;
    d.n_dec = pick_decodes(s, d.quota ? d.quota : 1, order);
    for (uint32_t k = 0; k < d.n_dec; k++) {
        uint32_t i = order[k];
        struct seq *q = &s->seqs[i];
        const struct kvr_sched_req *r = q->r;
        uint32_t pos = r->req.n_prompt + r->n_generated - 1;
        bt->segs[bt->n_segs++] = (struct kvr_seg){i, pos, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
        bt->tokens[bt->n_rows++] = q->next_token;
        bt->pairs += kvr_cost_pairs(pos, 1);
        kvr_spec_add_drafts(s, bt, i, d.n_dec - k - 1);
        q->state = SEQ_WAIT;
        q->inflight++;
        prefix_publish(s, i, pos + 1);
    }
    d.rows = bt->n_rows;
    d.pairs = bt->pairs;
    return d;
}

/* The prefilling sequence with the earliest deadline that is not in the batch yet and has
 * its blocks, or -1. */
static int next_prefill(const struct kvr_sched *s, const struct batch *bt)
{
    int best = -1;
    for (uint32_t i = 0; i < s->plan->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state != SEQ_PREFILL || q->kv_blocks == 0)
            continue;
        bool in_batch = false;
        for (uint32_t j = 0; j < bt->n_segs && !in_batch; j++)
            in_batch = bt->segs[j].seq == i;
        if (!in_batch && (best < 0 || seq_deadline(q) < seq_deadline(&s->seqs[best])))
            best = (int)i;
    }
    return best;
}

/* What adding one prompt's chunk did to the batch. */
enum chunk_outcome {
    CHUNK_MORE,    /* added; the batch may take another prompt's chunk */
    CHUNK_FULL,    /* added; the batch is as heavy as pacing allows */
    CHUNK_NO_ROOM, /* nothing added: no room for its records, the next batch goes on */
    CHUNK_OUTCOME_COUNT
};

/* A held sequence's re-prefill (prompt plus the tokens already sent) is what its client
 * waits for after a failure. In one batch it crosses the stages one after another; cut
 * into a chunk per stage, the chunks follow each other through the ring and every stage
 * works at once, so the stream resumes sooner. Chunks below RECOVERY_CHUNK_MIN rows are
 * not worth a batch of their own. */
enum { RECOVERY_CHUNK_MIN = 8 };

static uint32_t recovery_chunk(const struct kvr_sched *s, const struct seq *q, uint32_t n)
{
    uint32_t n_stages = s->plan->n_stages;
    if (q->n_replay == 0 || n_stages < 2 || s->plan->microbatches < 2)
        return n;
    uint32_t total = q->r->req.n_prompt + q->n_replay;
    uint32_t per = (total + n_stages - 1) / n_stages;
    per = per > RECOVERY_CHUNK_MIN ? per : RECOVERY_CHUNK_MIN;
    return n < per ? n : per;
}

/* Add the sequence in `slot`'s next chunk, with its OPEN, MAP, BIAS and REPLAY records
 * first, in at most as many rows as limit_ms allows (pacing.h). */
static enum chunk_outcome add_chunk(struct kvr_sched *s, struct batch *bt, uint32_t slot,
                                    double limit_ms)
{
    struct seq *q = &s->seqs[slot];
    const struct kvr_gen_request *rq = &q->r->req;
    if (!q->opened) {
        if (bt->n_ctrl + 1 + map_records(q) > s->cfg.max_ctrl)
            return CHUNK_NO_ROOM;
        open_record(&bt->ctrl[bt->n_ctrl++], slot, rq);
        emit_map(s, bt, q, slot);
        q->opened = true;
        q->bias_sent = 0;
        q->grammar_sent = 0;
    }
    emit_bias(s, bt, q, slot);
    emit_grammar(s, bt, q, slot);
    emit_replay(s, bt, q, slot);
    uint32_t left = rq->n_prompt + q->n_replay - q->n_prefilled;
    uint32_t room = s->plan->row_width - bt->n_rows;
    uint32_t n = kvr_pacing_prefill_fit(s, (struct kvr_cost_shape){bt->n_rows, bt->pairs},
                                        q->n_prefilled, left < room ? left : room, limit_ms);
    bool full = n < left; /* pacing's limit; a recovery chunk leaves room for others */
    n = recovery_chunk(s, q, n);
    if ((q->replay_pending || bias_pending(q) || grammar_pending(q)) && n == left)
        n--; /* the tail must have its sampler back before the last chunk */
    if (n == 0)
        return CHUNK_NO_ROOM;
    bool last = n == left;
    bt->segs[bt->n_segs++] =
        (struct kvr_seg){slot, q->n_prefilled, n,
                         KVR_SEG_PREFILL | (last ? KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN : 0)};
    prefill_tokens(q, q->n_prefilled, n, bt->tokens + bt->n_rows);
    bt->mixed = bt->mixed || limit_ms > 0;
    bt->n_rows += n;
    bt->pairs += kvr_cost_pairs(q->n_prefilled, n);
    q->n_prefilled += n;
    q->inflight++;
    prefix_publish(s, slot, q->n_prefilled);
    if (last)
        q->state = SEQ_WAIT;
    return full ? CHUNK_FULL : CHUNK_MORE;
}

/* Step 3: prefill chunks in the rest of the row width, earliest deadline first, within
 * pacing's limit (chunked prefill), so a long prompt never stalls the streams. A batch
 * without decode rows while streams decode is limited as if it carried their share: their
 * next batches queue behind it at every stage. */
static void add_prefill(struct kvr_sched *s, struct batch *bt, const struct decode_rows *d,
                        uint64_t now)
{
    struct kvr_cost_shape dec_shape = {bt->n_rows, bt->pairs};
    if (d->n_dec == 0 && d->n_decoding > 0)
        dec_shape = (struct kvr_cost_shape){d->quota, d->quota * d->ctx};
    double limit_ms = kvr_pacing_batch_limit_ms(s, dec_shape, d->n_decoding, now);
    enum chunk_outcome out = CHUNK_MORE;
    while (bt->n_rows < s->plan->row_width && out == CHUNK_MORE) {
        int best = next_prefill(s, bt);
        if (best < 0)
            break;
        out = add_chunk(s, bt, (uint32_t)best, limit_ms);
    }
    if (d->n_dec > 0)
        kvr_pacing_note_mix(s, bt->n_rows - d->rows, bt->pairs - d->pairs);
}

/* Build the next batch into `bt`: control records, decode rows, prefill chunks. Returns
 * false if there is nothing to send. */
static bool build_batch(struct kvr_sched *s, struct batch *bt, uint64_t now)
{
    bt->n_ctrl = bt->n_segs = bt->n_rows = 0;
    bt->pairs = 0;
    bt->mixed = false;
    add_probe(s, bt);
    /* Until the probe has come back through every stage, nothing else goes out: the
     * sequences a recovery held wait for a whole ring. */
    if (!s->ring_up)
        return bt->n_ctrl > 0;
    add_ends(s, bt, now);
    struct decode_rows d = add_decodes(s, bt);
    add_prefill(s, bt, &d, now);
    return bt->n_ctrl > 0 || bt->n_segs > 0;
}

/* ---- results ------------------------------------------------------------------------------ */

/* The gauges of recent activity (utilisation, tokens/s) cover the last whole window. The
 * first result or tick after a window ends closes it. So on an idle ring they fall to 0
 * within two windows instead of keeping their last value. */
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
        /* A stage idle since before this window began reports the whole gap; only the
         * part inside the window counts toward its shares, which never pass 1. */
        uint64_t in_window = now - s->win_start_ns;
        s->win_held[t->stage] += t->held_ns;
        s->win_starved[t->stage] += t->starved_ns < in_window ? t->starved_ns : in_window;
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
    kvr_admission_observe_token(s, r, was_held, now);
    r->held_once = r->held_once || was_held;
    r->last_token_ns = now;
    if (r->n_generated == 1)
        r->first_token_ns = now;
    s->stats.generated_tokens++;
    s->win_tokens++;
    emit_token(s, r, res, eog, now);
    bool last = r->n_generated >= r->req.max_tokens || (eog && !r->req.ignore_eos);
    kvr_admission_observe_estimate(s, r, last, now);
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
        double worst = 0;
        for (uint32_t i = 0; i < f->hdr.n_timings; i++)
            worst = held[i] > worst ? held[i] : worst;
        struct kvr_cost_shape shape = {bt->n_rows, bt->pairs};
        kvr_pacing_observe(s, shape, bt->mixed, held, worst, ms);
    }
    s->stats.batches++;
}

static void became_up(struct kvr_sched *s, uint64_t now)
{
    kvr_sched_trace_recovered(s, now);
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
    kvr_sched_trace_batch(s, bt, f, now);
    uint32_t k = 0;
    for (uint32_t i = 0; i < bt->n_segs; i++) {
        const struct kvr_seg *sg = &bt->segs[i];
        struct seq *q = &s->seqs[sg->seq];
        q->inflight--;
        if (sg->flags & KVR_SEG_PREFILL)
            s->stats.prompt_tokens += sg->n_tokens;
        if (!(sg->flags & KVR_SEG_WANTS_TOKEN))
            continue;
        /* A DRAFTS segment's tokens are its consecutive results (wire.h). */
        uint32_t n_res = 1;
        while ((sg->flags & KVR_SEG_DRAFTS) && n_res < sg->n_tokens &&
               k + n_res < f->hdr.n_results && f->results[k + n_res].seq == sg->seq)
            n_res++;
        for (uint32_t j = 0; j < n_res && q->state == SEQ_WAIT; j++) {
            take_token(s, sg->seq, &f->results[k + j], now);
            q->state = j + 1 < n_res && q->state == SEQ_READY ? SEQ_WAIT : q->state;
        }
        /* else it ended while in flight: the tokens are dropped */
        k += n_res;
        kvr_spec_observe(s, sg, n_res);
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

/* The ring lost state: a link dropped, a stage dropped its sequences, or a batch never
 * came back. Hold every running sequence and start it over once the ring is whole again,
 * from its prompt plus the tokens it had produced (DESIGN.md 8). Batch invariance makes
 * that prefill compute what the lost decodes would have. REPLAY records put the tail's
 * sampler back, so the continuation is exactly the text it would have been. The window is
 * emptied, and only probes go out until a free-all probe comes back. */
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
    kvr_sched_trace_lost(s, n_held, why, now);
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
    r->id = ++s->next_req_id;
    r->deadline_ns = req->total_ms         ? now + req->total_ms * MS_NS
                     : req->first_token_ms ? now + req->first_token_ms * MS_NS
                                           : UINT64_MAX;
    int rc = kvr_admission_admit(s, r, now, why);
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
    /* A stage whose upstream link dropped most likely lost the stage before it. */
    s->reset_blame = batch_id == KVR_WIRE_RESET_LINK && stage > 0 ? stage : stage + 1;
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
    kvr_free(s->lane_scratch);
    kvr_free(s->ends_scratch);
    kvr_free(s->pick_scratch);
    kvr_free(s->seqs);
    kvr_free(s->waitq);
    kvr_spec_destroy(s->spec);
    kvr_free(s);
}

int kvr_sched_create(struct kvr_sched **out, const struct kvr_sched_config *cfg,
                     struct kvr_err *err)
{
    *out = NULL;
    const struct kvr_plan *p = cfg->plan;
    /* A batch must fit a free-all probe (max_seqs records), or a FREE for every slot and
     * then the OPEN and MAP records of one sequence as long as the context. emit_replay
     * and emit_bias keep max_seqs records free for them. */
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
    s->lane_scratch = kvr_calloc((size_t)p->max_seqs + s->max_waiting, sizeof *s->lane_scratch);
    s->pick_scratch = kvr_calloc(p->max_seqs + 1, sizeof *s->pick_scratch);
    s->max_blocks_per_seq = max_blocks;
    s->tables = kvr_calloc((size_t)p->max_seqs * max_blocks, sizeof *s->tables);
    s->found_scratch = kvr_calloc(max_blocks, sizeof *s->found_scratch);
    s->tok_scratch = kvr_calloc(p->kv_block_tokens, sizeof *s->tok_scratch);
    if (!s->seqs || !s->waitq || !s->batches || !s->admit_scratch || !s->ends_scratch ||
        !s->lane_scratch || !s->pick_scratch || !s->tables || !s->found_scratch || !s->tok_scratch)
        goto nomem;
    int rc = kvr_kv_pool_init(&s->pool, p->kv_blocks, p->kv_block_tokens, err);
    if (!rc && cfg->spec == KVR_SPEC_AUTO)
        rc = kvr_spec_create(&s->spec, p->max_seqs, err);
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
