/* loadgen.h - the pure parts of `kvasir bench`: a seeded generator, arrival schedules,
 * length ranges, per-request records and their aggregation into latency percentiles,
 * throughput and goodput (the sweep plot's SVG writer is client/svg.h).
 *
 * Nothing here does I/O, reads a clock or keeps a global, so every number `kvasir bench`
 * prints can be reproduced in a unit test from the same inputs (client/bench_run.h sends
 * the requests and fills the records).
 *
 * Definitions (docs/BENCH.md explains how to read them):
 *   TTFT   send of the request to the first SSE chunk that carries text
 *   ITL    every gap between two consecutive chunks that carry text
 *   TPOT   per request, (E2E - TTFT) / (output tokens - 1): time per output token after the
 *          first, with output tokens as the server counted them
 *   E2E    send of the request to the end of the stream
 *   goodput  requests per second that finished and met their latency budget
 *
 * Ownership: functions that allocate say so; memory goes through core/alloc.h. Threads: all
 * functions are re-entrant; a struct kvr_lg_rng belongs to one thread at a time. */
#ifndef KVR_CLIENT_LOADGEN_H
#define KVR_CLIENT_LOADGEN_H

#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- generator ------------------------------------------------------------------------ */

/* xoshiro256**, seeded with four outputs of splitmix64(seed): the same seed gives the same
 * schedule and prompts on every machine. */
struct kvr_lg_rng {
    uint64_t s[4];
};

void kvr_lg_rng_seed(struct kvr_lg_rng *r, uint64_t seed);
uint64_t kvr_lg_rng_next(struct kvr_lg_rng *r);
/* Uniform in the open interval (0, 1). */
double kvr_lg_rng_uniform(struct kvr_lg_rng *r);
/* Uniform integer in [lo, hi] (lo <= hi). */
uint32_t kvr_lg_rng_range(struct kvr_lg_rng *r, uint32_t lo, uint32_t hi);
/* Gamma(shape, scale) variate (Marsaglia and Tsang's method; shape < 1 by the boost
 * U^(1/shape)). shape > 0, scale > 0. Mean shape * scale. */
double kvr_lg_gamma(struct kvr_lg_rng *r, double shape, double scale);

/* ---- arrival schedules ---------------------------------------------------------------- */

#define KVR_LG_MAX_REQUESTS 1000000u

struct kvr_lg_schedule_spec {
    /* Mean arrivals per second; INFINITY sends every request at t = 0. */
    double rate_per_s;
    /* Shape of the gamma distribution of the gaps (1 = Poisson arrivals, < 1 burstier,
     * > 1 more regular); the scale is 1 / (rate * burstiness) so the mean gap stays
     * 1 / rate whatever the shape. */
    double burstiness;
    uint64_t seed;
    size_t max_requests; /* stop after this many arrivals; 0 = no count limit */
    double duration_s;   /* only arrivals before this time; 0 = no time limit */
};

/* Arrival times in seconds from the start of the run, non-decreasing, the first at 0.
 * *arrivals_s is allocated (kvr_free) and holds *n entries. KVR_EINVAL for a bad spec (no
 * limit at all, infinite rate with only a duration, rate or burstiness <= 0), KVR_ERANGE
 * when more than KVR_LG_MAX_REQUESTS would be needed. */
int kvr_lg_schedule(const struct kvr_lg_schedule_spec *spec, double **arrivals_s, size_t *n,
                    struct kvr_err *err);

/* ---- lengths and option lists --------------------------------------------------------- */

/* A token count: fixed ("128") or uniform in an inclusive range ("64:256"). */
struct kvr_lg_range {
    uint32_t lo, hi;
};

/* Parse "N" or "LO:HI" with 1 <= LO <= HI <= max. */
int kvr_lg_range_parse(struct kvr_lg_range *out, const char *s, uint32_t max, struct kvr_err *err);
uint32_t kvr_lg_range_draw(const struct kvr_lg_range *r, struct kvr_lg_rng *rng);

/* Parse a comma-separated list of positive finite rates ("1,2.5,4") into out[0..cap).
 * Returns the count, or a negative status (KVR_EINVAL malformed, KVR_ERANGE too many). */
int kvr_lg_parse_rates(const char *s, double *out, size_t cap, struct kvr_err *err);

/* ---- statistics ----------------------------------------------------------------------- */

/* The p-th percentile (0 <= p <= 100) of n sorted values, interpolating linearly between
 * the two nearest ranks (rank p/100 * (n - 1), as numpy's default). NAN when n == 0. */
double kvr_lg_percentile(const double *sorted, size_t n, double p);

struct kvr_lg_summary {
    size_t n;
    double mean, min, p50, p90, p99, max; /* NAN when n == 0 */
};

/* Summarize v[0..n) (NAN entries are skipped). Sorts v in place. */
void kvr_lg_summarize(double *v, size_t n, struct kvr_lg_summary *out);

/* ---- per-request records and the run's result ----------------------------------------- */

enum kvr_lg_outcome {
    KVR_LG_OK,      /* the stream finished ([DONE] after text, no error event) */
    KVR_LG_REFUSED, /* 429 or 503 at admission */
    KVR_LG_ERROR,   /* any other status, an error event, a broken stream or connection */
    KVR_LG_TIMEOUT, /* a socket wait or the request's deadline ran out */
    KVR_LG_OUTCOME_COUNT
};

const char *kvr_lg_outcome_name(enum kvr_lg_outcome o); /* "ok", "refused", ... */

#define KVR_LG_REASON_BYTES 32
#define KVR_LG_MESSAGE_BYTES 160

/* One request as the client saw it. Times in seconds. */
struct kvr_lg_record {
    uint32_t index;     /* position in the schedule */
    double scheduled_s; /* planned send time from the start of the run */
    double start_s;     /* actual send time from the start of the run */
    enum kvr_lg_outcome outcome;
    int http_status; /* 0 when no response head arrived */
    /* The error's "code" from the server ("over_budget", "kv_full", "queue_full",
     * "ring_down", ...) or the client's own ("connect", "timeout", "truncated", ...). */
    char reason[KVR_LG_REASON_BYTES];
    char message[KVR_LG_MESSAGE_BYTES];
    uint32_t prompt_tokens; /* the server's usage count when it sent one, else planned */
    uint32_t output_tokens; /* the server's usage count when it sent one, else chunks */
    uint32_t max_tokens;    /* what was asked for */
    double ttft_s;          /* NAN unless a text chunk arrived */
    double e2e_s;           /* send to end of response (any outcome with a response) */
    double response_s;      /* send to the response's status line; NAN if none */
    double *itl_s;          /* n_itl gaps; owned by the record (kvr_free) */
    uint32_t n_itl;
    bool met_budget; /* set by kvr_lg_aggregate */
};

/* A refusal reason and how many requests got it. */
struct kvr_lg_reason_count {
    int http_status;
    char reason[KVR_LG_REASON_BYTES];
    size_t n;
};

#define KVR_LG_MAX_REASONS 8
/* The spec's limit on a refusal's latency. */
#define KVR_LG_REFUSAL_LIMIT_S 0.050

struct kvr_lg_result {
    size_t n_total;
    size_t n_outcome[KVR_LG_OUTCOME_COUNT];
    size_t n_met_budget;
    /* Refusals and errors by (status, reason), most frequent first; reasons past
     * KVR_LG_MAX_REASONS are summed into the last entry as "other". */
    struct kvr_lg_reason_count refused[KVR_LG_MAX_REASONS], errors[KVR_LG_MAX_REASONS];
    size_t n_refused_reasons, n_error_reasons;
    size_t n_refusal_over_limit; /* refusals slower than KVR_LG_REFUSAL_LIMIT_S */
    double duration_s;
    uint64_t prompt_tokens, output_tokens; /* over ok requests */
    double req_per_s;                      /* ok requests per second */
    double output_tok_per_s;               /* output tokens of ok requests per second */
    double total_tok_per_s;                /* prompt + output tokens of ok requests per second */
    double goodput_req_per_s;
    struct kvr_lg_summary ttft_s, tpot_s, itl_s, e2e_s, refusal_s; /* ok requests; refusals */
};

/* Aggregate n records of a run that took duration_s (first send to last response). A
 * request meets its budget when it is ok and its TTFT is within ttft_budget_s and its E2E
 * within total_budget_s (a budget <= 0 is not checked). Sets each record's met_budget.
 * Allocates only temporary memory; KVR_ENOMEM when that fails. */
int kvr_lg_aggregate(struct kvr_lg_record *rec, size_t n, double duration_s, double ttft_budget_s,
                     double total_budget_s, struct kvr_lg_result *out);

#endif
