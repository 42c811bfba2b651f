/* http.c - the OpenAI-compatible HTTP API on libmicrohttpd (see http.h).
 *
 * A request's life, in the order of this file:
 *   1. on_request, first call: route and method, API key, declared body size. Any failure
 *      is answered at once, before the body is read.
 *   2. on_request, body calls: the body is collected up to max_body_bytes; beyond that it
 *      is dropped and the request answered 413 (never buffered whole).
 *   3. on_request, last call: the endpoint runs. Generation endpoints parse (openai.c),
 *      render chat (chat.c), tokenize, check lengths and submit to the service.
 *   4. Generation: events from the service go through the detokenizer and the stop-string
 *      cutter into either one JSON body (non-streaming, built on the request's thread) or
 *      SSE chunks produced by MHD's content-reader callback (streaming).
 *   5. on_completed / stream_free: cancel and release the stream, record metrics.
 *
 * Metrics (Prometheus names, vLLM-style) are kept here for what this layer sees; the
 * service appends its own scheduler metrics. */
#define _GNU_SOURCE /* POLLRDHUP */
#include "bridge/http.h"

#include "bridge/chat.h"
#include "bridge/openai.h"
#include "core/sbuf.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

/* How long one wait on the service may last before we look at the client socket again. */
#define POLL_SLICE_MS 100
/* At shutdown, how long generations in progress get to tell their clients (a 503, or an
 * error event and [DONE]) before every connection is closed. */
#define SHUTDOWN_GRACE_MS 1500

/* ---- metrics ------------------------------------------------------------------------ */

enum endpoint {
    EP_COMPLETIONS,
    EP_CHAT,
    EP_MODELS,
    EP_HEALTH, /* also /readyz: 200 when the ring serves, 503 with each stage's state */
    EP_METRICS,
    EP_TOKENIZE,
    EP_DETOKENIZE,
    EP_APPLY_TEMPLATE,
    EP_LIVEZ,              /* the process answers (200 whatever the ring is doing) */
    EP_RESET_PREFIX_CACHE, /* POST: forget the cached KV blocks nobody uses (vLLM's name) */
    EP_OTHER,              /* no such route */
    EP_COUNT
};

static const char *const endpoint_names[EP_COUNT] = {
    "/v1/completions", "/v1/chat/completions", "/v1/models",      "/health", "/metrics",
    "/tokenize",       "/detokenize",          "/apply-template", "/livez",  "/reset_prefix_cache",
    "other",
};

/* How a generation ended, as far as the client is concerned. */
enum outcome {
    OUT_STOP,        /* finished: stop string or end-of-generation token */
    OUT_LENGTH,      /* finished: max_tokens or context */
    OUT_ERROR,       /* the service reported an error, or it stalled */
    OUT_CLIENT_GONE, /* the client disconnected first */
    OUT_COUNT
};

#define N_BUCKETS_MAX 20

struct histogram {
    const double *bounds; /* upper bounds in seconds, ascending; +Inf is implicit */
    uint32_t n_bounds;
    uint64_t counts[N_BUCKETS_MAX + 1]; /* per bucket, not cumulative; last = +Inf */
    double sum;
    uint64_t count;
};

static const double ttft_bounds[] = {0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25, 0.5,
                                     0.75,  1.0,  2.5,  5.0,  7.5,  10.0, 20.0, 40.0};
static const double itl_bounds[] = {0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                                    0.1,   0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1.0,  2.5};
static const double e2e_bounds[] = {0.1,  0.3,  0.5,  0.8,  1.0,  1.5,  2.0,  2.5,  5.0,
                                    10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0};

struct metrics {
    pthread_mutex_t mu;
    uint64_t requests[EP_COUNT][500]; /* by endpoint and status code - 100 */
    uint64_t outcomes[OUT_COUNT];
    uint64_t refused[KVR_REFUSE_REASON_COUNT];
    uint64_t prompt_tokens;
    uint64_t generation_tokens;
    int64_t running; /* generations between submit and release */
    struct histogram ttft, itl, e2e;
};

static void hist_init(struct histogram *h, const double *bounds, uint32_t n)
{
    memset(h, 0, sizeof *h);
    h->bounds = bounds;
    h->n_bounds = n;
}

static void hist_observe(struct histogram *h, double v)
{
    uint32_t i = 0;
    while (i < h->n_bounds && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

static void hist_print(struct kvr_sbuf *b, const char *name, const char *help,
                       const struct histogram *h)
{
    kvr_sbuf_printf(b, "# HELP kvasir:%s %s\n# TYPE kvasir:%s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (uint32_t i = 0; i < h->n_bounds; i++) {
        cum += h->counts[i];
        kvr_sbuf_printf(b, "kvasir:%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i],
                        (unsigned long long)cum);
    }
    cum += h->counts[h->n_bounds];
    kvr_sbuf_printf(b, "kvasir:%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
    kvr_sbuf_printf(b, "kvasir:%s_sum %.9g\nkvasir:%s_count %llu\n", name, h->sum, name,
                    (unsigned long long)h->count);
}

static const char *const outcome_labels[OUT_COUNT] = {"stop", "length", "error", "client_gone"};
/* What the client is told of a refusal (request.h): the HTTP status and the error code,
 * which is also the reason label of kvasir:request_refused_total. A KV-full refusal always
 * says when to try again (1 s at least). */
enum { REFUSAL_LABELS = 6 };
static const char *const refusal_labels[REFUSAL_LABELS] = {"over_budget", "kv_full", "queue_full",
                                                           "ring_down",   "invalid", "internal"};
static const struct {
    int status;
    int label; /* index into refusal_labels */
    uint32_t min_retry_s;
} refusal_http[KVR_REFUSE_REASON_COUNT] = {
    [KVR_REFUSE_NONE] = {500, 5, 0},         [KVR_REFUSE_FIRST_TOKEN_BUDGET] = {429, 0, 0},
    [KVR_REFUSE_TOTAL_BUDGET] = {429, 0, 0}, [KVR_REFUSE_KV_FULL] = {429, 1, 1},
    [KVR_REFUSE_QUEUE_FULL] = {503, 2, 0},   [KVR_REFUSE_RING_DOWN] = {503, 3, 0},
    [KVR_REFUSE_TOO_LONG] = {400, 4, 0},     [KVR_REFUSE_INTERNAL] = {500, 5, 0},
};

static void metrics_print(struct metrics *m, struct kvr_sbuf *b)
{
    pthread_mutex_lock(&m->mu);
    kvr_sbuf_puts(b, "# HELP kvasir:http_requests_total HTTP responses by endpoint and "
                     "status code.\n# TYPE kvasir:http_requests_total counter\n");
    for (int ep = 0; ep < EP_COUNT; ep++)
        for (int code = 0; code < 500; code++)
            if (m->requests[ep][code])
                kvr_sbuf_printf(b, "kvasir:http_requests_total{endpoint=\"%s\",code=\"%d\"} %llu\n",
                                endpoint_names[ep], code + 100,
                                (unsigned long long)m->requests[ep][code]);
    kvr_sbuf_puts(b, "# HELP kvasir:request_success_total Generations finished, by finish "
                     "reason.\n# TYPE kvasir:request_success_total counter\n");
    for (int o = OUT_STOP; o <= OUT_LENGTH; o++)
        kvr_sbuf_printf(b, "kvasir:request_success_total{finished_reason=\"%s\"} %llu\n",
                        outcome_labels[o], (unsigned long long)m->outcomes[o]);
    kvr_sbuf_puts(b, "# HELP kvasir:request_failure_total Admitted generations that did not "
                     "finish.\n# TYPE kvasir:request_failure_total counter\n");
    for (int o = OUT_ERROR; o < OUT_COUNT; o++)
        kvr_sbuf_printf(b, "kvasir:request_failure_total{reason=\"%s\"} %llu\n", outcome_labels[o],
                        (unsigned long long)m->outcomes[o]);
    kvr_sbuf_puts(b, "# HELP kvasir:request_refused_total Requests the service refused at "
                     "admission, by reason.\n# TYPE kvasir:request_refused_total counter\n");
    for (int l = 0; l < REFUSAL_LABELS; l++) {
        uint64_t n = 0;
        for (int r = 0; r < KVR_REFUSE_REASON_COUNT; r++)
            n += refusal_http[r].label == l ? m->refused[r] : 0;
        kvr_sbuf_printf(b, "kvasir:request_refused_total{reason=\"%s\"} %llu\n", refusal_labels[l],
                        (unsigned long long)n);
    }
    kvr_sbuf_printf(b,
                    "# HELP kvasir:prompt_tokens_total Prompt tokens of admitted requests.\n"
                    "# TYPE kvasir:prompt_tokens_total counter\n"
                    "kvasir:prompt_tokens_total %llu\n"
                    "# HELP kvasir:generation_tokens_total Tokens generated.\n"
                    "# TYPE kvasir:generation_tokens_total counter\n"
                    "kvasir:generation_tokens_total %llu\n"
                    "# HELP kvasir:http_generations_in_progress Generations admitted and not "
                    "yet released.\n"
                    "# TYPE kvasir:http_generations_in_progress gauge\n"
                    "kvasir:http_generations_in_progress %lld\n",
                    (unsigned long long)m->prompt_tokens, (unsigned long long)m->generation_tokens,
                    (long long)m->running);
    hist_print(b, "time_to_first_token_seconds",
               "Time from request arrival to the first generated token.", &m->ttft);
    hist_print(b, "inter_token_latency_seconds", "Time between consecutive generated tokens.",
               &m->itl);
    hist_print(b, "e2e_request_latency_seconds",
               "Time from request arrival to the last token of finished generations.", &m->e2e);
    pthread_mutex_unlock(&m->mu);
}

/* ---- the server --------------------------------------------------------------------- */

struct kvr_http {
    struct MHD_Daemon *daemon;
    const struct kvr_service *svc;
    uint16_t port;
    char *api_key; /* NULL: no auth */
    size_t api_key_len;
    char *tls_cert, *tls_key; /* PEM text for HTTPS (owned), or NULL */
    size_t max_body_bytes;
    uint32_t stall_timeout_ms;
    uint32_t default_max_tokens;
    struct kvr_chat *chat;
    char *bos_text; /* the BOS token's text, or NULL */
    int32_t n_vocab;
    size_t max_piece_bytes; /* longest text one token can stand for */
    int64_t started_s;      /* "created" of the model in /v1/models */
    atomic_bool stopping;
    struct metrics metrics;
};

/* Per-request state (MHD's con_cls), from the first call of on_request to on_completed. */
struct request {
    enum endpoint ep;
    char *model_id; /* GET /v1/models/{id}: the id asked for (owned); NULL for the list */
    uint64_t t_start_ns;
    struct kvr_sbuf body;
    bool too_large; /* the body passed max_body_bytes; the rest was dropped */
    bool answered;  /* a response was queued early (before the body was read) */
};

/* ---- responses ---------------------------------------------------------------------- */

static void count_response(struct kvr_http *h, enum endpoint ep, int status)
{
    if (status < 100 || status > 599)
        return;
    pthread_mutex_lock(&h->metrics.mu);
    h->metrics.requests[ep][status - 100]++;
    pthread_mutex_unlock(&h->metrics.mu);
}

static void free_body(void *p)
{
    kvr_free(p);
}

/* Queue `body` (kvr_malloc'd, taken) with `status`. `headers` is NULL or a NULL-terminated
 * list of name, value pairs. */
static enum MHD_Result reply(struct kvr_http *h, struct request *rq, struct MHD_Connection *c,
                             int status, const char *ctype, char *body, size_t len,
                             const char *const *headers)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer_with_free_callback(len, body, free_body);
    if (!resp) {
        kvr_free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    for (size_t i = 0; headers && headers[i]; i += 2)
        MHD_add_response_header(resp, headers[i], headers[i + 1]);
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    if (ok == MHD_YES)
        count_response(h, rq->ep, status);
    KVR_DEBUG("http: %s -> %d (%zu bytes, %.1f ms)", endpoint_names[rq->ep], status, len,
              (double)(kvr_now_ns() - rq->t_start_ns) * 1e-6);
    return ok;
}

static enum MHD_Result reply_json(struct kvr_http *h, struct request *rq, struct MHD_Connection *c,
                                  int status, json_t *j, const char *const *headers)
{
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!s)
        return MHD_NO;
    /* json_dumps allocates with jansson's allocator; hand MHD a kvr_malloc copy. */
    size_t len = strlen(s);
    char *body = kvr_malloc(len + 1);
    if (body)
        memcpy(body, s, len + 1);
    free(s);
    if (!body)
        return MHD_NO;
    return reply(h, rq, c, status, "application/json", body, len, headers);
}

static enum MHD_Result reply_error(struct kvr_http *h, struct request *rq, struct MHD_Connection *c,
                                   const struct kvr_openai_error *e, const char *const *headers)
{
    size_t len = 0;
    char *body = kvr_openai_error_json(e, &len);
    if (!body)
        return MHD_NO;
    return reply(h, rq, c, e->status, "application/json", body, len, headers);
}

static enum MHD_Result reply_simple_error(struct kvr_http *h, struct request *rq,
                                          struct MHD_Connection *c, int status, const char *type,
                                          const char *code, const char *const *headers,
                                          const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));

static enum MHD_Result reply_simple_error(struct kvr_http *h, struct request *rq,
                                          struct MHD_Connection *c, int status, const char *type,
                                          const char *code, const char *const *headers,
                                          const char *fmt, ...)
{
    struct kvr_openai_error e;
    memset(&e, 0, sizeof e);
    e.status = status;
    e.type = type;
    e.code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    return reply_error(h, rq, c, &e, headers);
}

/* ---- small helpers ------------------------------------------------------------------ */

/* Has the client closed or reset its socket? A peer that sent FIN shows as POLLRDHUP, a
 * reset or our own shutdown (at server stop) as POLLHUP/POLLERR. */
static bool peer_gone(int fd)
{
    if (fd < 0)
        return false;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0)
        return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

static int connection_fd(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

static uint64_t random_u64(void)
{
    uint64_t x = 0;
    if (getrandom(&x, sizeof x, 0) != (ssize_t)sizeof x) {
        /* No entropy source: fall back to the clocks, which still differ per request. */
        x = kvr_now_ns() * 0x9E3779B97F4A7C15ull ^ kvr_wall_ms();
    }
    return x;
}

/* "Bearer <key>", compared in time that depends only on the key's length. */
static bool key_ok(const struct kvr_http *h, const char *auth)
{
    if (!auth || strncasecmp(auth, "Bearer ", 7) != 0)
        return false;
    const char *got = auth + 7;
    while (*got == ' ')
        got++;
    size_t got_len = strlen(got);
    unsigned diff = got_len != h->api_key_len;
    for (size_t i = 0; i < h->api_key_len; i++)
        diff |= (unsigned char)h->api_key[i] ^ (unsigned char)(i < got_len ? got[i] : 0);
    return diff == 0;
}

/* ---- generation --------------------------------------------------------------------- */

/* One admitted generation: the parsed request, the stream, and the text pipeline
 * (detokenizer -> stop-string cutter -> text/SSE). Owned by the request's thread while it
 * runs; for streaming, owned by the MHD response and freed in stream_free. */
struct gen {
    struct kvr_http *h;
    struct kvr_openai_req req; /* keeps the stop strings alive for `cut` */
    struct kvr_gen_stream *stream;
    char id[48];
    struct kvr_openai_meta meta;
    uint32_t n_prompt;
    uint32_t max_tokens;
    uint32_t n_gen; /* tokens received, EOS included */

    struct kvr_detok detok;
    char *piece; /* detokenizer output for one token */
    size_t piece_cap;
    size_t text_bytes; /* detokenized bytes so far: logprobs' text_offset */
    struct kvr_openai_text cut;
    struct kvr_sbuf text; /* released text: all of it (JSON) or the next chunk's (SSE) */
    json_t *lp;           /* logprobs not yet sent, or NULL when not asked for */

    uint64_t t_start_ns, t_first_ns, t_prev_ns, t_event_ns;
    int fd; /* the client's socket, for peer_gone */

    bool done;         /* finished, failed or abandoned: no more events wanted */
    bool svc_finished; /* the service sent its last event; no cancel needed */
    bool released;
    enum kvr_openai_finish finish;
    enum outcome outcome;
    struct kvr_openai_error fail; /* when outcome == OUT_ERROR */

    /* Streaming only. */
    struct kvr_sbuf sse; /* bytes produced but not yet handed to MHD */
    size_t sse_pos;
    bool sse_first; /* the next chunk is the first (chat: carries the role) */
    bool sse_ended; /* [DONE] has been produced */
};

/* Tell the service we want no more tokens (stop string, client gone, failure). */
static void gen_cancel(struct gen *g)
{
    if (g->stream && !g->released && !g->svc_finished) {
        g->h->svc->ops->cancel(g->stream);
        g->svc_finished = true;
    }
}

static void gen_end_stream(struct gen *g)
{
    if (g->stream && !g->released) {
        gen_cancel(g);
        g->h->svc->ops->release(g->stream);
        g->released = true;
    }
}

static void gen_destroy(struct gen *g)
{
    if (!g)
        return;
    if (g->stream) {
        if (!g->done) {
            g->done = true;
            g->outcome = OUT_CLIENT_GONE;
        }
        gen_end_stream(g);
        struct metrics *m = &g->h->metrics;
        pthread_mutex_lock(&m->mu);
        m->outcomes[g->outcome]++;
        m->running--;
        if (g->outcome == OUT_STOP || g->outcome == OUT_LENGTH)
            hist_observe(&m->e2e, (double)(kvr_now_ns() - g->t_start_ns) * 1e-9);
        pthread_mutex_unlock(&m->mu);
    }
    kvr_openai_text_fini(&g->cut);
    kvr_sbuf_fini(&g->text);
    kvr_sbuf_fini(&g->sse);
    json_decref(g->lp);
    kvr_free(g->piece);
    kvr_openai_req_fini(&g->req);
    kvr_free(g);
}

static void gen_fail(struct gen *g, int status, const char *code, const char *msg)
{
    g->done = true;
    g->outcome = OUT_ERROR;
    kvr_openai_error_set(&g->fail, status ? status : 500,
                         status == 504 ? "timeout_error" : "server_error", NULL, code, "%s", msg);
    gen_cancel(g);
}

static void gen_finish(struct gen *g, enum kvr_openai_finish f)
{
    g->done = true;
    g->finish = f;
    g->outcome = f == KVR_OPENAI_FINISH_LENGTH ? OUT_LENGTH : OUT_STOP;
}

/* Text of one token into the cutter; logprobs recorded. Returns false on a bad token. */
static bool gen_take_token(struct gen *g, const struct kvr_gen_event *ev)
{
    const struct kvr_tok *tok = g->h->svc->tok;
    int n = kvr_detok_push(tok, &g->detok, ev->token, g->piece, g->piece_cap);
    if (n < 0)
        return false;
    if (g->lp) {
        const char *p = NULL;
        size_t len = 0;
        if (kvr_tok_decode_piece(tok, ev->token, false, &p, &len) == 0)
            kvr_openai_logprobs_add(g->lp, g->meta.api, p, len, ev->logprob, g->text_bytes);
    }
    g->text_bytes += (size_t)n;
    if (kvr_openai_text_push(&g->cut, g->piece, (size_t)n, &g->text)) {
        gen_finish(g, KVR_OPENAI_FINISH_STOP);
        gen_cancel(g); /* a stop string: the rest of the ring's work is wasted */
    }
    return true;
}

/* Wait up to timeout_ms for one event and run it through the pipeline. Returns true when
 * something happened (an event, or the generation ended), false on a quiet timeout. */
static bool gen_pump(struct gen *g, uint32_t timeout_ms)
{
    struct kvr_http *h = g->h;
    struct kvr_gen_event ev;
    memset(&ev, 0, sizeof ev);
    int rc = h->svc->ops->next(g->stream, &ev, timeout_ms);
    uint64_t now = kvr_now_ns();
    if (rc == KVR_ETIMEDOUT) {
        if (h->stall_timeout_ms && now - g->t_event_ns > (uint64_t)h->stall_timeout_ms * 1000000) {
            char msg[128];
            snprintf(msg, sizeof msg, "no token for %u ms; the generation was cancelled",
                     h->stall_timeout_ms);
            gen_fail(g, 504, "stalled", msg);
            return true;
        }
        return false;
    }
    if (rc != 0) {
        g->svc_finished = true;
        gen_fail(g, 500, "stream_closed", "the generation ended without a finish reason");
        return true;
    }
    g->t_event_ns = now;
    if (ev.finish != KVR_GEN_FINISH_NONE)
        g->svc_finished = true;
    if (ev.finish == KVR_GEN_FINISH_ERROR) {
        ev.error[sizeof ev.error - 1] = 0;
        gen_fail(g, ev.error_status, "generation_failed",
                 ev.error[0] ? ev.error : "the generation failed");
        return true;
    }
    if (ev.token < 0 || ev.token >= h->n_vocab || ev.finish >= KVR_GEN_FINISH_COUNT) {
        gen_fail(g, 500, "bad_token", "the service returned an invalid token");
        return true;
    }

    g->n_gen++;
    pthread_mutex_lock(&h->metrics.mu);
    h->metrics.generation_tokens++;
    if (g->n_gen == 1)
        hist_observe(&h->metrics.ttft, (double)(now - g->t_start_ns) * 1e-9);
    else
        hist_observe(&h->metrics.itl, (double)(now - g->t_prev_ns) * 1e-9);
    pthread_mutex_unlock(&h->metrics.mu);
    g->t_prev_ns = now;

    /* The end-of-generation token is counted but has no text. */
    if (ev.finish != KVR_GEN_FINISH_EOS && !gen_take_token(g, &ev)) {
        gen_fail(g, 500, "bad_token", "the service returned an invalid token");
        return true;
    }
    if (g->done)
        return true; /* a stop string */
    bool last = ev.finish == KVR_GEN_FINISH_LENGTH || ev.finish == KVR_GEN_FINISH_EOS ||
                g->n_gen >= g->max_tokens;
    if (last) {
        int n = kvr_detok_flush(&g->detok, g->piece, g->piece_cap);
        if (n > 0 && kvr_openai_text_push(&g->cut, g->piece, (size_t)n, &g->text)) {
            gen_finish(g, KVR_OPENAI_FINISH_STOP);
        } else {
            kvr_openai_text_flush(&g->cut, &g->text);
            gen_finish(g, ev.finish == KVR_GEN_FINISH_EOS ? KVR_OPENAI_FINISH_STOP
                                                          : KVR_OPENAI_FINISH_LENGTH);
        }
        gen_cancel(g); /* only does something if the service would send more */
    }
    return true;
}

/* ---- request -> generation ---------------------------------------------------------- */

static void to_sample_params(const struct kvr_openai_sampling *in, struct kvr_sample_params *out)
{
    kvr_sample_params_default(out);
    out->temperature = in->temperature;
    out->top_k = in->top_k;
    out->top_p = in->top_p;
    if (in->top_p <= 0.0f) {
        /* "Keep the smallest set reaching 0" is the single most likely token. */
        out->temperature = 0.0f;
        out->top_p = 1.0f;
    }
    out->min_p = in->min_p;
    out->repeat_penalty = in->repetition_penalty;
    out->frequency_penalty = in->frequency_penalty;
    out->presence_penalty = in->presence_penalty;
    out->n_bias = in->n_bias;
    memcpy(out->bias, in->bias, in->n_bias * sizeof *in->bias);
    /* OpenAI's penalties look at the whole completion; the sampler's window is the
     * closest it gets. */
    out->repeat_last_n = -1;
    out->seed = in->has_seed ? in->seed : random_u64();
}

/* Format a conversation with the server's chat template. A template that refuses the
 * conversation (raise_exception) or fails on it is the client's 400, with the template's
 * message. */
static int render_chat(struct kvr_http *h, const struct kvr_chat_msg *msgs, size_t n_msgs,
                       char **out, size_t *out_len, struct kvr_openai_error *e)
{
    struct kvr_err err = {0};
    time_t now_s = time(NULL);
    struct tm now;
    int rc =
        kvr_chat_apply(h->chat, msgs, n_msgs, true, localtime_r(&now_s, &now), out, out_len, &err);
    if (rc == KVR_ENOMEM)
        return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    if (rc == KVR_EINVAL)
        return kvr_openai_error_set(
            e, 400, "invalid_request_error", "messages", "chat_template_refused",
            "the model's chat template refused the conversation: %s", err.msg);
    if (rc)
        return kvr_openai_error_set(
            e, 400, "invalid_request_error", "messages", "chat_template_error",
            "the chat template failed on this conversation: %s (%s)", err.msg, kvr_strerror(rc));
    return KVR_OK;
}

/* Tokenize the request's prompt into *ids (kvr_malloc'd). */
static int tokenize_prompt(struct kvr_http *h, struct gen *g, int32_t **ids, uint32_t *n_ids,
                           struct kvr_openai_error *e)
{
    const struct kvr_openai_req *r = &g->req;
    const struct kvr_service *svc = h->svc;
    char *rendered = NULL;
    const char *text = r->prompt;
    size_t len = r->prompt_len;
    bool chat = r->api == KVR_OPENAI_CHAT;
    struct kvr_tok_scratch *scratch = NULL;
    int rc = KVR_OK;
    *ids = NULL;
    *n_ids = 0;

    if (!chat && r->prompt_ids) {
        *ids = kvr_malloc((size_t)r->n_prompt_ids * sizeof **ids);
        if (!*ids)
            goto oom;
        memcpy(*ids, r->prompt_ids, (size_t)r->n_prompt_ids * sizeof **ids);
        *n_ids = r->n_prompt_ids;
        return KVR_OK;
    }
    bool add_special = true;
    if (chat) {
        rc = render_chat(h, r->msgs, r->n_msgs, &rendered, &len, e);
        if (rc)
            goto out;
        text = rendered;
        /* A template that writes bos_token itself gets it from the text, not twice. */
        size_t skip = kvr_chat_bos_skip(text, len, h->bos_text, kvr_tok_add_bos(svc->tok));
        text += skip;
        len -= skip;
    }
    /* Each token stands for at most max_piece_bytes of text, so a text this long cannot
     * fit the context whatever it says; refuse before spending memory on tokenizing it. */
    size_t at_least = len / h->max_piece_bytes;
    if (at_least > (size_t)svc->n_ctx + 2) {
        rc = kvr_openai_error_set(e, 400, "invalid_request_error", chat ? "messages" : "prompt",
                                  "context_length_exceeded",
                                  "This model's maximum context length is %u tokens, but the "
                                  "prompt (%zu bytes) is at least %zu tokens",
                                  svc->n_ctx, len, at_least);
        goto out;
    }
    /* Enough room for any tokenization: at most one token per byte, plus BOS, EOS and
     * SentencePiece's added space. */
    size_t cap = len + 4;
    *ids = kvr_malloc(cap * sizeof **ids);
    if (!*ids || kvr_tok_scratch_create(&scratch, svc->tok, len ? len : 1) != 0)
        goto oom;
    /* Completion prompts are plain text: "<s>" typed by a user is not BOS. Chat templates
     * are written with control tokens as text, so they are parsed. */
    int n = kvr_tok_encode(svc->tok, scratch, text, len, add_special, chat, *ids, cap);
    if (n < 0) {
        rc = kvr_openai_error_set(e, 400, "invalid_request_error", chat ? "messages" : "prompt",
                                  "invalid_value", "the prompt cannot be tokenized: %s",
                                  kvr_strerror(n));
        goto out;
    }
    *n_ids = (uint32_t)n;
    goto out;
oom:
    rc = KVR_ENOMEM;
    kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
out:
    if (rc) {
        kvr_free(*ids);
        *ids = NULL;
    }
    kvr_tok_scratch_destroy(scratch);
    kvr_free(rendered);
    return rc;
}

static void make_id(char *out, size_t cap, const char *prefix)
{
    uint64_t a = random_u64(), b = random_u64();
    snprintf(out, cap, "%s%016llx%08llx", prefix, (unsigned long long)a,
             (unsigned long long)(b & 0xffffffffu));
}

static char *retry_after_value(char *buf, size_t cap, uint32_t s)
{
    snprintf(buf, cap, "%u", s);
    return buf;
}

/* ---- streaming (MHD content reader) ------------------------------------------------- */

/* Turn whatever the last pump produced into SSE bytes. */
static void stream_emit(struct gen *g)
{
    bool has_text = g->text.len > 0;
    if (g->done && g->outcome == OUT_ERROR) {
        kvr_openai_sse_error(&g->sse, &g->fail);
        kvr_openai_sse_done(&g->sse);
        g->sse_ended = true;
        return;
    }
    if (has_text || g->done) {
        enum kvr_openai_finish f = g->done ? g->finish : KVR_OPENAI_FINISH_NONE;
        kvr_openai_sse_chunk(&g->sse, &g->meta, g->sse_first, g->text.data ? g->text.data : "",
                             g->text.len, f, g->lp);
        g->sse_first = false;
        kvr_sbuf_clear(&g->text);
        if (g->lp) {
            json_decref(g->lp);
            g->lp = kvr_openai_logprobs_new(g->meta.api);
        }
    }
    if (g->done) {
        if (g->meta.include_usage)
            kvr_openai_sse_usage(&g->sse, &g->meta, g->n_prompt, g->n_gen);
        kvr_openai_sse_done(&g->sse);
        g->sse_ended = true;
    }
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct gen *g = cls;
    for (;;) {
        if (g->sse.failed)
            return MHD_CONTENT_READER_END_WITH_ERROR;
        if (g->sse_pos < g->sse.len) {
            size_t n = g->sse.len - g->sse_pos;
            if (n > max)
                n = max;
            memcpy(buf, g->sse.data + g->sse_pos, n);
            g->sse_pos += n;
            if (g->sse_pos == g->sse.len) {
                kvr_sbuf_clear(&g->sse);
                g->sse_pos = 0;
            }
            return (ssize_t)n;
        }
        if (g->sse_ended)
            return MHD_CONTENT_READER_END_OF_STREAM;
        if (peer_gone(g->fd)) {
            g->done = true;
            g->outcome = OUT_CLIENT_GONE;
            gen_cancel(g);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (atomic_load(&g->h->stopping)) {
            /* End the stream properly: an error event and [DONE], then the end. */
            gen_fail(g, 503, "shutting_down", "the server is shutting down");
            stream_emit(g);
            continue;
        }
        if (gen_pump(g, POLL_SLICE_MS))
            stream_emit(g);
    }
}

static void stream_free(void *cls)
{
    gen_destroy(cls);
}

/* ---- endpoints ---------------------------------------------------------------------- */

static enum MHD_Result handle_generate(struct kvr_http *h, struct request *rq,
                                       struct MHD_Connection *c)
{
    const struct kvr_service *svc = h->svc;
    enum kvr_openai_api api = rq->ep == EP_CHAT ? KVR_OPENAI_CHAT : KVR_OPENAI_COMPLETIONS;
    struct kvr_openai_error e;
    memset(&e, 0, sizeof e);
    int32_t *ids = NULL;
    enum MHD_Result ret;

    struct gen *g = kvr_calloc(1, sizeof *g);
    if (!g)
        return MHD_NO;
    g->h = h;
    g->fd = -1;
    g->t_start_ns = rq->t_start_ns;
    kvr_sbuf_init(&g->text);
    kvr_sbuf_init(&g->sse);
    kvr_openai_text_init(&g->cut, NULL, NULL, 0, NULL);

    struct kvr_openai_limits lim = {.n_ctx = svc->n_ctx, .n_vocab = (uint32_t)h->n_vocab};
    if (kvr_openai_parse(&g->req, api, rq->body.data ? rq->body.data : "", rq->body.len, &lim, &e))
        goto fail;
    const char *hdr = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Latency-Budget-Ms");
    if (hdr) {
        uint32_t ms = 0;
        if (kvr_openai_parse_budget_header(hdr, &ms, &e))
            goto fail;
        if (!g->req.total_ms)
            g->req.total_ms = ms;
        if (g->req.first_token_ms > g->req.total_ms) {
            kvr_openai_error_set(&e, 400, "invalid_request_error", "X-Latency-Budget-Ms",
                                 "invalid_value",
                                 "'latency_budget.first_token_ms' (%u ms) exceeds the "
                                 "X-Latency-Budget-Ms total (%u ms)",
                                 g->req.first_token_ms, g->req.total_ms);
            goto fail;
        }
    }

    uint32_t n_ids = 0;
    if (tokenize_prompt(h, g, &ids, &n_ids, &e))
        goto fail;
    if (kvr_openai_check_length(&g->req, n_ids, svc->n_ctx, h->default_max_tokens, &g->max_tokens,
                                &e))
        goto fail;
    g->n_prompt = n_ids;

    struct kvr_gen_request greq = {
        .prompt = ids,
        .n_prompt = n_ids,
        .max_tokens = g->max_tokens,
        .logprobs = g->req.logprobs,
        .ignore_eos = g->req.ignore_eos,
        .first_token_ms = g->req.first_token_ms,
        .total_ms = g->req.total_ms,
    };
    to_sample_params(&g->req.sampling, &greq.sampling);
    struct kvr_err serr = {0};
    if (kvr_sample_params_check(&greq.sampling, &serr)) {
        kvr_openai_error_set(&e, 400, "invalid_request_error", NULL, "invalid_value", "%s",
                             serr.msg);
        goto fail;
    }

    /* Text pipeline, before submit so nothing can fail after the stream exists. */
    g->piece_cap = kvr_detok_max_bytes(svc->tok);
    g->piece = kvr_malloc(g->piece_cap);
    if (g->req.logprobs)
        g->lp = kvr_openai_logprobs_new(api);
    if (!g->piece || (g->req.logprobs && !g->lp)) {
        kvr_openai_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    kvr_openai_text_fini(&g->cut);
    kvr_openai_text_init(&g->cut, g->req.stop, g->req.stop_len, g->req.n_stop,
                         api == KVR_OPENAI_CHAT ? kvr_chat_end_of_turn(h->chat) : NULL);
    kvr_detok_init(&g->detok, false, false);
    make_id(g->id, sizeof g->id, api == KVR_OPENAI_CHAT ? "chatcmpl-" : "cmpl-");
    g->meta = (struct kvr_openai_meta){.api = api,
                                       .id = g->id,
                                       .created = (int64_t)(kvr_wall_ms() / 1000),
                                       .model = svc->model_name,
                                       .include_usage = g->req.include_usage};
    g->fd = connection_fd(c);

    struct kvr_refusal refusal;
    memset(&refusal, 0, sizeof refusal);
    if (svc->ops->submit(svc->ctx, &greq, &g->stream, &refusal) != 0) {
        g->stream = NULL;
        refusal.message[sizeof refusal.message - 1] = 0;
        unsigned why = (unsigned)refusal.reason < KVR_REFUSE_REASON_COUNT ? refusal.reason
                                                                          : KVR_REFUSE_INTERNAL;
        pthread_mutex_lock(&h->metrics.mu);
        h->metrics.refused[why]++;
        pthread_mutex_unlock(&h->metrics.mu);
        int status = refusal_http[why].status;
        const char *type = status == 429   ? "rate_limit_error"
                           : status == 400 ? "invalid_request_error"
                                           : "server_error";
        kvr_openai_error_set(&e, status, type, NULL, refusal_labels[refusal_http[why].label], "%s",
                             refusal.message[0] ? refusal.message : "the request was refused");
        uint32_t retry_s = (uint32_t)(((uint64_t)refusal.retry_after_ms + 999) / 1000);
        if (retry_s < refusal_http[why].min_retry_s)
            retry_s = refusal_http[why].min_retry_s;
        char ra[16];
        const char *headers[] = {MHD_HTTP_HEADER_RETRY_AFTER,
                                 retry_after_value(ra, sizeof ra, retry_s), NULL};
        kvr_free(ids);
        ret = reply_error(h, rq, c, &e, retry_s ? headers : NULL);
        gen_destroy(g);
        return ret;
    }
    kvr_free(ids);
    ids = NULL;
    g->t_event_ns = kvr_now_ns();
    pthread_mutex_lock(&h->metrics.mu);
    h->metrics.prompt_tokens += n_ids;
    h->metrics.running++;
    pthread_mutex_unlock(&h->metrics.mu);

    if (g->req.stream) {
        g->sse_first = true;
        if (api == KVR_OPENAI_CHAT) {
            /* The role chunk goes out at once, as OpenAI's does. */
            kvr_openai_sse_chunk(&g->sse, &g->meta, true, "", 0, KVR_OPENAI_FINISH_NONE, NULL);
            g->sse_first = false;
        }
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024,
                                                                      stream_read, g, stream_free);
        if (!resp) {
            gen_destroy(g);
            return MHD_NO;
        }
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
        ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp); /* the connection holds it, and `g`, from here on */
        if (ret == MHD_YES)
            count_response(h, rq->ep, 200);
        return ret;
    }

    /* Not streaming: generate the whole answer on this thread. */
    while (!g->done) {
        if (peer_gone(g->fd)) {
            gen_destroy(g); /* counts it as client_gone and cancels */
            return MHD_NO;
        }
        if (atomic_load(&h->stopping)) {
            gen_fail(g, 503, "shutting_down", "the server is shutting down");
            break;
        }
        gen_pump(g, POLL_SLICE_MS);
    }
    if (g->outcome == OUT_ERROR) {
        ret = reply_error(h, rq, c, &g->fail, NULL);
        gen_destroy(g);
        return ret;
    }
    size_t len = 0;
    char *body = kvr_openai_response_json(&g->meta, g->text.data ? g->text.data : "", g->text.len,
                                          g->finish, g->n_prompt, g->n_gen, g->lp, &len);
    gen_destroy(g);
    if (!body)
        return MHD_NO;
    return reply(h, rq, c, 200, "application/json", body, len, NULL);

fail:
    kvr_free(ids);
    gen_destroy(g);
    if (e.status == 0)
        kvr_openai_error_set(&e, 500, "server_error", NULL, NULL, "internal error");
    return reply_error(h, rq, c, &e, NULL);
}

static enum MHD_Result handle_models(struct kvr_http *h, struct request *rq,
                                     struct MHD_Connection *c)
{
    if (rq->model_id) {
        if (strcmp(rq->model_id, h->svc->model_name) != 0)
            return reply_simple_error(h, rq, c, 404, "invalid_request_error", "model_not_found",
                                      NULL,
                                      "the model '%.200s' does not exist; this server "
                                      "serves '%.200s'",
                                      rq->model_id, h->svc->model_name);
        json_t *m = json_pack("{s:s,s:s,s:I,s:s,s:I}", "id", h->svc->model_name, "object", "model",
                              "created", (json_int_t)h->started_s, "owned_by", "kvasir",
                              "max_model_len", (json_int_t)h->svc->n_ctx);
        return reply_json(h, rq, c, 200, m, NULL);
    }
    json_t *j =
        json_pack("{s:s,s:[{s:s,s:s,s:I,s:s,s:I}]}", "object", "list", "data", "id",
                  h->svc->model_name, "object", "model", "created", (json_int_t)h->started_s,
                  "owned_by", "kvasir", "max_model_len", (json_int_t)h->svc->n_ctx);
    return reply_json(h, rq, c, 200, j, NULL);
}

static enum MHD_Result handle_health(struct kvr_http *h, struct request *rq,
                                     struct MHD_Connection *c)
{
    json_t *detail = json_object();
    if (!detail)
        return MHD_NO;
    bool up = h->svc->ops->health(h->svc->ctx, detail);
    json_t *j = json_pack("{s:s}", "status", up ? "ok" : "unavailable");
    if (j && json_object_update_missing(j, detail) != 0) {
        json_decref(j);
        j = NULL;
    }
    json_decref(detail);
    return reply_json(h, rq, c, up ? 200 : 503, j, NULL);
}

static enum MHD_Result handle_metrics(struct kvr_http *h, struct request *rq,
                                      struct MHD_Connection *c)
{
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    metrics_print(&h->metrics, &b);
    if (h->svc->ops->metrics)
        h->svc->ops->metrics(h->svc->ctx, &b);
    size_t len = 0;
    char *body = kvr_sbuf_take(&b, &len);
    if (!body)
        return MHD_NO;
    return reply(h, rq, c, 200, "text/plain; version=0.0.4; charset=utf-8", body, len, NULL);
}

/* ---- tokenizer endpoints (llama-server's shapes) -------------------------------------- */

/* POST /tokenize {"content", "add_special", "with_pieces"} -> {"tokens": [id, ...]} or, with
 * pieces, {"tokens": [{"id", "piece"}, ...]} where a piece that is not valid UTF-8 on its
 * own (part of a character) is given as its bytes. Control tokens written in the content
 * are parsed, as in chat prompts. */
static enum MHD_Result handle_tokenize(struct kvr_http *h, struct request *rq,
                                       struct MHD_Connection *c)
{
    struct kvr_openai_tokenize_req r;
    struct kvr_openai_error e;
    if (kvr_openai_parse_tokenize(&r, rq->body.data, rq->body.len, &e))
        return reply_error(h, rq, c, &e, NULL);
    const struct kvr_tok *tok = h->svc->tok;
    size_t cap = r.content_len + 4;
    int32_t *ids = kvr_malloc(cap * sizeof *ids);
    struct kvr_tok_scratch *scratch = NULL;
    json_t *list = json_array();
    enum MHD_Result res = MHD_NO;
    if (!ids || !list ||
        kvr_tok_scratch_create(&scratch, tok, r.content_len ? r.content_len : 1) != 0)
        goto out;
    int n = kvr_tok_encode(tok, scratch, r.content, r.content_len, r.add_special, true, ids, cap);
    if (n < 0) {
        kvr_openai_error_set(&e, 400, "invalid_request_error", "content", "invalid_value",
                             "the content cannot be tokenized: %s", kvr_strerror(n));
        res = reply_error(h, rq, c, &e, NULL);
        goto out;
    }
    for (int i = 0; i < n; i++) {
        json_t *item = json_integer(ids[i]);
        const char *p;
        size_t len;
        if (r.with_pieces && item) {
            json_t *piece;
            if (kvr_tok_decode_piece(tok, ids[i], true, &p, &len) != 0)
                len = 0;
            if (kvr_utf8_check(p, len) == len) {
                piece = json_stringn(len ? p : "", len);
            } else {
                piece = json_array();
                for (size_t k = 0; piece && k < len; k++)
                    json_array_append_new(piece, json_integer((unsigned char)p[k]));
            }
            item = json_pack("{s:o,s:o*}", "id", item, "piece", piece);
        }
        if (!item || json_array_append_new(list, item))
            goto out;
    }
    res = reply_json(h, rq, c, 200, json_pack("{s:O}", "tokens", list), NULL);
out:
    json_decref(list);
    kvr_tok_scratch_destroy(scratch);
    kvr_free(ids);
    kvr_openai_tokenize_req_fini(&r);
    return res;
}

/* POST /detokenize {"tokens": [id, ...]} -> {"content": text}: control tokens print as
 * their text, bytes that are not valid UTF-8 as U+FFFD. */
static enum MHD_Result handle_detokenize(struct kvr_http *h, struct request *rq,
                                         struct MHD_Connection *c)
{
    int32_t *ids;
    uint32_t n;
    struct kvr_openai_error e;
    if (kvr_openai_parse_detokenize(rq->body.data, rq->body.len, h->n_vocab, &ids, &n, &e))
        return reply_error(h, rq, c, &e, NULL);
    const struct kvr_tok *tok = h->svc->tok;
    size_t cap = kvr_detok_max_bytes(tok);
    char *piece = kvr_malloc(cap);
    struct kvr_sbuf text, clean;
    kvr_sbuf_init(&text);
    kvr_sbuf_init(&clean);
    enum MHD_Result res = MHD_NO;
    if (!piece)
        goto out;
    struct kvr_detok d;
    kvr_detok_init(&d, false, true);
    for (uint32_t i = 0; i <= n; i++) {
        int k =
            i < n ? kvr_detok_push(tok, &d, ids[i], piece, cap) : kvr_detok_flush(&d, piece, cap);
        if (k < 0)
            goto out;
        kvr_sbuf_append(&text, piece, (size_t)k);
    }
    kvr_utf8_sanitize(&clean, text.data ? text.data : "", text.len);
    if (text.failed || clean.failed)
        goto out;
    res = reply_json(h, rq, c, 200,
                     json_pack("{s:s%}", "content", clean.data ? clean.data : "", clean.len), NULL);
out:
    kvr_sbuf_fini(&text);
    kvr_sbuf_fini(&clean);
    kvr_free(piece);
    kvr_free(ids);
    return res;
}

/* POST /apply-template {"messages": [...]} -> {"prompt": text}: the chat prompt exactly as
 * /v1/chat/completions renders it (with the assistant's turn opened), before tokenizing. */
static enum MHD_Result handle_apply_template(struct kvr_http *h, struct request *rq,
                                             struct MHD_Connection *c)
{
    struct kvr_openai_req r;
    struct kvr_openai_error e;
    const struct kvr_openai_limits lim = {.n_ctx = h->svc->n_ctx, .n_vocab = (uint32_t)h->n_vocab};
    if (kvr_openai_parse(&r, KVR_OPENAI_CHAT, rq->body.data, rq->body.len, &lim, &e)) {
        kvr_openai_req_fini(&r);
        return reply_error(h, rq, c, &e, NULL);
    }
    char *prompt = NULL;
    size_t len = 0;
    enum MHD_Result res;
    if (render_chat(h, r.msgs, r.n_msgs, &prompt, &len, &e))
        res = reply_error(h, rq, c, &e, NULL);
    else
        res = reply_json(h, rq, c, 200, json_pack("{s:s%}", "prompt", prompt, len), NULL);
    kvr_free(prompt);
    kvr_openai_req_fini(&r);
    return res;
}

/* ---- routing ------------------------------------------------------------------------ */

static const struct route {
    const char *path;
    enum endpoint ep;
    bool post; /* POST only; otherwise GET and HEAD */
    bool open; /* no API key needed */
} routes[] = {
    {"/v1/completions", EP_COMPLETIONS, true, false},
    {"/v1/chat/completions", EP_CHAT, true, false},
    {"/v1/models", EP_MODELS, false, false},
    {"/health", EP_HEALTH, false, true},
    {"/readyz", EP_HEALTH, false, true},
    {"/livez", EP_LIVEZ, false, true},
    {"/metrics", EP_METRICS, false, false},
    {"/tokenize", EP_TOKENIZE, true, false},
    {"/detokenize", EP_DETOKENIZE, true, false},
    {"/apply-template", EP_APPLY_TEMPLATE, true, false},
    {"/reset_prefix_cache", EP_RESET_PREFIX_CACHE, true, false},
};

/* "/v1/models/" followed by a model id (which may itself contain '/'). */
#define MODEL_PREFIX "/v1/models/"

static const struct route *find_route(const char *url)
{
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(url, routes[i].path))
            return &routes[i];
    if (strncmp(url, MODEL_PREFIX, strlen(MODEL_PREFIX)) != 0 || !url[strlen(MODEL_PREFIX)])
        return NULL;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (routes[i].ep == EP_MODELS)
            return &routes[i]; /* same methods and key as the list */
    return NULL;
}

/* First call for a request: everything that can be decided from the headers. Returns
 * MHD_YES having queued nothing to go on reading the body. */
static enum MHD_Result on_headers(struct kvr_http *h, struct request *rq, struct MHD_Connection *c,
                                  const char *url, const char *method)
{
    const struct route *rt = find_route(url);
    if (!rt) {
        rq->ep = EP_OTHER;
        rq->answered = true;
        return reply_simple_error(h, rq, c, 404, "invalid_request_error", "not_found", NULL,
                                  "no such endpoint: %.100s %.200s", method, url);
    }
    rq->ep = rt->ep;
    if (rt->ep == EP_MODELS && strcmp(url, rt->path) != 0) {
        rq->model_id = kvr_strdup(url + strlen(MODEL_PREFIX));
        if (!rq->model_id)
            return MHD_NO;
    }
    bool allowed =
        rt->post ? !strcmp(method, "POST") : !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if (!allowed) {
        static const char *const allow_post[] = {MHD_HTTP_HEADER_ALLOW, "POST", NULL};
        static const char *const allow_get[] = {MHD_HTTP_HEADER_ALLOW, "GET, HEAD", NULL};
        rq->answered = true;
        return reply_simple_error(h, rq, c, 405, "invalid_request_error", "method_not_allowed",
                                  rt->post ? allow_post : allow_get,
                                  "method %.100s is not allowed on %s; use %s", method, rt->path,
                                  rt->post ? "POST" : "GET");
    }
    if (h->api_key && !rt->open &&
        !key_ok(h,
                MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION))) {
        static const char *const challenge[] = {MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer", NULL};
        rq->answered = true;
        return reply_simple_error(h, rq, c, 401, "authentication_error", "invalid_api_key",
                                  challenge,
                                  "missing or invalid API key: send 'Authorization: Bearer "
                                  "<key>'");
    }
    const char *cl =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end = NULL;
        unsigned long long n = strtoull(cl, &end, 10);
        if (end != cl && n > h->max_body_bytes) {
            rq->answered = true;
            return reply_simple_error(h, rq, c, 413, "invalid_request_error", "body_too_large",
                                      NULL,
                                      "the request body (%llu bytes) is larger than the "
                                      "limit of %zu bytes",
                                      n, h->max_body_bytes);
        }
    }
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls)
{
    struct kvr_http *h = cls;
    struct request *rq = *con_cls;
    if (!rq) {
        rq = kvr_calloc(1, sizeof *rq);
        if (!rq)
            return MHD_NO;
        rq->t_start_ns = kvr_now_ns();
        kvr_sbuf_init(&rq->body);
        *con_cls = rq;
        return on_headers(h, rq, c, url, method);
    }
    if (rq->answered) {
        /* Answered from the headers; whatever body follows is not wanted. */
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (!rq->too_large && rq->body.len + n > h->max_body_bytes) {
            rq->too_large = true;
            kvr_sbuf_fini(&rq->body);
        }
        if (!rq->too_large) {
            kvr_sbuf_append(&rq->body, upload_data, n);
            if (rq->body.failed)
                return MHD_NO;
        }
        return MHD_YES;
    }
    if (rq->too_large)
        return reply_simple_error(h, rq, c, 413, "invalid_request_error", "body_too_large", NULL,
                                  "the request body is larger than the limit of %zu bytes",
                                  h->max_body_bytes);
    switch (rq->ep) {
    case EP_COMPLETIONS:
    case EP_CHAT:
        return handle_generate(h, rq, c);
    case EP_MODELS:
        return handle_models(h, rq, c);
    case EP_HEALTH:
        return handle_health(h, rq, c);
    case EP_LIVEZ:
        return reply_json(h, rq, c, 200, json_pack("{s:s}", "status", "ok"), NULL);
    case EP_METRICS:
        return handle_metrics(h, rq, c);
    case EP_TOKENIZE:
        return handle_tokenize(h, rq, c);
    case EP_DETOKENIZE:
        return handle_detokenize(h, rq, c);
    case EP_APPLY_TEMPLATE:
        return handle_apply_template(h, rq, c);
    case EP_RESET_PREFIX_CACHE: {
        long n = h->svc->ops->reset_prefix_cache ? h->svc->ops->reset_prefix_cache(h->svc->ctx) : 0;
        return reply_json(h, rq, c, 200,
                          json_pack("{s:s, s:I}", "status", "ok", "blocks_freed", (json_int_t)n),
                          NULL);
    }
    default:
        return MHD_NO;
    }
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    struct request *rq = *con_cls;
    if (!rq)
        return;
    kvr_sbuf_fini(&rq->body);
    kvr_free(rq->model_id);
    kvr_free(rq);
    *con_cls = NULL;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && msg[n - 1] == '\n')
        msg[--n] = 0;
    /* Mostly clients that went away mid-response: worth a line, not an alarm. */
    KVR_INFO("http: %s", msg);
}

/* ---- create / destroy --------------------------------------------------------------- */

void kvr_http_config_init(struct kvr_http_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->host = "127.0.0.1";
    cfg->port = 8080;
    cfg->api_key = getenv("KVASIR_API_KEY");
    cfg->max_body_bytes = 1u << 20;
    cfg->max_connections = 256;
    cfg->idle_timeout_s = 60;
    cfg->stall_timeout_s = 300;
}

/* ---- start-up ----------------------------------------------------------------------- */

#define TLS_FILE_MAX_BYTES (1u << 20)

/* Read a PEM file (at most 1 MiB) into a NUL-terminated heap string. */
static int read_pem(const char *path, const char *what, char **out, struct kvr_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kvr_err_set(err, KVR_EIO, "http: %s %s: %s", what, path, strerror(errno));
    char *buf = kvr_malloc(TLS_FILE_MAX_BYTES + 1);
    size_t n = buf ? fread(buf, 1, TLS_FILE_MAX_BYTES + 1, f) : 0;
    int bad = !buf ? KVR_ENOMEM : ferror(f) ? KVR_EIO : n > TLS_FILE_MAX_BYTES ? KVR_ERANGE : 0;
    fclose(f);
    if (bad) {
        kvr_free(buf);
        return kvr_err_set(err, bad, "http: %s %s: %s", what, path,
                           bad == KVR_ERANGE ? "larger than 1 MiB" : "cannot read it");
    }
    buf[n] = 0;
    if (!strstr(buf, "-----BEGIN ")) {
        kvr_free(buf);
        return kvr_err_set(err, KVR_EINVAL, "http: %s %s is not a PEM file", what, path);
    }
    *out = buf;
    return KVR_OK;
}

/* Wipe and free a PEM buffer (the key's is secret). */
static void free_pem(char *p)
{
    if (p) {
        memset(p, 0, strlen(p));
        kvr_free(p);
    }
}

/* A special token's text as a new string, or NULL when there is none. */
static char *token_text(const struct kvr_tok *tok, int32_t id)
{
    const char *p;
    size_t len;
    if (id < 0 || kvr_tok_decode_piece(tok, id, true, &p, &len) != 0)
        return NULL;
    char *s = kvr_malloc(len + 1);
    if (s) {
        memcpy(s, p, len);
        s[len] = 0;
    }
    return s;
}

/* The chat formatter: a built-in by name, else a Jinja template (the configuration's,
 * else the model's), else the plain form, which is logged once here. */
static int make_chat(struct kvr_http *h, const struct kvr_http_config *cfg,
                     const struct kvr_service *svc, struct kvr_err *err)
{
    char *eos = token_text(svc->tok, kvr_tok_eos(svc->tok));
    h->bos_text = token_text(svc->tok, kvr_tok_bos(svc->tok));
    struct kvr_chat_config cc = {.builtin = cfg->chat_template,
                                 .jinja = cfg->chat_template_src,
                                 .jinja_len = cfg->chat_template_src_len,
                                 .bos_token = h->bos_text,
                                 .eos_token = eos};
    if (!cc.builtin && !cc.jinja) {
        cc.jinja = svc->chat_template;
        cc.jinja_len = svc->chat_template_len;
    }
    struct kvr_err cerr = {0};
    int rc = kvr_chat_create(&h->chat, &cc, &cerr);
    kvr_free(eos);
    if (rc)
        return kvr_err_set(err, rc == KVR_ENOTFOUND ? KVR_EINVAL : rc, "http: chat template: %s",
                           cerr.msg);
    if (kvr_chat_source(h->chat) == KVR_CHAT_SOURCE_PLAIN)
        KVR_INFO("http: the model has no chat template and none was given; chats are "
                 "formatted as plain \"role: content\" lines");
    else
        KVR_INFO("http: chats are formatted with %s%s", kvr_chat_describe(h->chat),
                 cfg->chat_template_src ? " given with --chat-template"
                 : cfg->chat_template   ? ""
                                        : " of the model");
    return KVR_OK;
}

int kvr_http_create(struct kvr_http **out, const struct kvr_http_config *cfg,
                    const struct kvr_service *svc, struct kvr_err *err)
{
    *out = NULL;
    const struct kvr_service_ops *ops = svc ? svc->ops : NULL;
    if (!ops || !ops->submit || !ops->next || !ops->cancel || !ops->release || !ops->health)
        return kvr_err_set(err, KVR_EINVAL, "http: the service lacks required operations");
    if (!svc->tok || svc->n_ctx < 2 || !svc->model_name)
        return kvr_err_set(err, KVR_EINVAL,
                           "http: the service needs a tokenizer, a model name and n_ctx >= 2");
    if (!cfg->tls_cert_file != !cfg->tls_key_file)
        return kvr_err_set(err, KVR_EINVAL, "http: HTTPS needs both a certificate and a key");
    if (cfg->tls_cert_file && MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES)
        return kvr_err_set(err, KVR_ENOTSUP, "http: this libmicrohttpd was built without TLS");
    if (cfg->max_body_bytes == 0 || cfg->max_connections == 0)
        return kvr_err_set(err, KVR_EINVAL,
                           "http: max_body_bytes and max_connections must be "
                           "positive");

    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons(cfg->port);
    const char *host = cfg->host ? cfg->host : "127.0.0.1";
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1)
        return kvr_err_set(err, KVR_EINVAL, "http: '%s' is not an IPv4 address", host);

    struct kvr_http *h = kvr_calloc(1, sizeof *h);
    if (!h)
        return kvr_err_set(err, KVR_ENOMEM, "http: out of memory");
    h->svc = svc;
    h->max_body_bytes = cfg->max_body_bytes;
    h->stall_timeout_ms =
        cfg->stall_timeout_s > UINT32_MAX / 1000 ? UINT32_MAX : cfg->stall_timeout_s * 1000;
    h->default_max_tokens = cfg->default_max_tokens;
    h->started_s = (int64_t)(kvr_wall_ms() / 1000);
    h->n_vocab = kvr_tok_n_vocab(svc->tok);
    atomic_init(&h->stopping, false);
    pthread_mutex_init(&h->metrics.mu, NULL);
    hist_init(&h->metrics.ttft, ttft_bounds, sizeof ttft_bounds / sizeof ttft_bounds[0]);
    hist_init(&h->metrics.itl, itl_bounds, sizeof itl_bounds / sizeof itl_bounds[0]);
    hist_init(&h->metrics.e2e, e2e_bounds, sizeof e2e_bounds / sizeof e2e_bounds[0]);
    int rc;

    if (cfg->api_key && cfg->api_key[0]) {
        h->api_key = kvr_strdup(cfg->api_key);
        if (!h->api_key) {
            rc = kvr_err_set(err, KVR_ENOMEM, "http: out of memory");
            goto fail;
        }
        h->api_key_len = strlen(h->api_key);
    }

    rc = make_chat(h, cfg, svc, err);
    if (rc)
        goto fail;

    /* The longest text a token can stand for bounds how much text can fit the context. */
    h->max_piece_bytes = 4;
    for (int32_t id = 0; id < h->n_vocab; id++) {
        const char *p;
        size_t len;
        if (kvr_tok_decode_piece(svc->tok, id, true, &p, &len) == 0 && len > h->max_piece_bytes)
            h->max_piece_bytes = len;
    }

    struct MHD_OptionItem tls[3] = {{MHD_OPTION_END, 0, NULL}};
    if (cfg->tls_cert_file) {
        if ((rc = read_pem(cfg->tls_cert_file, "certificate", &h->tls_cert, err)) ||
            (rc = read_pem(cfg->tls_key_file, "key", &h->tls_key, err)))
            goto fail;
        tls[0] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, h->tls_cert};
        tls[1] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, h->tls_key};
        tls[2] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    }
    /* MHD_USE_ITC: kvr_http_destroy quiesces the listener before closing connections. */
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                     MHD_USE_POLL | MHD_USE_ERROR_LOG | MHD_USE_ITC |
                     (cfg->tls_cert_file ? MHD_USE_TLS : 0);
    /* The logger comes first so that MHD's messages about later options reach it. */
    h->daemon = MHD_start_daemon(flags, cfg->port, NULL, NULL, on_request, h,
                                 MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h, MHD_OPTION_SOCK_ADDR,
                                 (struct sockaddr *)&addr, MHD_OPTION_CONNECTION_LIMIT,
                                 (unsigned)cfg->max_connections, MHD_OPTION_CONNECTION_TIMEOUT,
                                 (unsigned)cfg->idle_timeout_s, MHD_OPTION_NOTIFY_COMPLETED,
                                 on_completed, h, MHD_OPTION_ARRAY, tls, MHD_OPTION_END);
    if (!h->daemon) {
        rc = kvr_err_set(err, KVR_EIO, "http: cannot listen on %s:%u%s", host, cfg->port,
                         cfg->tls_cert_file ? " (or the TLS certificate or key was refused: "
                                              "see the log line before)"
                                            : "");
        goto fail;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
    h->port = di ? di->port : cfg->port;
    KVR_INFO("http: listening on %s://%s:%u (model %s, context %u)%s",
             h->tls_cert ? "https" : "http", host, h->port, svc->model_name, svc->n_ctx,
             h->api_key ? ", API key required" : "");
    *out = h;
    return KVR_OK;
fail:
    free_pem(h->tls_cert);
    free_pem(h->tls_key);
    kvr_free(h->api_key);
    kvr_chat_destroy(h->chat);
    kvr_free(h->bos_text);
    pthread_mutex_destroy(&h->metrics.mu);
    kvr_free(h);
    return rc;
}

uint16_t kvr_http_port(const struct kvr_http *h)
{
    return h->port;
}

void kvr_http_destroy(struct kvr_http *h)
{
    if (!h)
        return;
    /* Generation loops see this within one poll slice: they cancel their streams and answer
     * 503 (an error event in a stream). New connections are no longer accepted; those in
     * progress get a short grace period to send that answer before all are closed. */
    atomic_store(&h->stopping, true);
    MHD_socket listen_fd = MHD_quiesce_daemon(h->daemon);
    uint64_t deadline = kvr_now_ns() + SHUTDOWN_GRACE_MS * 1000000ull;
    for (;;) {
        pthread_mutex_lock(&h->metrics.mu);
        int64_t running = h->metrics.running;
        pthread_mutex_unlock(&h->metrics.mu);
        if (running <= 0 || kvr_now_ns() >= deadline)
            break;
        kvr_sleep_ns(10 * 1000000ull);
    }
    MHD_stop_daemon(h->daemon);
    if (listen_fd != MHD_INVALID_SOCKET)
        close(listen_fd); /* quiesce handed it to us; only safe after stop */
    pthread_mutex_destroy(&h->metrics.mu);
    free_pem(h->tls_cert);
    free_pem(h->tls_key);
    kvr_free(h->api_key);
    kvr_chat_destroy(h->chat);
    kvr_free(h->bos_text);
    kvr_free(h);
}
