/* http.c - the OpenAI-compatible HTTP API on libmicrohttpd (see http.h): transport and
 * routing. The generation pipeline is generation.c; the metrics are http_metrics.c.
 *
 * A request's life, in the order of this file:
 *   1. on_request, first call (on_headers): route and method, API key, declared body size.
 *      Any failure is answered at once, before the body is read.
 *   2. on_request, body calls (take_body): the body is collected up to max_body_bytes;
 *      beyond that it is dropped and the request answered 413 (never buffered whole).
 *   3. on_request, last call (run_endpoint): the endpoint runs. Generation endpoints
 *      (handle_generate) prepare and submit a struct kvr_generation, then either pump it
 *      to the end on this thread and answer one JSON body (answer_whole), or hand it to
 *      libmicrohttpd's content reader, which pumps it for SSE chunks (answer_stream,
 *      stream_read). Between pumps both check the client's socket and shutdown.
 *   4. on_completed / stream_free: the generation is destroyed (stream cancelled and
 *      released, outcome counted).
 * Around it, the door (http_door.c) admits each connection (on_accept, on_connection) and
 * is told when its headers are in, its request complete, its answer sent: it closes what
 * misses a deadline and makes room when the connections without a request fill their share.
 * CORS headers go on every answer (add_cors); OPTIONS is answered from the headers. */
#define _GNU_SOURCE /* POLLRDHUP */
#include "bridge/http.h"
#include "bridge/http_int.h"

#include "bridge/chat.h"
#include "bridge/console.h"
#include "bridge/generation.h"
#include "bridge/responses.h"
#include "bridge/http_door.h"
#include "bridge/http_metrics.h"
#include "bridge/openai.h"
#include "bridge/telemetry.h"
#include "core/sbuf.h"
#include "core/utf8.h"
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
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- responses ---------------------------------------------------------------------- */

static void free_body(void *p)
{
    kvr_free(p);
}

/* CORS: every answer names the allowed origin, so a web page may read it (and its
 * Retry-After); a single configured origin varies by the request's Origin for caches. */
static void add_cors(const struct kvr_http *h, struct MHD_Response *resp)
{
    if (!h->cors_origin)
        return;
    MHD_add_response_header(resp, "Access-Control-Allow-Origin", h->cors_origin);
    MHD_add_response_header(resp, "Access-Control-Expose-Headers", "Retry-After");
    if (strcmp(h->cors_origin, "*") != 0)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_VARY, "Origin");
}

/* Queue `body` (kvr_malloc'd, taken) with `status`. `headers` is NULL or a NULL-terminated
 * list of name, value pairs. */
enum MHD_Result kvr_http_reply(struct kvr_http *h, struct request *rq, struct MHD_Connection *c,
                               int status, const char *ctype, char *body, size_t len,
                               const char *const *headers)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer_with_free_callback(len, body, free_body);
    if (!resp) {
        kvr_free(body);
        return MHD_NO;
    }
    if (ctype)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    add_cors(h, resp);
    for (size_t i = 0; headers && headers[i]; i += 2)
        MHD_add_response_header(resp, headers[i], headers[i + 1]);
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    if (ok == MHD_YES)
        kvr_http_metrics_response(&h->metrics, rq->ep, status);
    KVR_DEBUG("http: %s -> %d (%zu bytes, %.1f ms)", kvr_http_endpoint_name(rq->ep), status, len,
              (double)(kvr_now_ns() - rq->t_start_ns) * 1e-6);
    return ok;
}

enum MHD_Result kvr_http_reply_json(struct kvr_http *h, struct request *rq,
                                    struct MHD_Connection *c, int status, json_t *j,
                                    const char *const *headers)
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
    return kvr_http_reply(h, rq, c, status, "application/json", body, len, headers);
}

enum MHD_Result kvr_http_reply_error(struct kvr_http *h, struct request *rq,
                                     struct MHD_Connection *c, const struct kvr_openai_error *e,
                                     const char *const *headers)
{
    size_t len = 0;
    char *body = kvr_openai_error_json(e, &len);
    if (!body)
        return MHD_NO;
    return kvr_http_reply(h, rq, c, e->status, "application/json", body, len, headers);
}

enum MHD_Result kvr_http_reply_simple_error(struct kvr_http *h, struct request *rq,
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
    return kvr_http_reply_error(h, rq, c, &e, headers);
}

/* ---- the client: its socket and its key --------------------------------------------- */

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

int kvr_http_connection_fd(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
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

/* ---- generation endpoints ----------------------------------------------------------- */

/* A streaming response's content-reader state. Owned by the MHD response; freed in
 * stream_free. */
struct stream {
    struct kvr_http *h;
    struct kvr_generation *g;
    int fd; /* the client's socket, for peer_gone */
};

/* libmicrohttpd asks for the next bytes of the body: hand over SSE chunks already made,
 * else pump the generation for more, checking the client and shutdown between pumps. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct stream *s = cls;
    for (;;) {
        size_t n = 0;
        switch (kvr_generation_sse_read(s->g, buf, max, &n)) {
        case KVR_GENERATION_SSE_BYTES:
            return (ssize_t)n;
        case KVR_GENERATION_SSE_END:
            return MHD_CONTENT_READER_END_OF_STREAM;
        case KVR_GENERATION_SSE_BROKEN:
            return MHD_CONTENT_READER_END_WITH_ERROR;
        default:
            break;
        }
        if (peer_gone(s->fd)) {
            kvr_generation_abandon(s->g);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (atomic_load(&s->h->stopping))
            kvr_generation_shut_down(s->g); /* an error event and [DONE], then the end */
        else
            kvr_generation_pump(s->g, POLL_SLICE_MS);
    }
}

static void stream_free(void *cls)
{
    struct stream *s = cls;
    kvr_generation_destroy(s->g);
    kvr_free(s);
}

/* Admission's estimate, when the service made one: the console shows it beside what
 * happened (docs/API.md, "GET / (the console) and GET /v1/telemetry"). */
static void add_estimate_headers(struct MHD_Response *resp, const struct kvr_generation *g)
{
    double first_ms, total_ms;
    uint64_t id;
    if (!kvr_generation_estimate(g, &first_ms, &total_ms, &id))
        return;
    char v[3][32];
    snprintf(v[0], sizeof v[0], "%.1f", first_ms);
    snprintf(v[1], sizeof v[1], "%.1f", total_ms);
    snprintf(v[2], sizeof v[2], "%llu", (unsigned long long)id);
    MHD_add_response_header(resp, "X-Kvasir-Estimate-First-Token-Ms", v[0]);
    MHD_add_response_header(resp, "X-Kvasir-Estimate-Total-Ms", v[1]);
    MHD_add_response_header(resp, "X-Kvasir-Request-Id", v[2]);
}

/* Streaming: the response is an SSE body that libmicrohttpd pulls from stream_read. */
static enum MHD_Result answer_stream(struct kvr_http *h, struct request *rq,
                                     struct MHD_Connection *c, struct kvr_generation *g, int fd)
{
    struct stream *s = kvr_malloc(sizeof *s);
    struct MHD_Response *resp = NULL;
    if (s) {
        *s = (struct stream){.h = h, .g = g, .fd = fd};
        resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_read, s,
                                                 stream_free);
    }
    if (!resp) {
        kvr_free(s);
        kvr_generation_destroy(g);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    add_estimate_headers(resp, g);
    add_cors(h, resp);
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp); /* the connection holds it, and `g`, from here on */
    if (ret == MHD_YES)
        kvr_http_metrics_response(&h->metrics, rq->ep, 200);
    return ret;
}

/* Not streaming: generate the whole answer on this thread, then send one JSON body. */
static enum MHD_Result answer_whole(struct kvr_http *h, struct request *rq,
                                    struct MHD_Connection *c, struct kvr_generation *g, int fd)
{
    while (!kvr_generation_done(g)) {
        if (peer_gone(fd)) {
            kvr_generation_destroy(g); /* counts it as client_gone and cancels */
            return MHD_NO;
        }
        if (atomic_load(&h->stopping)) {
            kvr_generation_shut_down(g);
            break;
        }
        kvr_generation_pump(g, POLL_SLICE_MS);
    }
    const struct kvr_openai_error *fail = kvr_generation_error(g);
    if (fail) {
        enum MHD_Result ret = kvr_http_reply_error(h, rq, c, fail, NULL);
        kvr_generation_destroy(g);
        return ret;
    }
    size_t len = 0;
    char *body = kvr_generation_json(g, &len);
    kvr_generation_destroy(g);
    if (!body)
        return MHD_NO;
    return kvr_http_reply(h, rq, c, 200, "application/json", body, len, NULL);
}

/* POST /v1/completions and /v1/chat/completions: prepare, submit, answer. A refusal is
 * answered with its status and, when the service gave one, a Retry-After. */
static enum MHD_Result handle_generate(struct kvr_http *h, struct request *rq,
                                       struct MHD_Connection *c)
{
    enum kvr_openai_api api =
        rq->ep == KVR_HTTP_ENDPOINT_COMPLETIONS ? KVR_OPENAI_COMPLETIONS : KVR_OPENAI_CHAT;
    struct kvr_openai_error e;
    memset(&e, 0, sizeof e);
    struct kvr_generation *g = kvr_generation_create(&h->gen, api, rq->t_start_ns);
    if (!g)
        return MHD_NO;
    const char *budget = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Latency-Budget-Ms");
    const char *body = rq->body.data ? rq->body.data : "";
    if (rq->ep == KVR_HTTP_ENDPOINT_RESPONSES
            ? kvr_responses_prepare(g, h->responses, body, rq->body.len, budget, &e)
            : kvr_generation_prepare(g, body, rq->body.len, budget, &e)) {
        kvr_generation_destroy(g);
        return kvr_http_reply_error(h, rq, c, &e, NULL);
    }
    uint32_t retry_s = 0;
    if (kvr_generation_submit(g, &e, &retry_s) != 0) {
        char ra[16];
        snprintf(ra, sizeof ra, "%u", retry_s);
        const char *headers[] = {MHD_HTTP_HEADER_RETRY_AFTER, ra, NULL};
        enum MHD_Result ret = kvr_http_reply_error(h, rq, c, &e, retry_s ? headers : NULL);
        kvr_generation_destroy(g);
        return ret;
    }
    int fd = kvr_http_connection_fd(c);
    if (kvr_generation_streams(g))
        return answer_stream(h, rq, c, g, fd);
    return answer_whole(h, rq, c, g, fd);
}

/* ---- routing ------------------------------------------------------------------------ */

static const struct route {
    const char *path;
    enum kvr_http_endpoint ep;
    bool post; /* POST only; otherwise GET and HEAD */
    bool open; /* no API key needed */
} routes[] = {
    {"/v1/completions", KVR_HTTP_ENDPOINT_COMPLETIONS, true, false},
    {"/v1/chat/completions", KVR_HTTP_ENDPOINT_CHAT, true, false},
    {"/v1/responses", KVR_HTTP_ENDPOINT_RESPONSES, true, false},
    {"/v1/models", KVR_HTTP_ENDPOINT_MODELS, false, false},
    {"/health", KVR_HTTP_ENDPOINT_HEALTH, false, true},
    {"/readyz", KVR_HTTP_ENDPOINT_HEALTH, false, true},
    {"/livez", KVR_HTTP_ENDPOINT_LIVEZ, false, true},
    {"/metrics", KVR_HTTP_ENDPOINT_METRICS, false, false},
    {"/tokenize", KVR_HTTP_ENDPOINT_TOKENIZE, true, false},
    {"/detokenize", KVR_HTTP_ENDPOINT_DETOKENIZE, true, false},
    {"/apply-template", KVR_HTTP_ENDPOINT_APPLY_TEMPLATE, true, false},
    {"/reset_prefix_cache", KVR_HTTP_ENDPOINT_RESET_PREFIX_CACHE, true, false},
    {"/v1/telemetry", KVR_HTTP_ENDPOINT_TELEMETRY, false, false},
};

/* "/" and every other asset of the console (console.h), when the URL names one. */
static const struct route console_route = {"/", KVR_HTTP_ENDPOINT_CONSOLE, false, true};

/* "/v1/models/" followed by a model id (which may itself contain '/'). */
#define MODEL_PREFIX "/v1/models/"

static const struct route *find_route(const char *url)
{
    const void *data;
    size_t len;
    const char *type;
    if (kvr_console_asset(url, &data, &len, &type) == 0)
        return &console_route;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (!strcmp(url, routes[i].path))
            return &routes[i];
    if (strncmp(url, MODEL_PREFIX, strlen(MODEL_PREFIX)) != 0 || !url[strlen(MODEL_PREFIX)])
        return NULL;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (routes[i].ep == KVR_HTTP_ENDPOINT_MODELS)
            return &routes[i]; /* same methods and key as the list */
    return NULL;
}

/* The request headers a browser may send with CORS: the OpenAI SDKs' (the JavaScript one
 * in a browser sends its X-Stainless-* platform headers) and ours. A preflight that names
 * others gets its own list back (as vLLM's allow_headers ["*"] does). */
#define CORS_HEADERS                                                                               \
    "Authorization, Content-Type, Accept, OpenAI-Organization, OpenAI-Project, OpenAI-Beta, "      \
    "X-Stainless-Lang, X-Stainless-Package-Version, X-Stainless-OS, X-Stainless-Arch, "            \
    "X-Stainless-Runtime, X-Stainless-Runtime-Version, X-Stainless-Retry-Count, "                  \
    "X-Stainless-Timeout, X-Stainless-Async, X-Latency-Budget-Ms"

/* A header list fit to echo: header-name characters, commas and spaces, at most 1 KiB. */
static bool header_list_ok(const char *s)
{
    size_t n = strlen(s);
    return n > 0 && n <= 1024 &&
           strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_, ") == n;
}

/* OPTIONS on a route: 204 with the methods it takes and, with CORS on, the preflight's
 * answer. It needs no API key: browsers never send one with a preflight. */
static enum MHD_Result reply_preflight(struct kvr_http *h, struct request *rq,
                                       struct MHD_Connection *c, const struct route *rt)
{
    const char *methods = rt->post ? "POST, OPTIONS" : "GET, HEAD, OPTIONS";
    const char *asked =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Headers");
    const char *allow_headers = asked && header_list_ok(asked) ? asked : CORS_HEADERS;
    const char *const plain[] = {MHD_HTTP_HEADER_ALLOW, methods, NULL};
    const char *const cors[] = {MHD_HTTP_HEADER_ALLOW,
                                methods,
                                "Access-Control-Allow-Methods",
                                methods,
                                "Access-Control-Allow-Headers",
                                allow_headers,
                                "Access-Control-Max-Age",
                                "86400",
                                NULL};
    char *body = kvr_malloc(1);
    if (!body)
        return MHD_NO;
    return kvr_http_reply(h, rq, c, 204, NULL, body, 0, h->cors_origin ? cors : plain);
}

/* First call for a request: everything that can be decided from the headers. Returns
 * MHD_YES having queued nothing to go on reading the body. */
static enum MHD_Result on_headers(struct kvr_http *h, struct request *rq, struct MHD_Connection *c,
                                  const char *url, const char *method)
{
    const struct route *rt = find_route(url);
    if (!rt) {
        rq->ep = KVR_HTTP_ENDPOINT_OTHER;
        rq->answered = true;
        return kvr_http_reply_simple_error(h, rq, c, 404, "invalid_request_error", "not_found",
                                           NULL, "no such endpoint: %.100s %.200s", method, url);
    }
    rq->ep = rt->ep;
    rq->url = url;
    if (!strcmp(method, "OPTIONS")) {
        rq->answered = true;
        return reply_preflight(h, rq, c, rt);
    }
    if (rt->ep == KVR_HTTP_ENDPOINT_MODELS && strcmp(url, rt->path) != 0) {
        rq->model_id = kvr_strdup(url + strlen(MODEL_PREFIX));
        if (!rq->model_id)
            return MHD_NO;
    }
    bool allowed =
        rt->post ? !strcmp(method, "POST") : !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if (!allowed) {
        static const char *const allow_post[] = {MHD_HTTP_HEADER_ALLOW, "POST, OPTIONS", NULL};
        static const char *const allow_get[] = {MHD_HTTP_HEADER_ALLOW, "GET, HEAD, OPTIONS", NULL};
        rq->answered = true;
        return kvr_http_reply_simple_error(h, rq, c, 405, "invalid_request_error",
                                           "method_not_allowed", rt->post ? allow_post : allow_get,
                                           "method %.100s is not allowed on %s; use %s", method,
                                           rt->path, rt->post ? "POST" : "GET");
    }
    bool open = rt->open || (rt->ep == KVR_HTTP_ENDPOINT_METRICS && h->metrics_public);
    if (h->api_key && !open &&
        !key_ok(h,
                MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION))) {
        static const char *const challenge[] = {MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer", NULL};
        rq->answered = true;
        return kvr_http_reply_simple_error(
            h, rq, c, 401, "authentication_error", "invalid_api_key", challenge,
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
            return kvr_http_reply_simple_error(h, rq, c, 413, "invalid_request_error",
                                               "body_too_large", NULL,
                                               "the request body (%llu bytes) is larger than the "
                                               "limit of %zu bytes",
                                               n, h->max_body_bytes);
        }
    }
    return MHD_YES;
}

/* Later calls with body bytes: keep them up to max_body_bytes, then drop the rest (the
 * request is answered 413 once the body has ended). */
static enum MHD_Result take_body(struct kvr_http *h, struct request *rq, const char *data, size_t n)
{
    if (!rq->too_large && rq->body.len + n > h->max_body_bytes) {
        rq->too_large = true;
        kvr_sbuf_fini(&rq->body);
    }
    if (!rq->too_large) {
        kvr_sbuf_append(&rq->body, data, n);
        if (rq->body.failed)
            return MHD_NO;
    }
    return MHD_YES;
}

/* The last call, with the whole body: run the endpoint. */
static enum MHD_Result run_endpoint(struct kvr_http *h, struct request *rq,
                                    struct MHD_Connection *c)
{
    switch (rq->ep) {
    case KVR_HTTP_ENDPOINT_COMPLETIONS:
    case KVR_HTTP_ENDPOINT_CHAT:
    case KVR_HTTP_ENDPOINT_RESPONSES:
        return handle_generate(h, rq, c);
    case KVR_HTTP_ENDPOINT_MODELS:
        return kvr_http_handle_models(h, rq, c);
    case KVR_HTTP_ENDPOINT_HEALTH:
        return kvr_http_handle_health(h, rq, c);
    case KVR_HTTP_ENDPOINT_LIVEZ:
        return kvr_http_reply_json(h, rq, c, 200, json_pack("{s:s}", "status", "ok"), NULL);
    case KVR_HTTP_ENDPOINT_METRICS:
        return kvr_http_handle_metrics(h, rq, c);
    case KVR_HTTP_ENDPOINT_TOKENIZE:
        return kvr_http_handle_tokenize(h, rq, c);
    case KVR_HTTP_ENDPOINT_DETOKENIZE:
        return kvr_http_handle_detokenize(h, rq, c);
    case KVR_HTTP_ENDPOINT_APPLY_TEMPLATE:
        return kvr_http_handle_apply_template(h, rq, c);
    case KVR_HTTP_ENDPOINT_CONSOLE:
        return kvr_http_handle_console(h, rq, c);
    case KVR_HTTP_ENDPOINT_TELEMETRY:
        return kvr_http_handle_telemetry(h, rq, c);
    case KVR_HTTP_ENDPOINT_RESET_PREFIX_CACHE: {
        long n = h->svc->ops->reset_prefix_cache ? h->svc->ops->reset_prefix_cache(h->svc->ctx) : 0;
        return kvr_http_reply_json(
            h, rq, c, 200, json_pack("{s:s, s:I}", "status", "ok", "blocks_freed", (json_int_t)n),
            NULL);
    }
    default:
        return MHD_NO;
    }
}

/* The door's record of a connection (its socket context), or NULL. */
static struct kvr_http_door_conn *door_conn(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* The headers are in: the door's header deadline is met, and libmicrohttpd's inactivity
 * timeout grows from the header deadline to what the request may need: a generation may
 * be silent until its first token, anything else gets the idle timeout. */
static void headers_arrived(struct kvr_http *h, struct MHD_Connection *c, enum kvr_http_endpoint ep)
{
    kvr_http_door_headers(h->door, door_conn(c), kvr_now_ns());
    bool gen = ep == KVR_HTTP_ENDPOINT_COMPLETIONS || ep == KVR_HTTP_ENDPOINT_CHAT ||
               ep == KVR_HTTP_ENDPOINT_RESPONSES;
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT,
                              gen ? h->generate_timeout_s : h->idle_timeout_s);
}

/* libmicrohttpd calls this once with the headers, once per piece of body, and once more
 * when the body has ended (*upload_data_size 0). */
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
        enum MHD_Result ret = on_headers(h, rq, c, url, method);
        headers_arrived(h, c, rq->ep);
        return ret;
    }
    if (rq->answered) {
        /* Answered from the headers; whatever body follows is not wanted. */
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        return take_body(h, rq, upload_data, n);
    }
    kvr_http_door_working(h->door, door_conn(c));
    if (rq->too_large)
        return kvr_http_reply_simple_error(
            h, rq, c, 413, "invalid_request_error", "body_too_large", NULL,
            "the request body is larger than the limit of %zu bytes", h->max_body_bytes);
    return run_endpoint(h, rq, c);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    struct kvr_http *h = cls;
    struct request *rq = *con_cls;
    /* Answered: the connection waits for its next request (if it is kept alive). */
    if (toe == MHD_REQUEST_TERMINATED_COMPLETED_OK) {
        kvr_http_door_idle(h->door, door_conn(c), kvr_now_ns());
        MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, h->idle_timeout_s);
    }
    if (!rq)
        return;
    kvr_sbuf_fini(&rq->body);
    kvr_free(rq->model_id);
    kvr_free(rq);
    *con_cls = NULL;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));

/* libmicrohttpd's messages go through the door, which counts its refusals (one summary line
 * per burst) and logs the rest, three per burst at most: mostly clients that went away
 * mid-response, worth a line, not an alarm, and never a line per connection of a flood. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    struct kvr_http *h = cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && msg[n - 1] == '\n')
        msg[--n] = 0;
    if (!h->door)
        KVR_INFO("http: %s", msg);
    else if (strstr(msg, "connection limit")) /* per-IP or total: the door keeps below the
                                                 total, so it is the per-client limit */
        kvr_http_door_refused(h->door, KVR_HTTP_DOOR_REFUSED_CLIENT, kvr_now_ns());
    else
        kvr_http_door_message(h->door, msg, kvr_now_ns());
}

/* Accept policy: the door decides, making room if it must. */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen)
{
    struct kvr_http *h = cls;
    (void)addr;
    (void)addrlen;
    return kvr_http_door_admit(h->door, kvr_now_ns()) ? MHD_YES : MHD_NO;
}

/* A connection opened or closed: the door's record is its socket context. */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    struct kvr_http *h = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        *socket_context = kvr_http_door_opened(h->door, kvr_http_connection_fd(c), kvr_now_ns());
    } else {
        kvr_http_door_closed(h->door, *socket_context);
        *socket_context = NULL;
    }
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

/* The service and the configuration must make sense before anything is allocated; `addr`
 * is the address to listen on. */
static int check_config(const struct kvr_http_config *cfg, const struct kvr_service *svc,
                        struct sockaddr_in *addr, struct kvr_err *err)
{
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
    if (cfg->max_body_bytes == 0 || cfg->max_connections == 0 || !cfg->header_timeout_s ||
        !cfg->body_timeout_s || !cfg->idle_timeout_s)
        return kvr_err_set(err, KVR_EINVAL,
                           "http: max_body_bytes, max_connections and the timeouts must be "
                           "positive");
    memset(addr, 0, sizeof *addr);
    addr->sin_family = AF_INET;
    addr->sin_port = htons(cfg->port);
    const char *host = cfg->host ? cfg->host : "127.0.0.1";
    if (inet_pton(AF_INET, host, &addr->sin_addr) != 1)
        return kvr_err_set(err, KVR_EINVAL, "http: '%s' is not an IPv4 address", host);
    return KVR_OK;
}

/* The longest text a token can stand for (at least 4 bytes): it bounds how much text can
 * fit the context. */
static size_t longest_piece(const struct kvr_tok *tok, int32_t n_vocab)
{
    size_t longest = 4;
    for (int32_t id = 0; id < n_vocab; id++) {
        const char *p;
        size_t len;
        if (kvr_tok_decode_piece(tok, id, true, &p, &len) == 0 && len > longest)
            longest = len;
    }
    return longest;
}

/* Each connection holds a socket: raise the soft limit on open files to what a full house
 * needs, as far as the hard limit allows; else serve fewer connections, and say so. */
static uint32_t fit_open_files(uint32_t max_connections)
{
    struct rlimit rl;
    rlim_t need = (rlim_t)max_connections + max_connections / 4 + 256;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= need)
        return max_connections;
    rlim_t want = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= need ? need : rl.rlim_max;
    if (want > rl.rlim_cur) {
        rl.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (rl.rlim_cur >= need)
        return max_connections;
    uint32_t fit = rl.rlim_cur > 512 ? (uint32_t)((rl.rlim_cur - 256) * 4 / 5) : 64;
    KVR_WARN("http: the open-file limit (%llu) allows %u connections, not %u: raise it "
             "(ulimit -n) to serve more",
             (unsigned long long)rl.rlim_cur, fit, max_connections);
    return fit;
}

/* Listen: plain HTTP, or HTTPS with the configuration's PEM files. */
static int start_daemon(struct kvr_http *h, const struct kvr_http_config *cfg,
                        const struct sockaddr_in *addr, struct kvr_err *err)
{
    int rc;
    struct MHD_OptionItem tls[3] = {{MHD_OPTION_END, 0, NULL}};
    if (cfg->tls_cert_file) {
        if ((rc = read_pem(cfg->tls_cert_file, "certificate", &h->tls_cert, err)) ||
            (rc = read_pem(cfg->tls_key_file, "key", &h->tls_key, err)))
            return rc;
        tls[0] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, h->tls_cert};
        tls[1] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, h->tls_key};
        tls[2] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    }
    /* MHD_USE_ITC: kvr_http_destroy quiesces the listener before closing connections. */
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                     MHD_USE_POLL | MHD_USE_ERROR_LOG | MHD_USE_ITC |
                     (cfg->tls_cert_file ? MHD_USE_TLS : 0);
    /* The door (http_door.h) keeps the count below max_connections; libmicrohttpd's own
     * limit leaves room for the connections the door is closing. A fresh connection's
     * inactivity timeout is a second past the header deadline, so that the door, which
     * counts it, closes a silent one (headers_arrived lengthens it). */
    uint32_t max_conn = fit_open_files(cfg->max_connections);
    struct kvr_http_door_config dc = {.max_connections = max_conn,
                                      .max_per_client = cfg->max_per_client,
                                      .header_timeout_s = cfg->header_timeout_s,
                                      .body_timeout_s = cfg->body_timeout_s,
                                      .idle_timeout_s = cfg->idle_timeout_s,
                                      .thread = true};
    if ((rc = kvr_http_door_create(&h->door, &dc)))
        return kvr_err_set(err, rc, "http: cannot start the connection guard");
    /* The logger comes first so that MHD's messages about later options reach it. */
    h->daemon = MHD_start_daemon(
        flags, cfg->port, on_accept, h, on_request, h, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h,
        MHD_OPTION_SOCK_ADDR, (const struct sockaddr *)addr, MHD_OPTION_CONNECTION_LIMIT,
        (unsigned)kvr_http_door_capacity(h->door), MHD_OPTION_PER_IP_CONNECTION_LIMIT,
        (unsigned)cfg->max_per_client, MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)cfg->header_timeout_s + 1, MHD_OPTION_THREAD_STACK_SIZE,
        (size_t)THREAD_STACK_BYTES, MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, h, MHD_OPTION_ARRAY, tls, MHD_OPTION_END);
    const char *host = cfg->host ? cfg->host : "127.0.0.1";
    if (!h->daemon)
        return kvr_err_set(err, KVR_EIO, "http: cannot listen on %s:%u%s", host, cfg->port,
                           cfg->tls_cert_file ? " (or the TLS certificate or key was refused: "
                                                "see the log line before)"
                                              : "");
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
    h->port = di ? di->port : cfg->port;
    KVR_INFO("http: listening on %s://%s:%u (model %s, context %u)%s; at most %u connections, "
             "%u per client, request headers within %u s",
             h->tls_cert ? "https" : "http", host, h->port, h->svc->model_name, h->svc->n_ctx,
             h->api_key ? ", API key required" : "", max_conn, cfg->max_per_client,
             cfg->header_timeout_s);
    return KVR_OK;
}

/* Free everything but the daemon (stopped first by kvr_http_destroy). */
static void free_server(struct kvr_http *h)
{
    kvr_http_door_destroy(h->door);
    kvr_free(h->cors_origin);
    kvr_http_metrics_fini(&h->metrics);
    free_pem(h->tls_cert);
    free_pem(h->tls_key);
    kvr_free(h->api_key);
    kvr_chat_destroy(h->chat);
    kvr_responses_store_destroy(h->responses);
    kvr_free(h->bos_text);
    kvr_free(h);
}

int kvr_http_create(struct kvr_http **out, const struct kvr_http_config *cfg,
                    const struct kvr_service *svc, struct kvr_err *err)
{
    *out = NULL;
    struct sockaddr_in addr;
    int rc = check_config(cfg, svc, &addr, err);
    if (rc)
        return rc;
    struct kvr_http *h = kvr_calloc(1, sizeof *h);
    if (!h)
        return kvr_err_set(err, KVR_ENOMEM, "http: out of memory");
    h->svc = svc;
    h->max_body_bytes = cfg->max_body_bytes;
    h->idle_timeout_s = cfg->idle_timeout_s;
    h->generate_timeout_s =
        cfg->stall_timeout_s > cfg->idle_timeout_s ? cfg->stall_timeout_s : cfg->idle_timeout_s;
    h->metrics_public = cfg->metrics_public;
    h->started_s = (int64_t)(kvr_wall_ms() / 1000);
    h->n_vocab = kvr_tok_n_vocab(svc->tok);
    atomic_init(&h->stopping, false);
    kvr_http_metrics_init(&h->metrics);

    if (cfg->api_key && cfg->api_key[0]) {
        h->api_key = kvr_strdup(cfg->api_key);
        if (!h->api_key) {
            rc = kvr_err_set(err, KVR_ENOMEM, "http: out of memory");
            goto fail;
        }
        h->api_key_len = strlen(h->api_key);
    }
    const char *origin = cfg->cors_origin;
    if (origin && origin[0] && strcmp(origin, "none") != 0) {
        if (strpbrk(origin, "\r\n")) {
            rc = kvr_err_set(err, KVR_EINVAL, "http: the CORS origin has a line break");
            goto fail;
        }
        if (!(h->cors_origin = kvr_strdup(origin))) {
            rc = kvr_err_set(err, KVR_ENOMEM, "http: out of memory");
            goto fail;
        }
    }
    if ((rc = make_chat(h, cfg, svc, err)))
        goto fail;
    if (!(h->responses = kvr_responses_store_create())) {
        rc = kvr_err_set(err, KVR_ENOMEM, "http: out of memory");
        goto fail;
    }
    h->gen = (struct kvr_generation_env){
        .svc = svc,
        .chat = h->chat,
        .bos_text = h->bos_text,
        .n_vocab = h->n_vocab,
        .max_piece_bytes = longest_piece(svc->tok, h->n_vocab),
        .stall_timeout_ms =
            cfg->stall_timeout_s > UINT32_MAX / 1000 ? UINT32_MAX : cfg->stall_timeout_s * 1000,
        .default_max_tokens = cfg->default_max_tokens,
        .metrics = &h->metrics,
    };
    if ((rc = start_daemon(h, cfg, &addr, err)))
        goto fail;
    *out = h;
    return KVR_OK;
fail:
    free_server(h);
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
        if (kvr_http_metrics_running(&h->metrics) <= 0 || kvr_now_ns() >= deadline)
            break;
        kvr_sleep_ns(10 * 1000000ull);
    }
    MHD_stop_daemon(h->daemon);
    if (listen_fd != MHD_INVALID_SOCKET)
        close(listen_fd); /* quiesce handed it to us; only safe after stop */
    free_server(h);
}
