#include "bridge/costmodel.h"

#include <math.h>
#include <string.h>

enum { MIN_SAMPLES = 8 };

void kvr_cost_init(struct kvr_cost_model *m, uint32_t n_stages, uint32_t microbatches)
{
    memset(m, 0, sizeof *m);
    m->n_stages = n_stages < KVR_PLAN_MAX_STAGES ? n_stages : KVR_PLAN_MAX_STAGES;
    m->microbatches = microbatches ? microbatches : 1;
    m->decay = 0.98;
}

/* Least squares of y on (x1, x2) from the decayed sums of both memories (small and large
 * batches). The coefficients are kept >= 0: time never falls when a batch grows. A
 * regressor with no spread (say every batch had the same row count) cannot be separated
 * from the constant. Then time is taken as proportional to it, which overestimates larger
 * batches: the safe side for admission. */
static void fit(struct kvr_cost_stage *st)
{
    const struct kvr_cost_sums *a = &st->by_size[0], *b = &st->by_size[1];
    double w = a->s1 + b->s1;
    if (w <= 0)
        return;
    double m1 = (a->sx1 + b->sx1) / w, m2 = (a->sx2 + b->sx2) / w, my = (a->sy + b->sy) / w;
    double v11 = (a->sx1x1 + b->sx1x1) / w - m1 * m1, v22 = (a->sx2x2 + b->sx2x2) / w - m2 * m2;
    double v12 = (a->sx1x2 + b->sx1x2) / w - m1 * m2;
    double c1y = (a->sx1y + b->sx1y) / w - m1 * my, c2y = (a->sx2y + b->sx2y) / w - m2 * my;
    double c1 = 0, c2 = 0;
    bool spread1 = v11 > 0.25, spread2 = v22 > 0.25 * (m2 * m2 > 1 ? m2 * m2 * 1e-4 : 1);
    double det = v11 * v22 - v12 * v12;
    if (spread1 && spread2 && det > 1e-6 * v11 * v22) {
        c1 = (c1y * v22 - c2y * v12) / det;
        c2 = (c2y * v11 - c1y * v12) / det;
    }
    if (!(spread1 && spread2 && det > 1e-6 * v11 * v22) || c1 < 0 || c2 < 0) {
        /* One regressor at a time: the one that explains more. */
        double r1 = spread1 ? c1y / v11 : 0, r2 = spread2 ? c2y / v22 : 0;
        double gain1 = spread1 && r1 > 0 ? r1 * c1y : 0, gain2 = spread2 && r2 > 0 ? r2 * c2y : 0;
        c1 = gain1 >= gain2 ? (r1 > 0 ? r1 : 0) : 0;
        c2 = gain2 > gain1 ? r2 : 0;
        if (!spread1 && !spread2 && m1 > 0)
            c1 = my / m1;
    }
    double c0 = my - c1 * m1 - c2 * m2;
    st->c0 = c0 > 0 ? c0 : 0;
    st->c1 = c1;
    st->c2 = c2;
}

void kvr_cost_observe(struct kvr_cost_model *m, struct kvr_cost_shape shape, const double *held_ms,
                      double round_trip_ms)
{
    double x1 = shape.rows, x2 = shape.pairs, held_sum = 0, d = m->decay;
    for (uint32_t s = 0; s < m->n_stages; s++) {
        struct kvr_cost_stage *stage = &m->stage[s];
        struct kvr_cost_sums *st = &stage->by_size[x1 >= KVR_COST_BIG_ROWS];
        double y = held_ms[s];
        st->s1 = d * st->s1 + 1;
        st->sx1 = d * st->sx1 + x1;
        st->sx2 = d * st->sx2 + x2;
        st->sy = d * st->sy + y;
        st->sx1x1 = d * st->sx1x1 + x1 * x1;
        st->sx1x2 = d * st->sx1x2 + x1 * x2;
        st->sx2x2 = d * st->sx2x2 + x2 * x2;
        st->sx1y = d * st->sx1y + x1 * y;
        st->sx2y = d * st->sx2y + x2 * y;
        fit(stage);
        held_sum += y;
    }
    double hop = round_trip_ms - held_sum;
    hop = hop > 0 ? hop : 0;
    m->hop_ms = m->n_samples ? 0.9 * m->hop_ms + 0.1 * hop : hop;
    m->n_samples++;
}

bool kvr_cost_ready(const struct kvr_cost_model *m)
{
    return m->n_samples >= MIN_SAMPLES;
}

double kvr_cost_stage_ms(const struct kvr_cost_model *m, uint32_t s, struct kvr_cost_shape b)
{
    if (s >= m->n_stages)
        return 0;
    const struct kvr_cost_stage *st = &m->stage[s];
    return st->c0 + st->c1 * b.rows + st->c2 * b.pairs;
}

double kvr_cost_batch_ms(const struct kvr_cost_model *m, struct kvr_cost_shape b)
{
    double worst = 0;
    for (uint32_t s = 0; s < m->n_stages; s++) {
        double t = kvr_cost_stage_ms(m, s, b);
        worst = t > worst ? t : worst;
    }
    return worst;
}

double kvr_cost_trip_ms(const struct kvr_cost_model *m, struct kvr_cost_shape b)
{
    double sum = m->hop_ms;
    for (uint32_t s = 0; s < m->n_stages; s++)
        sum += kvr_cost_stage_ms(m, s, b);
    return sum;
}

double kvr_cost_period_ms(const struct kvr_cost_model *m, double n_decode, double ctx,
                          struct kvr_cost_shape prefill)
{
    /* Only batches with something in them are sent: fewer sequences than micro-batches
     * means fewer batches in flight. */
    double batches = n_decode < m->microbatches && prefill.rows <= 0 ? n_decode : m->microbatches;
    batches = batches >= 1 ? batches : 1;
    double per = n_decode / batches;
    struct kvr_cost_shape b = {per + prefill.rows, per * (ctx + 1) + prefill.pairs};
    double trip = kvr_cost_trip_ms(m, b);
    double pipe = batches * kvr_cost_batch_ms(m, b);
    return trip > pipe ? trip : pipe;
}

void kvr_calib_observe(struct kvr_calib *c, double ratio)
{
    if (!(ratio > 0) || ratio > 1e3)
        return; /* a broken measurement, not a signal */
    double a = c->n < 20 ? 1.0 / (double)(c->n + 1) : 0.05;
    double d = ratio - c->mean;
    c->mean += a * d;
    c->var = (1 - a) * (c->var + a * d * d);
    if (c->n == 0) {
        c->hi = c->mid = ratio;
    } else {
        c->hi *= ratio > c->hi ? exp(0.1 * 0.95) : exp(-0.1 * 0.05);
        c->mid *= ratio > c->mid ? exp(0.06) : exp(-0.06);
    }
    c->n++;
}

double kvr_calib_factor(const struct kvr_calib *c, double floor)
{
    if (c->n < 5)
        return floor > 1.3 ? floor : 1.3; /* too few to know: be careful */
    return c->hi > floor ? c->hi : floor;
}

static double recent_decay(const struct kvr_recent *r, uint64_t now, double tau_ms)
{
    return now > r->t_ns ? exp(-(double)(now - r->t_ns) / 1e6 / tau_ms) : 1.0;
}

void kvr_recent_add(struct kvr_recent *r, double x, uint64_t now, double tau_ms)
{
    if (!isfinite(x))
        return;
    double w = recent_decay(r, now, tau_ms);
    r->sum = r->sum * w + x;
    r->weight = r->weight * w + 1;
    r->t_ns = now > r->t_ns ? now : r->t_ns;
}

double kvr_recent_mean(const struct kvr_recent *r, uint64_t now, double tau_ms, double prior,
                       double prior_weight)
{
    double w = recent_decay(r, now, tau_ms);
    double den = r->weight * w + prior_weight;
    return den > 0 ? (r->sum * w + prior * prior_weight) / den : prior;
}
