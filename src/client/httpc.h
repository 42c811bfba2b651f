/* httpc.h - a small blocking HTTP/1.1 client over plain sockets, with Server-Sent Events.
 *
 * Made for `kvasir bench`, `kvasir top` and tests talking to a Kvasir bridge on a trusted
 * network: one request per connection (`Connection: close`), http:// only, IPv4 or IPv6.
 * Every wait (connect, send, receive) is bounded by the request's io_timeout_ms and by an
 * optional overall deadline, so no call can hang; a caller may also pass a cancel flag that
 * is checked at least every 100 ms.
 *
 * The response body is framed by Content-Length, chunked transfer coding, or the end of the
 * connection. A 2xx `text/event-stream` response with an on_event callback is parsed as SSE
 * as it arrives and each event's data handed over with the time its last byte was read;
 * any other body is collected (up to max_body_bytes).
 *
 * The two parsers (kvr_sse_*, kvr_chunked_*) are pure and exposed for tests and fuzzing.
 *
 * Ownership: a struct kvr_httpc_resp owns its body until kvr_httpc_resp_fini. Threads: no
 * shared state; any number of threads may run requests at once. */
#ifndef KVR_CLIENT_HTTPC_H
#define KVR_CLIENT_HTTPC_H

#include "core/sbuf.h"
#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- URLs ----------------------------------------------------------------------------- */

struct kvr_httpc_url {
    char host[256];      /* name or address, without IPv6 brackets */
    char port[8];        /* decimal; "80" when the URL gives none */
    char base_path[512]; /* path prefix without a trailing '/', "" for none */
};

/* Parse "http://HOST[:PORT][/PREFIX]" (also "HOST:PORT" without scheme). KVR_EINVAL for
 * anything else (https, user info, query). */
int kvr_httpc_url_parse(struct kvr_httpc_url *u, const char *url, struct kvr_err *err);

/* ---- requests ------------------------------------------------------------------------- */

/* Called once per SSE event with its data (the data lines joined by '\n', NUL-terminated
 * for convenience) and kvr_now_ns() of the read that completed it. Return nonzero to stop
 * reading (the request then ends with KVR_OK and resp->stopped set). */
typedef int (*kvr_httpc_event_fn)(void *ud, const char *data, size_t len, uint64_t t_ns);

struct kvr_httpc_req {
    const char *method;        /* "GET", "POST", "HEAD" */
    const char *path;          /* "/v1/models": appended to the URL's base path */
    const char *api_key;       /* sent as Authorization: Bearer; NULL or "" for none */
    const char *extra_headers; /* complete "Name: value\r\n" lines, or NULL */
    const char *body;          /* sent with Content-Type: application/json; NULL for none */
    size_t body_len;
    uint32_t io_timeout_ms;      /* bound on each socket wait; 0 means 30 s */
    uint64_t deadline_ns;        /* kvr_now_ns() limit for the whole exchange; 0 for none */
    size_t max_body_bytes;       /* a collected body larger than this fails; 0 means 4 MiB */
    kvr_httpc_event_fn on_event; /* SSE sink, or NULL to collect every body */
    void *ud;
    const volatile int *cancel; /* stop (KVR_ECLOSED) when *cancel becomes nonzero; or NULL */
};

struct kvr_httpc_resp {
    int status;         /* 0 until a status line arrived */
    uint64_t t_sent_ns; /* when the request was fully written */
    uint64_t t_head_ns; /* when the response head was complete */
    uint64_t t_end_ns;  /* when the body ended (or the exchange failed) */
    bool has_retry_after;
    uint32_t retry_after_s;
    char content_type[96];
    bool is_sse;  /* the body went to on_event */
    bool stopped; /* on_event asked to stop */
    char *body;   /* collected body, NUL-terminated; NULL when streamed/empty */
    size_t body_len;
};

/* Run one request. Returns 0 when a whole response arrived (whatever its status; resp
 * filled), or: KVR_EINVAL bad arguments; KVR_EIO name resolution, connect or socket error;
 * KVR_ETIMEDOUT a wait or the deadline ran out; KVR_ECLOSED the server closed before the
 * response was complete, or the cancel flag was raised; KVR_EPROTO a malformed response;
 * KVR_ERANGE a head or collected body too large; KVR_ENOMEM. After a failure resp still
 * holds what had arrived (status, times). Always call kvr_httpc_resp_fini afterwards. */
int kvr_httpc_do(const struct kvr_httpc_url *u, const struct kvr_httpc_req *req,
                 struct kvr_httpc_resp *resp, struct kvr_err *err);
void kvr_httpc_resp_fini(struct kvr_httpc_resp *resp);

/* Convenience: GET base+path and collect the body (timeout as above, no SSE). */
int kvr_httpc_get(const struct kvr_httpc_url *u, const char *path, const char *api_key,
                  uint32_t timeout_ms, struct kvr_httpc_resp *resp, struct kvr_err *err);

/* ---- Server-Sent Events parser (pure) --------------------------------------------------- */

#define KVR_SSE_MAX_EVENT_BYTES (8u << 20)

/* Incremental parser for the event-stream format: lines end in "\n", "\r\n" or "\r"; a
 * "data:" line (one optional space after the colon) appends to the event's data; other
 * fields and ":" comments are ignored; a blank line dispatches the event if it has data.
 * A field name without a colon counts as the whole line being the name. Caller-owned. */
struct kvr_sse {
    struct kvr_sbuf line; /* the current, unfinished line */
    struct kvr_sbuf data; /* data of the current event */
    bool has_data;
    bool last_cr; /* the previous chunk ended in '\r' (a '\n' next is its pair) */
};

void kvr_sse_init(struct kvr_sse *s);
void kvr_sse_fini(struct kvr_sse *s);
/* Feed bytes; on_event is called for every complete event. Returns 0, the callback's
 * nonzero value when it asked to stop (KVR_OK is never returned for that: the value is
 * passed through as a positive int), KVR_ERANGE for an event over
 * KVR_SSE_MAX_EVENT_BYTES, KVR_ENOMEM. */
int kvr_sse_feed(struct kvr_sse *s, const char *p, size_t n, kvr_httpc_event_fn on_event, void *ud,
                 uint64_t t_ns);

/* ---- chunked transfer coding decoder (pure) ---------------------------------------------- */

/* RFC 9112 section 7.1: hex size [;extensions] CRLF, data CRLF, ..., "0" CRLF, trailer
 * lines, CRLF. Tolerates a bare LF for CRLF. Caller-owned, no allocation. */
struct kvr_chunked {
    int state;
    uint64_t remaining; /* data bytes left in the current chunk */
    uint32_t n_digits;
    uint32_t line_bytes; /* bytes of the current size/trailer line (bounded) */
    bool done;
};

void kvr_chunked_init(struct kvr_chunked *c);
/* Decode in[0..n): data bytes are handed to `sink` as they are found (a sink returning
 * nonzero stops decoding and that value is returned). On success returns 0 and sets
 * *consumed (== n unless the body ended: then the bytes after it are not consumed).
 * KVR_EPROTO for a malformed chunk stream. */
int kvr_chunked_feed(struct kvr_chunked *c, const char *in, size_t n, size_t *consumed,
                     int (*sink)(void *ud, const char *p, size_t n), void *ud);

#endif
