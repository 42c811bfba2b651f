/* pacing.c - the chunking policy of chunked prefill (see pacing.h). */
#include "bridge/pacing.h"

#include "bridge/sched_state.h"

#include <math.h>

/* Prefill beside decode rows may stretch the streams' gaps at most this factor. */
#define ITL_SLOWDOWN 1.8

/* The waiting share is a mean over recent batches, not the count of the moment. Chunks
 * then follow the load of the last seconds, which admission knows, and not the requests
 * that arrive later, which it cannot know. */
#define SHARE_TAU_MS 10000.0

/* Prefill rows a batch with decodes still takes, so prompts progress. */
#define MIN_PREFILL_ROWS 1u

/* The cost model's period, with the prefill rows recent batches carried. A stream shares
 * its batches with the prompts that arrive while it decodes. */
double kvr_pacing_period_ms(const struct kvr_sched *s, double n, double ctx)
{
    return kvr_cost_period_ms(&s->cost, n, ctx, (struct kvr_cost_shape){s->mix_rows, s->mix_pairs});
}

/* A stream waits for its batch to go round the ring (the trip), and the slowest stage
 * passes the window's batches one at a time: the longer of the two. Only the stages' times
 * are scaled by f, since f is the error of the model of stage times; hops are measured. */
double kvr_pacing_window_ms(const struct kvr_sched *s, struct kvr_cost_shape b, double f)
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

/* The safety factor on a mixed batch's predicted time: the mean of actual / predicted
 * plus 1.5 standard deviations. A higher quantile starves prefill. The mean alone lets a
 * long prompt stretch the streams' worst gaps. */
static double mixed_factor(const struct kvr_sched *s)
{
    double sd = sqrt(s->calib_mixed.var);
    double f = s->calib_mixed.n >= 5 ? s->calib_mixed.mean + 1.5 * sd : 1.0;
    return f > 1.0 ? f : 1.0;
}

/* A binary search for the largest row count whose predicted period fits. It never goes
 * below MIN_PREFILL_ROWS, so prompts always progress. */
uint32_t kvr_pacing_prefill_fit(const struct kvr_sched *s, struct kvr_cost_shape cur, double pos0,
                                uint32_t max_n, double limit_ms)
{
    if (limit_ms <= 0 || max_n <= MIN_PREFILL_ROWS)
        return max_n;
    double f = mixed_factor(s);
    uint32_t lo = MIN_PREFILL_ROWS, hi = max_n;
    while (lo < hi) { /* the largest n whose predicted period fits */
        uint32_t mid = lo + (hi - lo + 1) / 2;
        struct kvr_cost_shape t = {cur.rows + mid, cur.pairs + kvr_cost_pairs(pos0, mid)};
        if (kvr_pacing_window_ms(s, t, f) <= limit_ms)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The least gap between tokens the decoding streams can afford and still be on time. A
 * stream affords its budget's time left over its tokens to go, less ADMIT_MARGIN. A stream
 * late even alone (it affords less than `alone`) sets no limit: holding every prompt back
 * would not save it. INFINITY if no stream has a total budget. */
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
    uint32_t n = kvr_pacing_prefill_fit(s, decode, pos0, width, limit_ms);
    struct kvr_cost_shape b = {decode.rows + n, decode.pairs + kvr_cost_pairs(pos0, n)};
    return s->plan->microbatches * n / kvr_pacing_window_ms(s, b, mixed_factor(s));
}

/* Whether a prefilling sequence would miss its first-token budget at `rate` prefill rows
 * per ms but not at `full_rate`. Its rows are its own and those of the prompts ahead of it
 * (earliest deadline first); the last batch's trip comes after them. A prompt late even at
 * full rate is not worth stalling the streams for. */
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

/* Requests waiting for a first token over streams decoding, at least 1. A prompt's delay
 * counts as much as a stream's: one prompt beside eight streams gets thin chunks, thirty
 * prompts beside four streams nearly full batches. */
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

/* The rule of pacing.h. Admission asks with urgent_too for a request it has not counted. */
double kvr_pacing_chunk_limit_ms(const struct kvr_sched *s, struct kvr_cost_shape decode,
                                 bool urgent_too, uint64_t now)
{
    if (decode.rows <= 0 || !kvr_cost_ready(&s->cost))
        return 0;
    double alone = kvr_pacing_window_ms(s, decode, 1.0);
    double afford = affordable_gap_ms(s, alone, now);
    double share = kvr_recent_mean(&s->share, now, SHARE_TAU_MS, 1.0, 1.0);
    double cap = ITL_SLOWDOWN * share * alone;
    if (afford <= cap || urgent_too)
        return afford;
    double rate = prefill_rate(s, decode, 0, cap), full = prefill_rate(s, decode, 0, afford);
    return prefill_urgent(s, rate, full, alone, now) ? afford : cap;
}

double kvr_pacing_limit_at_share_ms(const struct kvr_sched *s, struct kvr_cost_shape decode,
                                    double share, uint64_t now)
{
    if (decode.rows <= 0 || !kvr_cost_ready(&s->cost))
        return 0;
    double alone = kvr_pacing_window_ms(s, decode, 1.0);
    double afford = affordable_gap_ms(s, alone, now);
    double cap = ITL_SLOWDOWN * (share > 1 ? share : 1) * alone;
    return afford <= cap ? afford : cap;
}

double kvr_pacing_batch_limit_ms(struct kvr_sched *s, struct kvr_cost_shape decode,
                                 uint32_t n_decoding, uint64_t now)
{
    if (n_decoding > 0)
        kvr_recent_add(&s->share, waiting_share(s), now, SHARE_TAU_MS);
    return kvr_pacing_chunk_limit_ms(s, decode, false, now);
}

void kvr_pacing_note_mix(struct kvr_sched *s, double prefill_rows, double prefill_pairs)
{
    s->mix_rows = 0.995 * s->mix_rows + 0.005 * prefill_rows;
    s->mix_pairs = 0.995 * s->mix_pairs + 0.005 * prefill_pairs;
}

void kvr_pacing_observe(struct kvr_sched *s, struct kvr_cost_shape shape, bool mixed,
                        const double *held_ms, double worst_ms, double round_trip_ms)
{
    if (mixed && kvr_cost_ready(&s->cost))
        kvr_calib_observe(&s->calib_mixed, worst_ms / kvr_cost_batch_ms(&s->cost, shape));
    kvr_cost_observe(&s->cost, shape, held_ms, round_trip_ms);
}
