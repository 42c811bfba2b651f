/* sim_ring.h - a pipelined fake ring for admission's estimates (tests/unit/test_sched.c).
 *
 * Admission's estimates (kvr_sched_req est.first_ms, est.period_ms, exported as the ratio
 * histograms) against what happens on a ring that behaves like the real one: each of two
 * stages holds a batch for c0 + c1 x rows + c2 x pairs ms (stage 1 a little slower, +-8%
 * deterministic jitter), a stage takes one batch at a time, batches pass through the stages
 * in order with a hop between them and to and from the bridge, and the bridge keeps its
 * window of micro-batches full. Poisson arrivals of prompts of 32-768 tokens and answers of
 * 32-96 (bench/estimates.sh's mix), 2 s / 6 s budgets, at fractions of the capacity that a
 * closed loop of 32 clients measures on the same ring.
 *
 * The functions assert with cmocka: only a cmocka test links this file. */
#ifndef KVR_TESTS_SIM_RING_H
#define KVR_TESTS_SIM_RING_H

#include "bridge/sched.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#define SIM_MS 1000000ull
#define SIM_SEQS 32
#define SIM_REQS 256         /* request slots, reused once detached */
#define SIM_PROMPT 768       /* the longest prompt of the long-prompt case */
#define SIM_PROMPT_BENCH 384 /* ... and of bench/estimates.sh's mix */
#define SIM_GEN 96
#define SIM_BT 16
#define SIM_CTX 1024
/* kvasir serve's default budgets, which the capacity probe's requests get (no budget of
 * their own): they make the earliest-deadline-first order the order of arrival. */
#define SIM_SERVE_FIRST_MS 60000
#define SIM_SERVE_TOTAL_MS 600000
#define SIM_MAX_CTRL ((3 + (SIM_CTX / SIM_BT + KVR_WIRE_MAP_IDS - 1) / KVR_WIRE_MAP_IDS) * SIM_SEQS)

struct sim_req {
    struct kvr_sched_req r;
    bool measured; /* a request of the level being measured (not the capacity probe's) */
    int32_t prompt[SIM_PROMPT];
    int32_t gen[SIM_GEN];
    bool busy; /* submitted and not yet detached */
    bool closed_loop;
};

struct sim_batch {
    uint64_t id, done_ns;
    uint32_t n_segs;
    struct kvr_seg segs[64];
    double held_ms[2];
};

struct sim {
    struct kvr_plan plan;
    struct kvr_sched *s;
    uint64_t now;
    struct sim_req req[SIM_REQS];
    struct sim_batch ring[4];
    uint32_t head, n_ring;
    uint64_t stage_free[2];
    uint64_t rng;
    uint32_t completed, resubmit; /* closed loop: requests to send again */
    uint32_t prompt_max;          /* prompts of 32..prompt_max tokens */
    /* |estimate / actual - 1| of the measured requests that ended, first token and whole */
    double err_first[SIM_REQS * 8], err_total[SIM_REQS * 8];
    uint32_t n_err;
    uint32_t n_late; /* measured requests that missed a budget (first token or whole) */
    /* The futures experiment (sim_futures): where outcomes go, the request last submitted,
     * and in a child, the request it follows and the pipe its outcome goes to. */
    FILE *futures;
    uint32_t n_futures_req;
    struct sim_req *last, *target;
    int target_fd;
};

/* Plan and scheduler of two stages, two micro-batches, SIM_SEQS slots; the ring comes up. */
void sim_init(struct sim *m, uint64_t seed, uint32_t prompt_max);
/* Submit a request of the mix; false if it was refused (or no request slot was free). */
bool sim_submit(struct sim *m, bool closed_loop, uint32_t first_ms, uint32_t total_ms);
/* Run until `until` ns: Poisson arrivals at `rate` per second (0: none), the closed loop's
 * requests sent again as soon as they end. */
void sim_run(struct sim *m, double rate, uint64_t until, uint32_t first_ms, uint32_t total_ms,
             uint32_t *n_sent, uint32_t *n_refused);
/* Let every batch in the ring come back. */
void sim_drain(struct sim *m);

#endif
