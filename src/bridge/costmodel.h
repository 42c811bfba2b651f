/* costmodel.h - what a micro-batch costs, learnt from the ring's own timing records, and
 * what that means for a request's first and last token (DESIGN.md 6, 9). Pure: no I/O, no
 * locks; the bridge calls it under its own lock.
 *
 * Each stage's time to hold a batch is modelled as c0 + c1 x rows, fitted by least squares
 * with exponential forgetting over the batches that came back (so it follows a changing
 * machine). From that:
 *   batch time   t(rows)  = the slowest stage's time for a batch of that many rows
 *   trip time    sum of every stage's time + the hops (measured round trip - held time)
 *   token period the time between two tokens of one sequence when n sequences decode with
 *                W micro-batches in flight: each batch carries n/W decode rows (plus any
 *                prefill), a sequence waits for its batch to go round (trip time), and the
 *                slowest stage can pass only one batch at a time (W x t).
 */
#ifndef KVR_BRIDGE_COSTMODEL_H
#define KVR_BRIDGE_COSTMODEL_H

#include "ring/plan.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_cost_model {
    uint32_t n_stages;
    uint32_t microbatches;
    double decay;   /* weight kept by old samples per new one (e.g. 0.98) */
    double sw[KVR_PLAN_MAX_STAGES], sx[KVR_PLAN_MAX_STAGES], sy[KVR_PLAN_MAX_STAGES];
    double sxx[KVR_PLAN_MAX_STAGES], sxy[KVR_PLAN_MAX_STAGES];
    double hop_ms;  /* moving average of round trip minus the stages' held time */
    uint64_t n_samples;
};

void kvr_cost_init(struct kvr_cost_model *m, uint32_t n_stages, uint32_t microbatches);
/* One batch came back: its rows, each stage's held time, and its round trip. */
void kvr_cost_observe(struct kvr_cost_model *m, uint32_t rows, const double *held_ms,
                      double round_trip_ms);
/* Enough samples to trust the model. */
bool kvr_cost_ready(const struct kvr_cost_model *m);
/* Predicted held time of stage s for a batch of `rows` rows, ms. */
double kvr_cost_stage_ms(const struct kvr_cost_model *m, uint32_t s, double rows);
/* Slowest stage's time for a batch of `rows` rows, ms. */
double kvr_cost_batch_ms(const struct kvr_cost_model *m, double rows);
/* Time for one batch of `rows` rows to go round the ring with nothing ahead of it, ms. */
double kvr_cost_trip_ms(const struct kvr_cost_model *m, double rows);
/* Time between two tokens of one sequence with n_decode sequences decoding and
 * prefill_rows extra rows in every batch, ms. */
double kvr_cost_period_ms(const struct kvr_cost_model *m, double n_decode, double prefill_rows);

/* Calibration: how far reality is from the model. Each observation is actual / predicted
 * (of a first-token time, or of a gap between tokens); the factor is a high quantile of
 * that ratio (mean + 2 standard deviations, moving), never below `floor`. Predictions are
 * multiplied by it before they are compared with a budget, so the model's own bias and
 * the machine's noise are both paid for. */
struct kvr_calib {
    double mean, var; /* exponentially weighted */
    uint64_t n;
};

void kvr_calib_observe(struct kvr_calib *c, double ratio);
double kvr_calib_factor(const struct kvr_calib *c, double floor);

#endif
