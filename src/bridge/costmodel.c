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

void kvr_cost_observe(struct kvr_cost_model *m, uint32_t rows, const double *held_ms,
                      double round_trip_ms)
{
    double x = rows, held_sum = 0;
    for (uint32_t s = 0; s < m->n_stages; s++) {
        double y = held_ms[s];
        m->sw[s] = m->decay * m->sw[s] + 1;
        m->sx[s] = m->decay * m->sx[s] + x;
        m->sy[s] = m->decay * m->sy[s] + y;
        m->sxx[s] = m->decay * m->sxx[s] + x * x;
        m->sxy[s] = m->decay * m->sxy[s] + x * y;
        held_sum += y;
    }
    double hop = round_trip_ms - held_sum;
    hop = hop > 0 ? hop : 0;
    m->hop_ms = m->n_samples ? 0.9 * m->hop_ms + 0.1 * hop : hop;
    m->n_samples++;
}

bool kvr_cost_ready(const struct kvr_cost_model *m) { return m->n_samples >= MIN_SAMPLES; }

double kvr_cost_stage_ms(const struct kvr_cost_model *m, uint32_t s, double rows)
{
    if (s >= m->n_stages || m->sw[s] <= 0)
        return 0;
    double w = m->sw[s], mx = m->sx[s] / w, my = m->sy[s] / w;
    double var = m->sxx[s] / w - mx * mx, cov = m->sxy[s] / w - mx * my;
    /* Too little spread in the row counts seen to fit a slope: assume time grows in
     * proportion to rows from what was seen (pessimistic for larger batches, which is the
     * safe side for admission). */
    double c1 = var > 0.25 ? cov / var : (mx > 0 ? my / mx : 0);
    if (c1 < 0)
        c1 = 0;
    double c0 = my - c1 * mx;
    if (c0 < 0)
        c0 = 0;
    return c0 + c1 * rows;
}

double kvr_cost_batch_ms(const struct kvr_cost_model *m, double rows)
{
    double worst = 0;
    for (uint32_t s = 0; s < m->n_stages; s++) {
        double t = kvr_cost_stage_ms(m, s, rows);
        worst = t > worst ? t : worst;
    }
    return worst;
}

double kvr_cost_trip_ms(const struct kvr_cost_model *m, double rows)
{
    double sum = m->hop_ms;
    for (uint32_t s = 0; s < m->n_stages; s++)
        sum += kvr_cost_stage_ms(m, s, rows);
    return sum;
}

double kvr_cost_period_ms(const struct kvr_cost_model *m, double n_decode, double prefill_rows)
{
    /* Only batches with something in them are sent: fewer sequences than micro-batches
     * means fewer batches in flight. */
    double batches = n_decode < m->microbatches && prefill_rows <= 0 ? n_decode
                                                                     : m->microbatches;
    batches = batches >= 1 ? batches : 1;
    double rows = n_decode / batches + prefill_rows;
    double trip = kvr_cost_trip_ms(m, rows);
    double pipe = batches * kvr_cost_batch_ms(m, rows);
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
    c->n++;
}

double kvr_calib_factor(const struct kvr_calib *c, double floor)
{
    if (c->n < 5)
        return floor > 1.3 ? floor : 1.3; /* too few to know: be careful */
    double f = c->mean + 2 * sqrt(c->var);
    return f > floor ? f : floor;
}
