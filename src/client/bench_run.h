/* bench_run.h - the load generator behind `kvasir bench`: one load level (an open-loop
 * arrival schedule or a closed loop of C requests in flight) sent to an OpenAI-compatible
 * server as streaming requests, one struct kvr_lg_record per request, aggregated by
 * client/loadgen.h.
 *
 * Every request streams (SSE), so time to first token, every inter-token gap and
 * end-to-end latency are measured here, at the client. In the open loop a request that
 * arrives while every worker thread is busy gets a new thread, so a slow request never
 * delays the schedule. Every socket wait is bounded and every request has a deadline
 * (timeout_s), so a level always ends by itself; raising *cancel ends it early and keeps
 * what finished.
 *
 * Prompts are random common English words, drawn from each request's own seeded generator
 * (the same seed and index give the same prompt whatever thread sends it). With a tokenizer
 * hook the prompt has exactly the asked number of tokens (completions send the ids); without
 * one, one word stands for one token.
 *
 * Ownership: the spec and everything it points to belong to the caller and must outlive the
 * call; a level's records are allocated here and freed by kvr_bench_level_fini. Threads: one
 * caller thread per level; the runner starts its own workers and joins them before it
 * returns. The tokenizer hook is called from the workers, several at once; the progress
 * hook only from the caller's thread. Nothing here prints. */
#ifndef KVR_CLIENT_BENCH_RUN_H
#define KVR_CLIENT_BENCH_RUN_H

#include "client/httpc.h"
#include "client/loadgen.h"
#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum kvr_bench_endpoint {
    KVR_BENCH_COMPLETIONS, /* POST /v1/completions, "prompt" */
    KVR_BENCH_CHAT,        /* POST /v1/chat/completions, one user message */
    KVR_BENCH_ENDPOINT_COUNT
};

/* Tokenize text[0..len) into ids[0..cap): returns the number of ids, KVR_EFULL when cap is
 * too small (the runner retries with more room), or another negative status. add_special
 * asks for BOS/EOS as the model adds them. Called from worker threads at once. */
struct kvr_bench_tokenizer {
    int (*encode)(void *ud, const char *text, size_t len, bool add_special, int32_t *ids,
                  size_t cap);
    void *ud;
};

/* A snapshot of a running level, for a progress line. total is 0 when the level runs for
 * a duration rather than a count. */
struct kvr_bench_progress {
    size_t done, total, inflight, ok, refused, failed;
    double elapsed_s;
};

/* What every request of a level shares. */
struct kvr_bench_spec {
    const struct kvr_httpc_url *url;
    const char *path;    /* "/v1/completions" or "/v1/chat/completions" */
    const char *api_key; /* bearer key, or NULL */
    const char *model;   /* the "model" field sent */
    enum kvr_bench_endpoint endpoint;
    const struct kvr_bench_tokenizer *tok;      /* NULL: one word per token */
    double burstiness;                          /* gamma shape of the open loop's gaps */
    uint32_t max_concurrency;                   /* open loop cap on requests in flight; 0 = none */
    double duration_s;                          /* send for this long; 0 = no time limit */
    uint32_t num_requests;                      /* send at most this many; 0 = no count limit */
    struct kvr_lg_range prompt_len, output_len; /* tokens */
    double temperature;                         /* NAN: not sent (the server's default) */
    uint32_t ttft_budget_ms, total_budget_ms;   /* 0: not sent, not checked */
    uint64_t seed;                              /* schedule, lengths and prompts */
    uint32_t timeout_s;                         /* per request deadline and socket timeout */
    const volatile int *cancel;                 /* stop sending and cancel when nonzero */
    /* Called at most every 200 ms while the level runs and once more with final set at its
     * end; NULL for none. */
    void (*on_progress)(void *ud, const struct kvr_bench_progress *p, bool final);
    void *progress_ud;
};

/* One load level: the caller sets rate or concurrency; the runner fills the rest. */
struct kvr_bench_level {
    double rate;               /* offered rate in requests/s (open loop; INFINITY = all at
                                  once), or 0 */
    uint32_t concurrency;      /* closed loop: requests kept in flight, or 0 */
    struct kvr_lg_record *rec; /* every request sent, in index order; owned by the level */
    size_t n_rec;
    struct kvr_lg_result res;
    double wall_s;    /* first send to last response */
    double t0_unix_s; /* wall-clock time of the level's start, to line up separate runs */
};

/* Run one level: schedule, dispatch, wait for every request, aggregate into lv->res.
 * Returns 0 or a negative status; err (optional) gets a message when there is one to show
 * (a bad schedule, no thread could be started). On failure lv->rec stays NULL. */
int kvr_bench_run_level(const struct kvr_bench_spec *s, struct kvr_bench_level *lv,
                        struct kvr_err *err);

/* Free a level's records (NULL-safe fields; the level itself is the caller's). */
void kvr_bench_level_fini(struct kvr_bench_level *lv);

#endif
