/* http_metrics.h - the HTTP layer's own Prometheus metrics: responses by endpoint and status
 * code, how admitted generations ended, refusals by reason, token counts, and the
 * first-token, inter-token and end-to-end latency histograms (vLLM's names, prefixed
 * "kvasir:"). GET /metrics prints these, then the service's own (service.h).
 *
 * http_metrics.c prints them from one descriptor table (name, type, help, how to read the
 * value), in the table's order, so a new metric is a new row.
 *
 * Threads: every function may be called from any thread; one mutex inside the struct
 * guards all counters. Memory: struct kvr_http_metrics is fixed-size and caller-owned
 * (init/fini); nothing is allocated. */
#ifndef KVR_BRIDGE_HTTP_METRICS_H
#define KVR_BRIDGE_HTTP_METRICS_H

#include "core/sbuf.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The routes, as labelled in kvasir:http_requests_total{endpoint=...}. */
enum kvr_http_endpoint {
    KVR_HTTP_ENDPOINT_COMPLETIONS,
    KVR_HTTP_ENDPOINT_CHAT,
    KVR_HTTP_ENDPOINT_MODELS,
    KVR_HTTP_ENDPOINT_HEALTH, /* also /readyz: 200 when the ring serves, 503 with each
                                 stage's state */
    KVR_HTTP_ENDPOINT_METRICS,
    KVR_HTTP_ENDPOINT_TOKENIZE,
    KVR_HTTP_ENDPOINT_DETOKENIZE,
    KVR_HTTP_ENDPOINT_APPLY_TEMPLATE,
    KVR_HTTP_ENDPOINT_LIVEZ,              /* the process answers (200 whatever the ring does) */
    KVR_HTTP_ENDPOINT_RESET_PREFIX_CACHE, /* POST: forget the cached KV blocks nobody uses
                                             (vLLM's name) */
    KVR_HTTP_ENDPOINT_CONSOLE,            /* GET /, /console.js, ...: the page (console.h) */
    KVR_HTTP_ENDPOINT_TELEMETRY,          /* GET /v1/telemetry: SSE snapshots (telemetry.h) */
    KVR_HTTP_ENDPOINT_RESPONSES,          /* POST /v1/responses (responses.h) */
    KVR_HTTP_ENDPOINT_OTHER,              /* no such route */
    KVR_HTTP_ENDPOINT_COUNT
};

/* The route's path ("/v1/completions", ...; "other"), used in logs and metrics. */
const char *kvr_http_endpoint_name(enum kvr_http_endpoint ep);

/* How an admitted generation ended, as far as the client is concerned. */
enum kvr_http_outcome {
    KVR_HTTP_OUTCOME_STOP,        /* finished: stop string or end-of-generation token */
    KVR_HTTP_OUTCOME_LENGTH,      /* finished: max_tokens or context */
    KVR_HTTP_OUTCOME_ERROR,       /* the service reported an error, or it stalled */
    KVR_HTTP_OUTCOME_CLIENT_GONE, /* the client disconnected first */
    KVR_HTTP_OUTCOME_COUNT
};

/* Why a request was refused, as the client is told it: the error's "code" and the reason
 * label of kvasir:request_refused_total (several kvr_refusal_reason map to one). */
enum kvr_http_refused {
    KVR_HTTP_REFUSED_OVER_BUDGET, /* either latency budget */
    KVR_HTTP_REFUSED_KV_FULL,
    KVR_HTTP_REFUSED_QUEUE_FULL,
    KVR_HTTP_REFUSED_RING_DOWN,
    KVR_HTTP_REFUSED_INVALID,
    KVR_HTTP_REFUSED_INTERNAL,
    KVR_HTTP_REFUSED_COUNT
};

/* "over_budget", "kv_full", ... (static). */
const char *kvr_http_refused_name(enum kvr_http_refused why);

#define KVR_HTTP_METRICS_MAX_BUCKETS 24

/* A Prometheus histogram of durations in seconds. */
struct kvr_http_histogram {
    const double *bounds; /* upper bounds in seconds, ascending; +Inf is implicit */
    uint32_t n_bounds;    /* <= KVR_HTTP_METRICS_MAX_BUCKETS */
    uint64_t counts[KVR_HTTP_METRICS_MAX_BUCKETS + 1]; /* per bucket, not cumulative; last
                                                          = +Inf */
    double sum;                                        /* seconds */
    uint64_t count;
};

struct kvr_http_metrics {
    pthread_mutex_t mu;
    uint64_t responses[KVR_HTTP_ENDPOINT_COUNT][500]; /* by endpoint and status code - 100 */
    uint64_t outcomes[KVR_HTTP_OUTCOME_COUNT];
    uint64_t refused[KVR_HTTP_REFUSED_COUNT];
    uint64_t prompt_tokens;     /* of admitted requests */
    uint64_t generation_tokens; /* received from the service, EOS included */
    int64_t running;            /* generations between submit and release */
    uint64_t telemetry_cpu_ns;  /* CPU the /v1/telemetry streams' threads used */
    struct kvr_http_histogram ttft, itl, e2e;
};

void kvr_http_metrics_init(struct kvr_http_metrics *m);
void kvr_http_metrics_fini(struct kvr_http_metrics *m);

/* A response was queued: `status` outside 100..599 is not counted. */
void kvr_http_metrics_response(struct kvr_http_metrics *m, enum kvr_http_endpoint ep, int status);
/* The service refused a request. */
void kvr_http_metrics_refused(struct kvr_http_metrics *m, enum kvr_http_refused why);
/* The service admitted a request of n_prompt tokens: it runs until kvr_http_metrics_ended. */
void kvr_http_metrics_admitted(struct kvr_http_metrics *m, uint32_t n_prompt);
/* A token arrived: the first one of its request `seconds` after the request arrived, a later
 * one `seconds` after the previous token. */
void kvr_http_metrics_token(struct kvr_http_metrics *m, bool first, double seconds);
/* An admitted generation was released; e2e_seconds (since the request arrived) counts only
 * for a finished one (STOP, LENGTH). */
void kvr_http_metrics_ended(struct kvr_http_metrics *m, enum kvr_http_outcome outcome,
                            double e2e_seconds);
/* A /v1/telemetry stream's thread used cpu_ns more CPU time. */
void kvr_http_metrics_telemetry_cpu(struct kvr_http_metrics *m, uint64_t cpu_ns);
/* Generations admitted and not yet released. */
int64_t kvr_http_metrics_running(struct kvr_http_metrics *m);

/* Append every metric in Prometheus text format (HELP and TYPE lines, then samples). */
void kvr_http_metrics_print(struct kvr_http_metrics *m, struct kvr_sbuf *out);

/* Copy Prometheus text to `out` with model_name="<model>" as the first label of every
 * kvasir: sample about the model (all but the HTTP server's own request and connection
 * counts), as vLLM labels its samples; comments and other lines are copied as they are. */
void kvr_http_metrics_label_model(const char *text, size_t len, const char *model,
                                  struct kvr_sbuf *out);

#endif
