/* admission.c - estimates and refusal rules for a new request (see admission.h).
 *
 * Reading order: the histograms and refusals, the prefill estimate (prefill_eta), then
 * kvr_admission_admit in its named steps, then the learning from outcomes. */
#include "bridge/admission.h"

#include "bridge/pacing.h"
#include "bridge/sched_state.h"
#include "core/log.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* The whole-answer estimate's gap between tokens is the streams' own lately: each gap
 * weighted by exp(-age / GAP_TAU_MS), beside the cost model's period worth GAP_PRIOR gaps. */
#define GAP_TAU_MS 2000.0
#define GAP_PRIOR 5.0

/* First-token estimates are corrected by the recent mean error (outcome / estimate) of
 * those in the same eta_class. Each error is weighted by exp(-age / ETA_TAU_MS), and no
 * correction counts as ETA_PRIOR of them. So the errors of a saturated spell do not follow
 * into a light one. */
#define ETA_TAU_MS 10000.0
#define ETA_PRIOR 3.0

const double kvr_sched_ratio_bounds[KVR_SCHED_RATIO_BUCKETS] = {0.5,  0.75, 0.9, 1.0, 1.1,
                                                                1.25, 1.5,  2.0, 4.0};

static void observe_ratio(uint64_t *hist, double *sum, double ratio)
{
    uint32_t i = 0;
    while (i < KVR_SCHED_RATIO_BUCKETS && ratio > kvr_sched_ratio_bounds[i])
        i++;
    hist[i]++;
    *sum += ratio;
}

/* A refusal that no retry can help (`never`) carries no retry hint. */
static int refuse(struct kvr_sched *s, struct kvr_refusal *why, enum kvr_refusal_reason reason,
                  bool never, uint32_t retry_ms, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

static int refuse(struct kvr_sched *s, struct kvr_refusal *why, enum kvr_refusal_reason reason,
                  bool never, uint32_t retry_ms, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    why->reason = reason;
    why->never = never;
    why->retry_after_ms = never ? 0 : retry_ms;
    vsnprintf(why->message, sizeof why->message, fmt, ap);
    va_end(ap);
    s->stats.refused[reason]++;
    s->stats.refused_never[reason] += never;
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

/* prefill_eta: when the prompt rows ahead of a new request (its own included) will have
 * gone through. Batches carrying `decode` take prefill chunks within limit_ms (pacing.h).
 * They follow one another at the window's pace, and the last one goes all the way round.
 *
 * The decode rows are those of n_ends sequences, which stop decoding ends[k] ms from now
 * (ascending). Each one that ends takes 1/W of a row out of every batch. A lighter batch
 * takes more prefill rows, since the limit is a factor of the decode-only gap. Once none
 * decodes, the batches are full. A stream's row is in one batch at a time: with n streams
 * fewer than W batches, n of every W batches carry a decode row and its chunk. The other
 * W - n carry only a chunk, which the batch builder limits as if it carried the row. */
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
    b.room = kvr_pacing_prefill_fit(s, dk, pos, width, lim);
    struct kvr_cost_shape full = {dk.rows + b.room, dk.pairs + kvr_cost_pairs(pos, b.room)};
    b.full_ms = kvr_cost_batch_ms(&s->cost, full);
    /* With the window full, a batch goes out each time one comes back. Batches follow each
     * other at the slowest stage's pace, or at a trip over the window if that is longer. */
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
    double alone0 = decode.rows > 0 ? kvr_pacing_window_ms(s, decode, 1.0) : 0;
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
            lim = isinf(limit_ms) ? limit_ms : limit_ms * kvr_pacing_window_ms(s, dk, 1.0) / alone0;
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
            /* The slowest stage sets the pace. It starts only once the first full batch has
             * come through the stages before it. The last batch queues behind the others
             * there, instead of passing those stages on its own time. */
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
 * the first token: a few (the trip, nearly), tens, and the long waits in thin chunks. A
 * request that waits for a slot has its own (WAIT_CLASS): its error is the queue model's. */
#define WAIT_CLASS (ETA_CLASSES - 1)

static uint8_t eta_class(double batches)
{
    return batches < 10 ? 0 : batches < 40 ? 1 : batches < 60 ? 2 : 3;
}

/* What admission knows of the load when a request arrives. */
struct load {
    uint32_t n_compute;           /* prompt rows of ours to prefill (not cached) */
    bool fits;                    /* our KV blocks fit in the pool now */
    double n_before;              /* requests running or waiting before ours */
    double ctx;                   /* mean context of the running sequences */
    double period;                /* expected gap between tokens with ours */
    double rows_ahead;            /* prompt rows to prefill before our first token */
    struct kvr_cost_shape decode; /* decode rows per batch now */
    const double *ends;           /* [n_ends] when the streams ahead stop decoding, ms */
    uint32_t n_ends;
};

/* What admission would promise, with its safety factors applied. */
struct promise {
    double first_ms; /* first token, checked against first_token_ms */
    double total_ms; /* whole answer, checked against total_ms */
    double est_total_ms;
};

/* Step 1: the refusals that need no estimate. Fills ld->n_compute and ld->fits. */
static int check_request(struct kvr_sched *s, struct kvr_sched_req *r, struct load *ld,
                         struct kvr_refusal *why)
{
    const struct kvr_gen_request *req = &r->req;
    const struct kvr_plan *p = s->plan;
    if ((uint64_t)req->n_prompt + req->max_tokens > p->n_ctx)
        return refuse(s, why, KVR_REFUSE_TOO_LONG, true, 0,
                      "prompt (%u tokens) + max_tokens (%u) exceed the context of %u",
                      req->n_prompt, req->max_tokens, p->n_ctx);
    if (!s->ring_up)
        return refuse(s, why, KVR_REFUSE_RING_DOWN, false, 1000, "the ring is down");
    uint32_t need = blocks_for(s, req->n_prompt + req->max_tokens), n_hit;
    ld->fits = kvr_sched_blocks_fit(s, req, &n_hit);
    ld->n_compute = req->n_prompt - n_hit * p->kv_block_tokens;
    r->n_cached = n_hit * p->kv_block_tokens;
    if (need > p->kv_blocks)
        return refuse(s, why, KVR_REFUSE_KV_FULL, true, 0, "needs %u KV blocks, the ring has %u",
                      need, p->kv_blocks);
    if (s->wq_count >= s->max_waiting)
        return refuse(s, why, KVR_REFUSE_QUEUE_FULL, false, 1000, "wait queue full (%u requests)",
                      s->wq_count);
    return KVR_OK;
}

/* Step 2: the load ours joins. The prompt rows ahead are the unsent prefill of running and
 * waiting requests, and ours. The streams ahead stop decoding after their tokens to go;
 * those not decoding yet count as if they started now. */
static void measure_load(struct kvr_sched *s, const struct kvr_gen_request *req, struct load *ld)
{
    const struct kvr_plan *p = s->plan;
    double W = p->microbatches;
    ld->n_before = s->n_running + s->wq_count;
    double n_after = ld->n_before + 1;
    if (n_after > p->max_seqs)
        n_after = p->max_seqs;
    ld->ctx = mean_context(s);
    ld->period = kvr_pacing_period_ms(s, n_after, ld->ctx);
    ld->rows_ahead = ld->n_compute;
    for (uint32_t i = 0; i < p->max_seqs; i++)
        if (s->seqs[i].state == SEQ_PREFILL)
            ld->rows_ahead += s->seqs[i].r->req.n_prompt - s->seqs[i].n_prefilled;
    for (uint32_t k = 0; k < s->wq_count; k++) {
        const struct kvr_sched_req *w = s->waitq[(s->wq_head + k) % s->max_waiting];
        ld->rows_ahead += w->req.n_prompt - w->n_cached;
    }
    double per = ld->n_before / W;
    ld->decode = (struct kvr_cost_shape){per, per * (ld->ctx + 1)};
    double *ends = s->ends_scratch;
    uint32_t n_ends = 0;
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state != SEQ_FREE)
            ends[n_ends++] = q->state == SEQ_ENDING
                                 ? 0
                                 : ((double)q->r->req.max_tokens - q->r->n_generated) * ld->period;
    }
    for (uint32_t k = 0; k < s->wq_count; k++)
        ends[n_ends++] = s->waitq[(s->wq_head + k) % s->max_waiting]->req.max_tokens * ld->period;
    qsort(ends, n_ends, sizeof *ends, cmp_double);
    ld->ends = ends;
    ld->n_ends = n_ends;
}

/* Step 3: when our prompt's last chunk is back. It is estimated at the streams' pace
 * (pacing's limit now). If that misses the budget with the estimates' error, the budget is
 * checked at the urgent pace instead (*check_ms), since pacing rescues a late prompt. The
 * estimate itself takes the urgent pace only when pacing would: when the plain estimate is
 * late against the budget less ADMIT_MARGIN (pacing.c prefill_urgent). */
static struct prefill_eta estimate_first_token(const struct kvr_sched *s,
                                               const struct kvr_gen_request *req,
                                               const struct load *ld, uint64_t now,
                                               double *check_ms)
{
    struct prefill_eta eta =
        prefill_eta(s, ld->decode, req->n_prompt, ld->rows_ahead,
                    kvr_pacing_chunk_limit_ms(s, ld->decode, false, now), ld->ends, ld->n_ends);
    *check_ms = eta.first_ms;
    double f_first = kvr_calib_factor(&s->calib_first, ADMIT_MARGIN);
    if (req->first_token_ms && f_first * eta.first_ms + ld->period > req->first_token_ms) {
        struct prefill_eta fast =
            prefill_eta(s, ld->decode, req->n_prompt, ld->rows_ahead,
                        kvr_pacing_chunk_limit_ms(s, ld->decode, true, now), ld->ends, ld->n_ends);
        if (fast.first_ms < eta.first_ms) {
            *check_ms = fast.first_ms;
            if (eta.first_ms > req->first_token_ms / ADMIT_MARGIN)
                eta = fast;
        }
    }
    return eta;
}

/* Step 4: the wait for a slot or KV when none is free, by a model of the queue (not a
 * worst case). A running request frees its slot and blocks once its tokens to go have come
 * at the gap between tokens: at once if it is ending; after its prompt, then its tokens,
 * if it still prefills (the running prompts go through in deadline order, at the pace
 * prefill_eta gives them). The requests waiting before ours take slots in order, each once
 * a slot and its blocks are free, and keep them for their whole answer. Their prompts, then
 * ours, go through one lane in order, beside the decode rows of the other slots, at the
 * rows per ms the pacing rule leaves such batches. A request that stops early (EOS) only
 * frees its slot sooner. */
struct queue_eta {
    double start_ms; /* ours has its slot and blocks */
    double first_ms; /* ... and its first token */
};

/* The prompt lane beside n_dec decoding streams: ms per prefill row, and the trip of the
 * batch with the last chunk. */
struct lane {
    double ms_per_row, trip_ms;
};

static struct lane lane_pace(const struct kvr_sched *s, double ctx, double n_dec, double share,
                             uint32_t n_prompt, uint64_t now)
{
    double per = n_dec / s->plan->microbatches;
    struct kvr_cost_shape dk = {per, per * (ctx + 1)};
    double lim = kvr_pacing_limit_at_share_ms(s, dk, share, now);
    struct eta_batch b = eta_batch(s, dk, n_prompt / 2.0, lim);
    struct kvr_cost_shape full = {dk.rows + b.room,
                                  dk.pairs + kvr_cost_pairs(n_prompt / 2.0, b.room)};
    return (struct lane){b.step_ms / b.room, kvr_cost_trip_ms(&s->cost, full)};
}

/* The queue model's state: slots as they free up, and the lane's prompts. */
struct queue {
    struct slot_free *ends; /* [max_seqs] the slots that hold a request */
    uint32_t n;
    double *done; /* [max_seqs + max_waiting] when each prompt in the lane is through */
    uint32_t n_done;
    double lane_ms;             /* the lane is free from then on */
    double share_sum, share_ms; /* the waiting share over the lane's time so far */
};

/* When the lane takes a prompt whose slot is there at t_ms: behind the ones before it. */
static double lane_start(const struct queue *qm, double t_ms)
{
    return qm->lane_ms > t_ms ? qm->lane_ms : t_ms;
}

/* A prompt of `rows` rows goes through the lane from lane_start, beside n_dec decoding
 * streams while n_first requests wait for a first token (its own included; they set the
 * pacing rule's share): its first token, ms from now. */
static double lane_through(struct kvr_sched *s, struct queue *qm, double start, double n_dec,
                           double n_first, double ctx, uint32_t n_prompt, double rows, uint64_t now)
{
    /* Pacing widens chunks by the waiting share of recent batches, a mean over seconds: a
     * queue that shrinks keeps the share it had. */
    double share = n_dec > 0 ? n_first / n_dec : 1;
    if (qm->share_ms > 0 && qm->share_sum / qm->share_ms > share)
        share = qm->share_sum / qm->share_ms;
    struct lane pace = lane_pace(s, ctx, n_dec, share, n_prompt, now);
    qm->share_sum += share * rows * pace.ms_per_row;
    qm->share_ms += rows * pace.ms_per_row;
    qm->lane_ms = start + rows * pace.ms_per_row;
    double first = qm->lane_ms + pace.trip_ms;
    qm->done[qm->n_done++] = first;
    return first;
}

/* The running sequences' slots as they free up: at once if ending, after their tokens to go
 * if decoding, after their prompt (in the lane, in deadline order) and their tokens if
 * prefilling. */
static void running_ends(struct kvr_sched *s, struct queue *qm, const struct load *ld,
                         double gap_ms, uint64_t now)
{
    const struct kvr_plan *p = s->plan;
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state == SEQ_FREE || q->state == SEQ_PREFILL)
            continue;
        const struct kvr_sched_req *r = q->r;
        double togo = r->n_generated < r->req.max_tokens ? r->req.max_tokens - r->n_generated : 0;
        double at = q->state == SEQ_ENDING ? 0 : togo * gap_ms;
        qm->ends[qm->n++] = (struct slot_free){at, q->kv_blocks};
    }
    uint32_t n_dec = 0, n_first = s->wq_count + 1; /* the waiting ones and ours */
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        n_dec += s->seqs[i].decoding && s->seqs[i].state != SEQ_ENDING;
        n_first += s->seqs[i].state == SEQ_PREFILL;
    }
    /* The prompts in deadline order (then slot order): each decodes once it is through. */
    for (uint32_t rank = 0;; rank++) {
        const struct seq *q = NULL;
        for (uint32_t i = 0; i < p->max_seqs && !q; i++) {
            const struct seq *c = &s->seqs[i];
            if (c->state != SEQ_PREFILL)
                continue;
            uint32_t before = 0;
            for (uint32_t j = 0; j < p->max_seqs; j++) {
                const struct seq *o = &s->seqs[j];
                before +=
                    o->state == SEQ_PREFILL && (seq_deadline(o) < seq_deadline(c) ||
                                                (seq_deadline(o) == seq_deadline(c) && j < i));
            }
            q = before == rank ? c : NULL;
        }
        if (!q)
            return;
        const struct kvr_sched_req *r = q->r;
        double rows = r->req.n_prompt + q->n_replay - q->n_prefilled;
        double first = lane_through(s, qm, lane_start(qm, 0), n_dec + rank, n_first - rank, ld->ctx,
                                    r->req.n_prompt, rows, now);
        double togo = r->n_generated < r->req.max_tokens ? r->req.max_tokens - r->n_generated : 0;
        qm->ends[qm->n++] =
            (struct slot_free){first + (togo > 1 ? togo - 1 : 0) * gap_ms, q->kv_blocks};
    }
}

/* Take the slot that frees up first out of the queue model. */
static struct slot_free first_free(struct queue *qm)
{
    uint32_t m = 0;
    for (uint32_t i = 1; i < qm->n; i++)
        if (qm->ends[i].at_ms < qm->ends[m].at_ms)
            m = i;
    struct slot_free f = qm->ends[m];
    qm->ends[m] = qm->ends[--qm->n];
    return f;
}

static struct queue_eta queue_eta(struct kvr_sched *s, const struct kvr_sched_req *r,
                                  const struct load *ld, double gap_ms, uint64_t now)
{
    const struct kvr_plan *p = s->plan;
    const uint32_t bt = p->kv_block_tokens;
    struct queue qm = {.ends = s->admit_scratch, .done = s->lane_scratch};
    running_ends(s, &qm, ld, gap_ms, now);
    uint32_t free_slots = p->max_seqs - qm.n;
    int64_t avail = kvr_kv_pool_available(&s->pool);
    double t = 0;
    for (uint32_t k = 0;; k++) {
        const struct kvr_sched_req *w =
            k < s->wq_count ? s->waitq[(s->wq_head + k) % s->max_waiting] : r;
        uint32_t need = blocks_for(s, w->req.n_prompt + w->req.max_tokens) - w->n_cached / bt;
        while ((free_slots == 0 || avail < need) && qm.n > 0) {
            struct slot_free f = first_free(&qm);
            t = f.at_ms > t ? f.at_ms : t;
            free_slots++;
            avail += f.blocks;
        }
        free_slots--;
        avail -= need;
        /* Beside it decode the slots' requests whose prompts are through by then. */
        double start = lane_start(&qm, t), n_pf = 1;
        for (uint32_t j = 0; j < qm.n_done; j++)
            n_pf += qm.done[j] > start;
        double n_dec = p->max_seqs - free_slots - n_pf;
        double first = lane_through(s, &qm, start, n_dec > 0 ? n_dec : 0, n_pf + s->wq_count - k,
                                    ld->ctx, w->req.n_prompt, w->req.n_prompt - w->n_cached, now);
        if (w == r)
            return (struct queue_eta){t, first};
        qm.ends[qm.n++] = (struct slot_free){first + (w->req.max_tokens - 1.0) * gap_ms, need};
    }
}

/* Step 5: the estimates kept in r->est, and the promise checked against the budgets. The
 * estimate is the model corrected by the recent mean error of its eta_class. The budgets
 * use a high quantile of the error instead: the first tokens' for the first-token budget,
 * the whole answers' for the total. The gaps are the streams' recent ones, beside the cost
 * model's period worth GAP_PRIOR gaps. A stream's gaps depend more on the prompts that
 * arrive while it decodes than on the load when it starts. */
static struct promise estimate_answer(struct kvr_sched *s, struct kvr_sched_req *r,
                                      const struct load *ld, double raw_first, double checked_first,
                                      uint8_t cls, uint64_t now)
{
    const struct kvr_gen_request *req = &r->req;
    struct kvr_estimate *e = &r->est;
    double f_first = kvr_calib_factor(&s->calib_first, ADMIT_MARGIN);
    double f_total = kvr_calib_factor(&s->calib_total, ADMIT_MARGIN);
    e->raw_first_ms = raw_first;
    e->checked_first_ms = checked_first;
    e->eta_class = cls;
    double f_class = kvr_recent_mean(&s->first_eta[e->eta_class], now, ETA_TAU_MS, 1.0, ETA_PRIOR);
    e->first_ms = raw_first * f_class;
    double gap_ms = kvr_recent_mean(&s->gaps, now, GAP_TAU_MS, ld->period, GAP_PRIOR);
    e->raw_period_ms = gap_ms;
    double f_answer = s->calib_total.n >= 5 && s->gaps.weight <= 0 ? s->calib_total.mid : 1.0;
    struct promise pr;
    pr.est_total_ms = (e->first_ms + (req->max_tokens - 1) * gap_ms) * f_answer;
    e->period_ms =
        req->max_tokens > 1 ? (pr.est_total_ms - e->first_ms) / (req->max_tokens - 1) : gap_ms;
    /* The client sees its first text one token late when that token is part of a
     * character (streams never split UTF-8): one more gap. */
    pr.first_ms = f_first * checked_first + e->period_ms;
    /* calib_total is the error of raw estimates, so it scales the raw one. */
    pr.total_ms = f_total * (checked_first * f_class + (req->max_tokens - 1) * gap_ms);
    if (s->n_running == 0 && s->wq_count == 0) {
        /* An idle ring risks nobody, and a model that never saw a batch of this shape
         * extrapolates pessimistically. Refuse only what an empty batch's trip and one
         * sequence's period cannot meet, so the model always gets to learn. */
        const struct kvr_cost_shape none = {0, 0};
        pr.first_ms = kvr_cost_trip_ms(&s->cost, none);
        pr.total_ms =
            pr.first_ms + (req->max_tokens - 1) * kvr_cost_period_ms(&s->cost, 1, 0, none);
    }
    return pr;
}

/* What this request alone on an idle ring would take, raw (no safety factor): its prompt
 * in batches of the row width, following each other at the slowest stage's pace (or a trip
 * over the window), the last one all the way round; then its tokens at one stream's period.
 * A budget below it can never be met, whatever the load. */
struct idle {
    double first_ms, total_ms;
};

static struct idle idle_estimate(const struct kvr_sched *s, const struct kvr_gen_request *req,
                                 const struct load *ld)
{
    const struct kvr_cost_model *m = &s->cost;
    double width = s->plan->row_width, rows = ld->n_compute > 0 ? ld->n_compute : 1;
    double n_b = ceil(rows / width - 1e-9);
    struct kvr_cost_shape full = {width, kvr_cost_pairs(req->n_prompt / 2.0, width)};
    double step = kvr_cost_trip_ms(m, full) / s->plan->microbatches;
    step = step > kvr_cost_batch_ms(m, full) ? step : kvr_cost_batch_ms(m, full);
    double last = rows - (n_b - 1) * width;
    struct idle e;
    e.first_ms = (n_b - 1) * step +
                 kvr_cost_trip_ms(
                     m, (struct kvr_cost_shape){last, kvr_cost_pairs(req->n_prompt - last, last)});
    const struct kvr_cost_shape none = {0, 0};
    e.total_ms =
        e.first_ms + (req->max_tokens - 1.0) *
                         kvr_cost_period_ms(m, 1, req->n_prompt + req->max_tokens / 2.0, none);
    return e;
}

/* Step 6: the request's own budgets. A budget that even the idle ring would miss is
 * refused for good (no retry hint); one the load makes late, with a hint. */
static int check_budgets(struct kvr_sched *s, const struct kvr_gen_request *req,
                         const struct load *ld, const struct promise *pr, struct kvr_refusal *why)
{
    struct idle idle = idle_estimate(s, req, ld);
    if (req->first_token_ms && pr->first_ms > req->first_token_ms) {
        if (idle.first_ms > req->first_token_ms)
            return refuse(s, why, KVR_REFUSE_FIRST_TOKEN_BUDGET, true, 0,
                          "can never meet the first-token budget: estimated %.0f ms > %u ms "
                          "even alone on an idle ring",
                          idle.first_ms, req->first_token_ms);
        return refuse(s, why, KVR_REFUSE_FIRST_TOKEN_BUDGET, false,
                      retry_hint_ms(pr->first_ms - req->first_token_ms),
                      "would miss the first-token budget: estimated %.0f ms > %u ms", pr->first_ms,
                      req->first_token_ms);
    }
    if (req->total_ms && pr->total_ms > req->total_ms) {
        if (idle.total_ms > req->total_ms)
            return refuse(s, why, KVR_REFUSE_TOTAL_BUDGET, true, 0,
                          "can never meet the total budget: estimated %.0f ms > %u ms even "
                          "alone on an idle ring",
                          idle.total_ms, req->total_ms);
        return refuse(
            s, why, KVR_REFUSE_TOTAL_BUDGET, false, retry_hint_ms(pr->total_ms - req->total_ms),
            "would miss the total budget: estimated %.0f ms > %u ms", pr->total_ms, req->total_ms);
    }
    return KVR_OK;
}

/* Step 7: the running requests. Our prompt's batches delay them, and every later token of
 * theirs comes at the slower period. Refuse if that makes one that is on time late. */
static int check_running(struct kvr_sched *s, const struct kvr_gen_request *req,
                         const struct load *ld, const struct prefill_eta *eta, uint64_t now,
                         struct kvr_refusal *why)
{
    const struct kvr_plan *p = s->plan;
    double f_period = gap_factor(s);
    double period_before = kvr_pacing_period_ms(s, ld->n_before > 0 ? ld->n_before : 1, ld->ctx);
    double delay =
        req->n_prompt / eta->room * (eta->full_ms - kvr_cost_batch_ms(&s->cost, ld->decode));
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state == SEQ_FREE || q->state == SEQ_ENDING || !q->r->req.total_ms)
            continue;
        const struct kvr_sched_req *other = q->r;
        double left_ms = (other->deadline_ns > now ? other->deadline_ns - now : 0) / 1e6;
        double togo = (double)other->req.max_tokens - other->n_generated;
        double on_time = f_period * togo * period_before;
        double with_us = f_period * (delay + togo * ld->period);
        if (on_time <= left_ms && with_us > left_ms) {
            s->stats.refused_for_running++;
            return refuse(s, why, KVR_REFUSE_TOTAL_BUDGET, false, retry_hint_ms(with_us - left_ms),
                          "would make a running request miss its budget (%.0f ms left, "
                          "%.0f ms needed with this one)",
                          left_ms, with_us);
        }
    }
    return KVR_OK;
}

int kvr_admission_admit(struct kvr_sched *s, struct kvr_sched_req *r, uint64_t now,
                        struct kvr_refusal *why)
{
    const struct kvr_gen_request *req = &r->req;
    r->est = (struct kvr_estimate){0};
    r->n_cached = 0;
    struct load ld = {0};
    int rc = check_request(s, r, &ld, why);
    if (rc || !kvr_cost_ready(&s->cost))
        return rc;
    measure_load(s, req, &ld);
    double check_ms;
    struct prefill_eta eta = estimate_first_token(s, req, &ld, now, &check_ms);
    double raw_first = eta.first_ms, wait_ms = 0;
    uint8_t cls = eta_class(eta.batches);
    if (s->wq_count > 0 || s->n_running >= s->plan->max_seqs || !ld.fits) {
        /* It waits for a slot or KV (or behind requests that do, in order): the queue
         * model gives its first token. */
        /* The measured pace, never below the cost model's period at the load ours joins:
         * gaps measured at a lighter load a moment ago would promise a burst too much. */
        double gap_ms = kvr_recent_mean(&s->gaps, now, GAP_TAU_MS, ld.period, GAP_PRIOR);
        gap_ms = gap_ms > ld.period ? gap_ms : ld.period;
        struct queue_eta q = queue_eta(s, r, &ld, gap_ms, now);
        wait_ms = q.start_ms;
        raw_first = check_ms = q.first_ms;
        cls = WAIT_CLASS;
    }
    struct promise pr = estimate_answer(s, r, &ld, raw_first, check_ms, cls, now);
    KVR_DEBUG("bridge: estimate %llu: prompt %u (%u to compute, %.0f rows ahead in %.0f batches "
              "of %.0f), %u running, %u waiting, slot wait %.0f ms, step %.0f ms, period %.1f "
              "ms; first token %.0f ms (raw %.0f, checked %.0f), whole %.0f ms (checked %.0f)",
              (unsigned long long)now, req->n_prompt, ld.n_compute, ld.rows_ahead, eta.batches,
              eta.room, s->n_running, s->wq_count, wait_ms, eta.step_ms, ld.period, r->est.first_ms,
              raw_first, pr.first_ms, pr.est_total_ms, pr.total_ms);
    if (!s->cfg.admission) /* estimated (and exported) all the same, never refused */
        return KVR_OK;
    rc = check_budgets(s, req, &ld, &pr, why);
    if (rc)
        return rc;
    return check_running(s, req, &ld, &eta, now, why);
}

void kvr_admission_observe_token(struct kvr_sched *s, struct kvr_sched_req *r, bool was_held,
                                 uint64_t now)
{
    const struct kvr_estimate *e = &r->est;
    if (!was_held && r->n_generated == 1 && e->raw_first_ms > 0 && e->checked_first_ms > 0) {
        double ms = (now - r->submit_ns) / 1e6;
        kvr_calib_observe(&s->calib_first, ms / e->checked_first_ms);
        kvr_recent_add(&s->first_eta[e->eta_class], ms / e->raw_first_ms, now, ETA_TAU_MS);
    } else if (!was_held && r->n_generated > 1) {
        /* Every gap as it happens, not whole answers when they end: those describe the
         * load of seconds ago. */
        kvr_recent_add(&s->gaps, (now - r->last_token_ns) / 1e6, now, GAP_TAU_MS);
    }
}

/* A request held by a ring failure says nothing about the estimate. The whole answer is
 * predicted for the tokens it had. */
void kvr_admission_observe_estimate(struct kvr_sched *s, struct kvr_sched_req *r, bool last,
                                    uint64_t now)
{
    const struct kvr_estimate *e = &r->est;
    if (e->first_ms <= 0 || r->held_once)
        return;
    double actual = (now - r->submit_ns) / 1e6;
    if (r->n_generated == 1)
        observe_ratio(s->stats.first_ratio_hist, &s->stats.first_ratio_sum,
                      e->first_ms / (actual > 0 ? actual : 1e-3));
    if (last) {
        double pred = e->first_ms + (r->n_generated - 1) * e->period_ms;
        observe_ratio(s->stats.total_ratio_hist, &s->stats.total_ratio_sum,
                      pred / (actual > 0 ? actual : 1e-3));
        KVR_DEBUG("bridge: estimate %llu done: %u tokens, first token %.0f ms (estimated %.0f), "
                  "whole %.0f ms (estimated %.0f)",
                  (unsigned long long)r->submit_ns, r->n_generated,
                  (r->first_token_ns - r->submit_ns) / 1e6, e->first_ms, actual, pred);
        double raw = e->first_ms + (r->n_generated - 1) * e->raw_period_ms;
        kvr_calib_observe(&s->calib_total, actual / raw);
    }
}
