/* http_endpoints.c - the HTTP endpoints other than generation (see http.h): the model list,
 * health and metrics, the tokenizer's (llama-server's shapes), and the console with its
 * telemetry stream. http.c routes to them and owns the replies they use. */
#define _GNU_SOURCE /* POLLRDHUP */
#include "bridge/http_int.h"

#include "bridge/chat.h"
#include "bridge/console.h"
#include "bridge/telemetry.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"
#include "core/utf8.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- other endpoints ---------------------------------------------------------------- */

enum MHD_Result kvr_http_handle_models(struct kvr_http *h, struct request *rq,
                                       struct MHD_Connection *c)
{
    if (rq->model_id) {
        if (strcmp(rq->model_id, h->svc->model_name) != 0)
            return kvr_http_reply_simple_error(h, rq, c, 404, "invalid_request_error",
                                               "model_not_found", NULL,
                                               "the model '%.200s' does not exist; this server "
                                               "serves '%.200s'",
                                               rq->model_id, h->svc->model_name);
        json_t *m = json_pack("{s:s,s:s,s:I,s:s,s:I}", "id", h->svc->model_name, "object", "model",
                              "created", (json_int_t)h->started_s, "owned_by", "kvasir",
                              "max_model_len", (json_int_t)h->svc->n_ctx);
        return kvr_http_reply_json(h, rq, c, 200, m, NULL);
    }
    json_t *j =
        json_pack("{s:s,s:[{s:s,s:s,s:I,s:s,s:I}]}", "object", "list", "data", "id",
                  h->svc->model_name, "object", "model", "created", (json_int_t)h->started_s,
                  "owned_by", "kvasir", "max_model_len", (json_int_t)h->svc->n_ctx);
    return kvr_http_reply_json(h, rq, c, 200, j, NULL);
}

enum MHD_Result kvr_http_handle_health(struct kvr_http *h, struct request *rq,
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
    return kvr_http_reply_json(h, rq, c, up ? 200 : 503, j, NULL);
}

enum MHD_Result kvr_http_handle_metrics(struct kvr_http *h, struct request *rq,
                                        struct MHD_Connection *c)
{
    struct kvr_sbuf b, labelled;
    kvr_sbuf_init(&b);
    kvr_sbuf_init(&labelled);
    kvr_http_metrics_print(&h->metrics, &b);
    kvr_http_door_print(h->door, &b);
    if (h->svc->ops->metrics)
        h->svc->ops->metrics(h->svc->ctx, &b);
    if (!b.failed)
        kvr_http_metrics_label_model(b.data, b.len, h->svc->model_name, &labelled);
    kvr_sbuf_fini(&b);
    size_t len = 0;
    char *body = kvr_sbuf_take(&labelled, &len);
    if (!body)
        return MHD_NO;
    return kvr_http_reply(h, rq, c, 200, "text/plain; version=0.0.4; charset=utf-8", body, len,
                          NULL);
}

/* ---- tokenizer endpoints (llama-server's shapes) -------------------------------------- */

/* POST /tokenize {"content", "add_special", "with_pieces"} -> {"tokens": [id, ...]} or, with
 * pieces, {"tokens": [{"id", "piece"}, ...]} where a piece that is not valid UTF-8 on its
 * own (part of a character) is given as its bytes. Control tokens written in the content
 * are parsed, as in chat prompts. */
enum MHD_Result kvr_http_handle_tokenize(struct kvr_http *h, struct request *rq,
                                         struct MHD_Connection *c)
{
    struct kvr_openai_tokenize_req r;
    struct kvr_openai_error e;
    if (kvr_openai_parse_tokenize(&r, rq->body.data, rq->body.len, &e))
        return kvr_http_reply_error(h, rq, c, &e, NULL);
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
        res = kvr_http_reply_error(h, rq, c, &e, NULL);
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
            if (kvr_utf8_valid_len(p, len) == len) {
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
    res = kvr_http_reply_json(h, rq, c, 200, json_pack("{s:O}", "tokens", list), NULL);
out:
    json_decref(list);
    kvr_tok_scratch_destroy(scratch);
    kvr_free(ids);
    kvr_openai_tokenize_req_fini(&r);
    return res;
}

/* POST /detokenize {"tokens": [id, ...]} -> {"content": text}: control tokens print as
 * their text, bytes that are not valid UTF-8 as U+FFFD. */
enum MHD_Result kvr_http_handle_detokenize(struct kvr_http *h, struct request *rq,
                                           struct MHD_Connection *c)
{
    int32_t *ids;
    uint32_t n;
    struct kvr_openai_error e;
    if (kvr_openai_parse_detokenize(rq->body.data, rq->body.len, h->n_vocab, &ids, &n, &e))
        return kvr_http_reply_error(h, rq, c, &e, NULL);
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
    kvr_utf8_sanitize_to(&clean, text.data ? text.data : "", text.len);
    if (text.failed || clean.failed)
        goto out;
    res = kvr_http_reply_json(
        h, rq, c, 200, json_pack("{s:s%}", "content", clean.data ? clean.data : "", clean.len),
        NULL);
out:
    kvr_sbuf_fini(&text);
    kvr_sbuf_fini(&clean);
    kvr_free(piece);
    kvr_free(ids);
    return res;
}

/* POST /apply-template {"messages": [...]} -> {"prompt": text}: the chat prompt exactly as
 * /v1/chat/completions renders it (with the assistant's turn opened), before tokenizing. */
enum MHD_Result kvr_http_handle_apply_template(struct kvr_http *h, struct request *rq,
                                               struct MHD_Connection *c)
{
    struct kvr_openai_req r;
    struct kvr_openai_error e;
    const struct kvr_openai_limits lim = {.n_ctx = h->svc->n_ctx, .n_vocab = (uint32_t)h->n_vocab};
    if (kvr_openai_parse(&r, KVR_OPENAI_CHAT, rq->body.data, rq->body.len, &lim, &e)) {
        kvr_openai_req_fini(&r);
        return kvr_http_reply_error(h, rq, c, &e, NULL);
    }
    char *prompt = NULL;
    size_t len = 0;
    enum MHD_Result res;
    if (kvr_generation_render_chat(&h->gen, &r, &prompt, &len, &e))
        res = kvr_http_reply_error(h, rq, c, &e, NULL);
    else
        res = kvr_http_reply_json(h, rq, c, 200, json_pack("{s:s%}", "prompt", prompt, len), NULL);
    kvr_free(prompt);
    kvr_openai_req_fini(&r);
    return res;
}

/* ---- the console and its telemetry (docs/API.md) ------------------------------------ */

/* GET / and the page's assets, embedded in the binary (console.h). Open: the page holds
 * no secret, and asks for the key itself when the API answers 401. */
enum MHD_Result kvr_http_handle_console(struct kvr_http *h, struct request *rq,
                                        struct MHD_Connection *c)
{
    const void *data;
    size_t len;
    const char *type;
    if (kvr_console_asset(rq->url, &data, &len, &type) != 0)
        return MHD_NO; /* routed here only when it exists */
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, (void *)data, MHD_RESPMEM_PERSISTENT);
    if (!resp)
        return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    MHD_add_response_header(resp, "Content-Security-Policy", kvr_console_csp);
    MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(resp, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    if (ret == MHD_YES)
        kvr_http_metrics_response(&h->metrics, rq->ep, 200);
    return ret;
}

/* One /v1/telemetry connection: a snapshot every interval_ms, written as SSE by
 * libmicrohttpd's content reader on the connection's thread. */
struct tel_stream {
    struct kvr_http *h;
    int fd; /* the client's socket */
    uint32_t interval_ms;
    uint64_t next_ns; /* when the next snapshot is due */
    struct kvr_telemetry_reader reader;
    struct kvr_telemetry_snapshot *snap; /* ~330 KiB, one per connection */
    struct kvr_sbuf out;                 /* SSE bytes not yet sent: out.data[pos ..] */
    size_t pos;
    uint64_t cpu_ns; /* the connection thread's CPU time when last counted */
};

/* The stream's cost in kvasir:telemetry_cpu_seconds_total: the connection's own thread's CPU
 * time (thread per connection), counted at each call, so the sending libmicrohttpd does
 * between calls counts too (and a snapshot built in one call is counted at the next: one
 * clock read per snapshot, which is a system call). */
static void count_cpu(struct tel_stream *t)
{
    uint64_t now = kvr_thread_cpu_ns();
    if (now > t->cpu_ns)
        kvr_http_metrics_telemetry_cpu(&t->h->metrics, now - t->cpu_ns);
    t->cpu_ns = now;
}

/* A stream sleeps between snapshots in slices this long: the poll wakes at once when the
 * client goes away, so the slice bounds only how long a server shutdown waits for it, and
 * a slice as long as the default interval means one wake-up per snapshot (each costs the
 * bridge a context switch). */
#define TELEMETRY_SLICE_MS KVR_TELEMETRY_DEFAULT_INTERVAL_MS

/* Wait up to timeout_ms for the client to go away: true if it did. */
static bool peer_gone_within(int fd, int timeout_ms)
{
    if (fd < 0) {
        kvr_sleep_ns((uint64_t)timeout_ms * 1000000ull);
        return false;
    }
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    if (poll(&p, 1, timeout_ms) <= 0)
        return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

static ssize_t telemetry_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct tel_stream *t = cls;
    count_cpu(t);
    for (;;) {
        if (t->pos < t->out.len) {
            size_t n = t->out.len - t->pos < max ? t->out.len - t->pos : max;
            memcpy(buf, t->out.data + t->pos, n);
            t->pos += n;
            if (t->pos == t->out.len) {
                kvr_sbuf_clear(&t->out);
                t->pos = 0;
            }
            return (ssize_t)n;
        }
        if (atomic_load(&t->h->stopping))
            return MHD_CONTENT_READER_END_OF_STREAM;
        uint64_t now = kvr_now_ns();
        if (now < t->next_ns) {
            /* Sleep until the snapshot is due, a slice at a time, noticing a client that
             * goes away as it happens. */
            uint64_t wait_ms = (t->next_ns - now + 999999) / 1000000;
            if (peer_gone_within(t->fd,
                                 wait_ms < TELEMETRY_SLICE_MS ? (int)wait_ms : TELEMETRY_SLICE_MS))
                return MHD_CONTENT_READER_END_WITH_ERROR;
            continue;
        }
        /* Fixed steps (or a fresh start after a slow client), so a stream never sends more
         * than 1000 / interval_ms snapshots a second. */
        uint64_t step = t->interval_ms * 1000000ull;
        t->next_ns = t->next_ns + step > now ? t->next_ns + step : now + step;
        t->h->svc->ops->telemetry(t->h->svc->ctx, &t->reader, t->snap);
        t->snap->interval_ms = t->interval_ms;
        if (kvr_telemetry_sse(t->snap, &t->out))
            return MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

static void telemetry_free(void *cls)
{
    struct tel_stream *t = cls;
    atomic_fetch_sub(&t->h->n_telemetry, 1);
    kvr_sbuf_fini(&t->out);
    kvr_free(t->snap);
    kvr_free(t);
}

/* GET /v1/telemetry[?interval_ms=N]: at most MAX_TELEMETRY_STREAMS at once. */
enum MHD_Result kvr_http_handle_telemetry(struct kvr_http *h, struct request *rq,
                                          struct MHD_Connection *c)
{
    if (!h->svc->ops->telemetry)
        return kvr_http_reply_simple_error(h, rq, c, 404, "invalid_request_error", "not_found",
                                           NULL, "this server keeps no telemetry");
    if (atomic_fetch_add(&h->n_telemetry, 1) >= MAX_TELEMETRY_STREAMS) {
        atomic_fetch_sub(&h->n_telemetry, 1);
        static const char *const retry[] = {MHD_HTTP_HEADER_RETRY_AFTER, "5", NULL};
        return kvr_http_reply_simple_error(h, rq, c, 503, "server_error", "too_many_streams", retry,
                                           "%d telemetry streams are open already",
                                           MAX_TELEMETRY_STREAMS);
    }
    struct tel_stream *t = kvr_calloc(1, sizeof *t);
    if (t)
        t->snap = kvr_malloc(sizeof *t->snap);
    if (!t || !t->snap) {
        kvr_free(t);
        atomic_fetch_sub(&h->n_telemetry, 1);
        return MHD_NO;
    }
    t->h = h;
    t->fd = kvr_http_connection_fd(c);
    t->interval_ms = kvr_telemetry_interval_ms(
        MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "interval_ms"));
    t->next_ns = kvr_now_ns(); /* the first snapshot at once */
    t->cpu_ns = kvr_thread_cpu_ns();
    kvr_sbuf_init(&t->out);
    kvr_sbuf_puts(&t->out, "retry: 2000\n\n");
    struct MHD_Response *resp = MHD_create_response_from_callback(
        MHD_SIZE_UNKNOWN, 64 * 1024, telemetry_read, t, telemetry_free);
    if (!resp) {
        telemetry_free(t);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    if (ret == MHD_YES)
        kvr_http_metrics_response(&h->metrics, rq->ep, 200);
    return ret;
}
