/* costmodel.h - what a micro-batch costs, learnt from the ring's own timing records, and
 * what that means for a request's first and last token (DESIGN.md 6, 9). Pure: no I/O, no
 * locks; the bridge calls it under its own lock.
 *
 * A batch's shape is its row count and its attention work: the number of (row, cached
 * position) pairs its rows attend over, sum of (pos + 1). Each stage's time to hold a batch
 * is modelled as c0 + c1 x rows + c2 x pairs (weights streamed once per batch, matmuls per
 * row, attention per pair), fitted by least squares with exponential forgetting over the
 * batches that came back, so it follows a changing machine. From that:
 *   batch time   the slowest stage's time for a batch of that shape
 *   trip time    every stage's time + the hops (measured round trip - held time)
 *   token period the time between two tokens of one sequence when n sequences decode with
 *                W micro-batches in flight: each batch carries n/W decode rows (plus any
 *                prefill), a sequence waits for its batch to go round (trip time), and the
 *                slowest stage passes only one batch at a time (W x batch time). */
#ifndef KVR_BRIDGE_COSTMODEL_H
#define KVR_BRIDGE_COSTMODEL_H

#include "ring/plan.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_cost_shape {
    double rows;  /* token rows */
    double pairs; /* attention (row, cached position) pairs: sum over rows of pos + 1 */
};

/* Attention pairs of n consecutive rows of one sequence starting at position pos0. */
static inline double kvr_cost_pairs(double pos0, double n)
{
    return n * pos0 + n * (n + 1) / 2;
}

/* Decayed sums of 1, x1 = rows, x2 = pairs, y = held ms, and their products. */
struct kvr_cost_sums {
    double s1, sx1, sx2, sy, sx1x1, sx1x2, sx2x2, sx1y, sx2y;
};

/* Small batches (decode rows, thin chunks) and large ones (prefill) keep separate memories,
 * each forgetting only when a batch of its own kind comes back, and the fit reads both. At a
 * light load dozens of decode batches pass between two prompts: one shared memory would
 * forget what a full batch costs between them. */
enum { KVR_COST_BIG_ROWS = 16 };

struct kvr_cost_stage {
    struct kvr_cost_sums by_size[2]; /* rows < KVR_COST_BIG_ROWS, and the rest */
    double c0, c1, c2;               /* the fit, refreshed at each observation */
};

struct kvr_cost_model {
    uint32_t n_stages;
    uint32_t microbatches;
    double decay; /* weight kept by old samples per new one (e.g. 0.98) */
    struct kvr_cost_stage stage[KVR_PLAN_MAX_STAGES];
    double hop_ms; /* moving average of round trip minus the stages' held time */
    uint64_t n_samples;
};

void kvr_cost_init(struct kvr_cost_model *m, uint32_t n_stages, uint32_t microbatches);
/* One batch came back: its shape, each stage's held time, and its round trip. */
void kvr_cost_observe(struct kvr_cost_model *m, struct kvr_cost_shape shape, const double *held_ms,
                      double round_trip_ms);
/* Enough samples to trust the model. */
bool kvr_cost_ready(const struct kvr_cost_model *m);
/* Predicted held time of stage s for a batch of this shape, ms. */
double kvr_cost_stage_ms(const struct kvr_cost_model *m, uint32_t s, struct kvr_cost_shape b);
/* Slowest stage's time for a batch of this shape, ms. */
double kvr_cost_batch_ms(const struct kvr_cost_model *m, struct kvr_cost_shape b);
/* Time for one batch of this shape to go round the ring with nothing ahead of it, ms. */
double kvr_cost_trip_ms(const struct kvr_cost_model *m, struct kvr_cost_shape b);
/* Time between two tokens of one sequence when n_decode sequences decode, their mean
 * context being ctx positions, and every batch also carries `prefill` rows, ms. */
double kvr_cost_period_ms(const struct kvr_cost_model *m, double n_decode, double ctx,
                          struct kvr_cost_shape prefill);

/* Calibration: how far reality is from the model. Each observation is actual / predicted:
 * of a first-token time, a mixed batch's time, or a whole answer. The factor is the 95th
 * percentile of that ratio, never below `floor`. It is tracked by stochastic
 * approximation: up 10% x 0.95 at a ratio above it, down 10% x 0.05 otherwise, so about 5%
 * stay above. One outlier moves it by a step, not by its size. Predictions are multiplied
 * by it before they are compared with a budget, so the model's own bias and the machine's
 * noise are both paid for. */
struct kvr_calib {
    double mean, var; /* exponentially weighted */
    double hi;        /* the tracked 95th percentile */
    double mid;       /* the tracked median (steps of 6%) */
    uint64_t n;
};

void kvr_calib_observe(struct kvr_calib *c, double ratio);
double kvr_calib_factor(const struct kvr_calib *c, double floor);

/* A mean of recent observations, each weighted by exp(-age / tau_ms), blended with a prior
 * worth prior_weight observations. It follows a change of load within seconds and falls
 * back to the prior when nothing was seen lately. */
struct kvr_recent {
    double sum, weight; /* decayed sums of the observations and of their weights */
    uint64_t t_ns;      /* ... as of this time */
};

void kvr_recent_add(struct kvr_recent *r, double x, uint64_t now, double tau_ms);
double kvr_recent_mean(const struct kvr_recent *r, uint64_t now, double tau_ms, double prior,
                       double prior_weight);

#endif
