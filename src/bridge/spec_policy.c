/* spec_policy.c - when and how much to speculate (see spec_policy.h). Reading order: the
 * per-slot state, the saturation test, the choice of k, drafting, results. */
#include "bridge/spec_policy.h"

#include "bridge/draft.h"
#include "bridge/sched_state.h"
#include "core/alloc.h"
#include "model/spec_accept.h"

#include <string.h>

enum {
    SUFFIX_TOKENS = 1 << 16, /* tokens of recent answers the suffix source keeps */
    SUFFIX_SLOTS = 1 << 16,  /* its n-gram index */
};

#define SATURATED_UTIL 0.85 /* the busiest stage's held share that means "no spare rows" */
#define STARVED_MIN 0.2     /* ... or its starved share below this: it never waits for work */
#define ACC_DECAY 0.8       /* weight an old verification keeps per new one */
#define PRIOR_WEIGHT 2.0    /* the prior counts as this many drafted positions */

/* A new sequence's acceptance per drafted position, by source: a client's prediction is
 * usually right; lookups are guesses. */
static const double prior_acceptance[KVR_DRAFT_SOURCE_COUNT] = {0.8, 0.3, 0.4};

struct spec_seq {
    uint64_t req_id;                      /* the request these figures are for */
    double kept[KVR_DRAFT_SOURCE_COUNT];  /* decayed drafted tokens accepted */
    double tried[KVR_DRAFT_SOURCE_COUNT]; /* decayed drafted positions decided */
    uint8_t source;                       /* of the drafts in flight */
    int32_t drafts[KVR_SPEC_MAX_DRAFT];   /* proposals (scratch) */
};

struct kvr_spec {
    struct spec_seq *seqs; /* [max_seqs] */
    struct kvr_draft_suffix suffix;
};

int kvr_spec_create(struct kvr_spec **out, uint32_t max_seqs, struct kvr_err *err)
{
    *out = NULL;
    struct kvr_spec *sp = kvr_calloc(1, sizeof *sp);
    if (!sp || !(sp->seqs = kvr_calloc(max_seqs, sizeof *sp->seqs))) {
        kvr_spec_destroy(sp);
        return kvr_err_set(err, KVR_ENOMEM, "sched: out of memory for speculation");
    }
    int rc = kvr_draft_suffix_init(&sp->suffix, SUFFIX_TOKENS, SUFFIX_SLOTS, err);
    if (rc) {
        kvr_spec_destroy(sp);
        return rc;
    }
    *out = sp;
    return KVR_OK;
}

void kvr_spec_destroy(struct kvr_spec *sp)
{
    if (!sp)
        return;
    kvr_draft_suffix_fini(&sp->suffix);
    kvr_free(sp->seqs);
    kvr_free(sp);
}

/* The slot's state, started afresh for a request it has not seen. */
static struct spec_seq *seq_state(struct kvr_spec *sp, uint32_t slot, const struct kvr_sched_req *r)
{
    struct spec_seq *ss = &sp->seqs[slot];
    if (ss->req_id != r->id) {
        memset(ss, 0, sizeof *ss);
        ss->req_id = r->id;
    }
    return ss;
}

static double acceptance(const struct spec_seq *ss, uint32_t src)
{
    return (ss->kept[src] + PRIOR_WEIGHT * prior_acceptance[src]) / (ss->tried[src] + PRIOR_WEIGHT);
}

int kvr_sched_spec_parse(const char *s, enum kvr_spec_mode *out)
{
    if (!strcmp(s, "off"))
        *out = KVR_SPEC_OFF;
    else if (!strcmp(s, "auto"))
        *out = KVR_SPEC_AUTO;
    else
        return KVR_EINVAL;
    return KVR_OK;
}

/* ---- saturation --------------------------------------------------------------------------- */

const char *kvr_spec_saturated(const struct kvr_sched *s)
{
    if (s->cfg.spec != KVR_SPEC_AUTO)
        return "speculation is off";
    if (s->wq_count > 0)
        return "requests wait for a slot";
    for (uint32_t i = 0; i < s->plan->max_seqs; i++)
        if (s->seqs[i].state == SEQ_PREFILL)
            return "a prompt is being prefilled";
    for (uint32_t i = 0; i < s->plan->n_stages; i++) {
        const struct kvr_sched_stage_stats *st = &s->stats.stage[i];
        if (st->util >= SATURATED_UTIL || (st->util > 0 && st->starved_frac < STARVED_MIN))
            return "a stage is saturated";
    }
    return NULL;
}

/* ---- how many ---------------------------------------------------------------------------- */

/* The time a batch of `rows` decode rows costs its sequences (ms, or a relative guess
 * before the cost model is ready): its trip round the ring when it is alone, the slowest
 * stage's time when other sequences' batches share the pipeline. */
static double cost_ms(const struct kvr_sched *s, double rows)
{
    if (!kvr_cost_ready(&s->cost))
        return 1.0 + 0.1 * rows;
    struct kvr_cost_shape b = {rows, 0};
    return s->n_running > 1 ? kvr_cost_batch_ms(&s->cost, b) : kvr_cost_trip_ms(&s->cost, b);
}

/* ... with `rows` rows, `base_ms` at base_rows. Each added row costs at least 1% more: a
 * fit that has seen few shapes must not make rows look free. */
static double lap_ms(const struct kvr_sched *s, double rows, double base_rows, double base_ms)
{
    double floor = base_ms * (1.0 + 0.01 * (rows - base_rows)), t = cost_ms(s, rows);
    return t > floor ? t : floor;
}

/* The k <= n_prop that maximises the batch's expected tokens per lap: n_rows decode rows
 * (this sequence's included) each give one token, and this one 1 + a + ... + a^k. */
static uint32_t best_k(const struct kvr_sched *s, double a, uint32_t n_prop, uint32_t n_rows)
{
    double base = cost_ms(s, n_rows);
    base = base > 0 ? base : 1e-3;
    double best_v = n_rows / base, extra = 0, ak = 1;
    uint32_t best = 0;
    for (uint32_t k = 1; k <= n_prop; k++) {
        ak *= a;
        extra += ak;
        double v = (n_rows + extra) / lap_ms(s, n_rows + k, n_rows, base);
        if (v > best_v) {
            best_v = v;
            best = k;
        }
    }
    return best;
}

/* ---- drafting ---------------------------------------------------------------------------- */

/* Up to max_k proposals for the request, from the first source that has any. */
static uint32_t propose(struct kvr_spec *sp, const struct kvr_sched_req *r, uint32_t max_k,
                        int32_t *out, uint8_t *src)
{
    const struct kvr_draft_text text = {r->req.prompt, r->req.n_prompt, r->generated,
                                        r->n_generated};
    uint32_t n = 0;
    if (r->req.n_prediction)
        n = kvr_draft_prediction(r->req.prediction, r->req.n_prediction, r->generated,
                                 r->n_generated, max_k, out);
    *src = KVR_DRAFT_PREDICTION;
    if (n == 0) {
        n = kvr_draft_prompt(&text, max_k, out);
        *src = KVR_DRAFT_PROMPT;
    }
    if (n == 0) {
        n = kvr_draft_suffix_propose(&sp->suffix, &text, max_k, out);
        *src = KVR_DRAFT_SUFFIX;
    }
    return n;
}

/* The most drafts the sequence may take: its answer's length, the context, the spare rows
 * and control records of the batch. */
static uint32_t draft_room(const struct kvr_sched *s, const struct batch *bt,
                           const struct kvr_sched_req *r, uint32_t rows_after)
{
    uint32_t pos = r->req.n_prompt + r->n_generated - 1;
    int64_t room = KVR_SPEC_MAX_DRAFT;
    int64_t by_len = (int64_t)r->req.max_tokens - r->n_generated - 1;
    int64_t by_ctx = (int64_t)s->plan->n_ctx - pos - 1;
    int64_t by_rows = (int64_t)s->plan->row_width - bt->n_rows - rows_after;
    int64_t by_ctrl = ((int64_t)s->cfg.max_ctrl - bt->n_ctrl - s->plan->max_seqs) *
                      KVR_WIRE_DRAFT_IDS; /* room kept as for BIAS and REPLAY */
    room = by_len < room ? by_len : room;
    room = by_ctx < room ? by_ctx : room;
    room = by_rows < room ? by_rows : room;
    room = by_ctrl < room ? by_ctrl : room;
    return room > 0 ? (uint32_t)room : 0;
}

uint32_t kvr_spec_add_drafts(struct kvr_sched *s, struct batch *bt, uint32_t slot,
                             uint32_t rows_after)
{
    const struct kvr_sched_req *r = s->seqs[slot].r;
    /* A drafted row carries no alternatives, and a constrained one's logprob would be the
     * masked row's (ring/step.c): a sequence that wants alternatives, or a grammar and
     * logprobs, is never drafted for. */
    if (!s->spec || kvr_spec_saturated(s) || r->req.top_logprobs ||
        (r->req.grammar && r->req.logprobs))
        return 0;
    uint32_t room = draft_room(s, bt, r, rows_after);
    if (room == 0)
        return 0;
    struct spec_seq *ss = seq_state(s->spec, slot, r);
    uint8_t src;
    uint32_t n = propose(s->spec, r, room, ss->drafts, &src);
    if (n == 0)
        return 0;
    uint32_t k = best_k(s, acceptance(ss, src), n, bt->n_rows + rows_after);
    if (k == 0)
        return 0;
    struct kvr_seg *sg = &bt->segs[bt->n_segs - 1];
    bt->pairs += kvr_cost_pairs(sg->pos0, 1 + k) - kvr_cost_pairs(sg->pos0, 1);
    sg->n_tokens = 1 + k;
    sg->flags |= KVR_SEG_DRAFTS;
    memcpy(bt->tokens + bt->n_rows, ss->drafts, k * sizeof *ss->drafts);
    bt->n_rows += k;
    for (uint32_t first = 0; first < k; first += KVR_WIRE_DRAFT_IDS) {
        struct kvr_wire_ctrl *c = &bt->ctrl[bt->n_ctrl++];
        *c = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_DRAFT, .seq = slot};
        c->draft.n_ids = k - first < KVR_WIRE_DRAFT_IDS ? k - first : KVR_WIRE_DRAFT_IDS;
        memcpy(c->draft.ids, ss->drafts + first, c->draft.n_ids * sizeof *c->draft.ids);
    }
    ss->source = src;
    return k;
}

/* ---- results ----------------------------------------------------------------------------- */

void kvr_spec_observe(struct kvr_sched *s, const struct kvr_seg *sg, uint32_t n_kept)
{
    struct seq *q = &s->seqs[sg->seq];
    struct kvr_sched_req *r = q->r;
    if (!s->spec || !r)
        return;
    struct spec_seq *ss = seq_state(s->spec, sg->seq, r);
    if (sg->flags & KVR_SEG_DRAFTS) {
        uint32_t k = sg->n_tokens - 1, acc = n_kept > 0 ? n_kept - 1 : 0;
        uint32_t src = ss->source;
        /* Positions decided: the accepted ones and the first rejected one. */
        ss->kept[src] = ACC_DECAY * ss->kept[src] + acc;
        ss->tried[src] = ACC_DECAY * ss->tried[src] + acc + (acc < k);
        s->stats.spec_drafted[src] += k;
        s->stats.spec_accepted[src] += acc;
        s->stats.spec_steps[src]++;
        r->spec_drafted += k;
        r->spec_accepted += acc;
        r->spec_steps++;
    }
    if (q->state == SEQ_ENDING && !q->cancelled && r->n_generated > 0)
        kvr_draft_suffix_add(&s->spec->suffix, r->generated, r->n_generated);
}
