/* httpc.c - blocking HTTP/1.1 client with SSE (see httpc.h). */
#include "client/httpc.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/sock.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#define HEAD_MAX_BYTES (64u << 10)
#define DEFAULT_IO_TIMEOUT_MS 30000u
#define DEFAULT_MAX_BODY (4u << 20)
#define CANCEL_SLICE_MS 100

/* ---- URLs ----------------------------------------------------------------------------- */

int kvr_httpc_url_parse(struct kvr_httpc_url *u, const char *url, struct kvr_err *err)
{
    memset(u, 0, sizeof *u);
    const char *p = url;
    if (!strncasecmp(p, "http://", 7))
        p += 7;
    else if (strstr(p, "://"))
        return kvr_err_set(err, KVR_EINVAL, "%s: only http:// URLs are supported", url);
    const char *path = strchr(p, '/');
    const char *end = path ? path : p + strlen(p);
    if (memchr(p, '@', (size_t)(end - p)) || strpbrk(p, "?#"))
        return kvr_err_set(err, KVR_EINVAL,
                           "%s: user info, queries and fragments are not "
                           "supported",
                           url);
    const char *host = p, *host_end, *port = NULL;
    if (*p == '[') { /* [v6]:port */
        host = p + 1;
        host_end = memchr(host, ']', (size_t)(end - host));
        if (!host_end)
            return kvr_err_set(err, KVR_EINVAL, "%s: unclosed '[' in the host", url);
        if (host_end + 1 < end) {
            if (host_end[1] != ':')
                return kvr_err_set(err, KVR_EINVAL, "%s: junk after ']'", url);
            port = host_end + 2;
        }
    } else {
        host_end = memchr(p, ':', (size_t)(end - p));
        if (host_end)
            port = host_end + 1;
        else
            host_end = end;
    }
    size_t host_len = (size_t)(host_end - host);
    if (host_len == 0 || host_len >= sizeof u->host)
        return kvr_err_set(err, KVR_EINVAL, "%s: missing or too long host", url);
    memcpy(u->host, host, host_len);
    if (port) {
        size_t port_len = (size_t)(end - port);
        unsigned long v = 0;
        if (port_len == 0 || port_len > 5)
            return kvr_err_set(err, KVR_EINVAL, "%s: bad port", url);
        for (size_t i = 0; i < port_len; i++) {
            if (port[i] < '0' || port[i] > '9')
                return kvr_err_set(err, KVR_EINVAL, "%s: bad port", url);
            v = v * 10 + (unsigned long)(port[i] - '0');
        }
        if (v == 0 || v > 65535)
            return kvr_err_set(err, KVR_EINVAL, "%s: port out of range", url);
        snprintf(u->port, sizeof u->port, "%lu", v);
    } else {
        snprintf(u->port, sizeof u->port, "80");
    }
    if (path) {
        size_t len = strlen(path);
        while (len > 0 && path[len - 1] == '/')
            len--;
        if (len >= sizeof u->base_path)
            return kvr_err_set(err, KVR_EINVAL, "%s: path too long", url);
        memcpy(u->base_path, path, len);
    }
    return 0;
}

/* ---- chunked transfer coding ------------------------------------------------------------- */

enum chunk_state {
    CH_SIZE,         /* hex digits of a chunk size */
    CH_EXT,          /* chunk extensions, up to the end of the line */
    CH_SIZE_LF,      /* after the size line's CR */
    CH_DATA,         /* chunk data */
    CH_DATA_END,     /* the CRLF after chunk data */
    CH_DATA_LF,      /* after that CR */
    CH_TRAILER_BOL,  /* start of a trailer line, or the final empty line */
    CH_TRAILER_LINE, /* inside a trailer field line */
    CH_FINAL_LF,     /* after the final line's CR */
    CH_DONE,
};

#define CHUNK_LINE_MAX 4096u

void kvr_chunked_init(struct kvr_chunked *c)
{
    memset(c, 0, sizeof *c);
    c->state = CH_SIZE;
}

static int hexval(char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

static void chunk_after_size(struct kvr_chunked *c)
{
    c->state = c->remaining ? CH_DATA : CH_TRAILER_BOL;
    c->line_bytes = 0;
}

/* One byte of a size line: the hex size, its extensions, its line end. */
static int size_byte(struct kvr_chunked *c, char ch)
{
    switch (c->state) {
    case CH_SIZE: {
        int h = hexval(ch);
        if (h >= 0) {
            /* 15 hex digits is already 1 EiB: more is nonsense or an attack. */
            if (c->n_digits >= 15)
                return KVR_EPROTO;
            c->remaining = c->remaining * 16 + (uint64_t)h;
            c->n_digits++;
        } else if (c->n_digits == 0) {
            return KVR_EPROTO;
        } else if (ch == ';' || ch == ' ' || ch == '\t') {
            c->state = CH_EXT;
        } else if (ch == '\r') {
            c->state = CH_SIZE_LF;
        } else if (ch == '\n') {
            chunk_after_size(c);
        } else {
            return KVR_EPROTO;
        }
        return 0;
    }
    case CH_EXT:
        if (ch == '\r')
            c->state = CH_SIZE_LF;
        else if (ch == '\n')
            chunk_after_size(c);
        else if (++c->line_bytes > CHUNK_LINE_MAX)
            return KVR_EPROTO;
        return 0;
    default: /* CH_SIZE_LF */
        if (ch != '\n')
            return KVR_EPROTO;
        chunk_after_size(c);
        return 0;
    }
}

/* One byte after the data: the chunk's line end, or the trailer and the final line. */
static int after_data_byte(struct kvr_chunked *c, char ch)
{
    switch (c->state) {
    case CH_DATA_END:
    case CH_DATA_LF:
        if (ch == '\r' && c->state == CH_DATA_END) {
            c->state = CH_DATA_LF;
        } else if (ch == '\n') {
            c->state = CH_SIZE;
            c->n_digits = 0;
            c->line_bytes = 0;
        } else {
            return KVR_EPROTO;
        }
        return 0;
    case CH_TRAILER_BOL:
        if (ch == '\r')
            c->state = CH_FINAL_LF;
        else if (ch == '\n')
            c->state = CH_DONE;
        else
            c->state = CH_TRAILER_LINE;
        return 0;
    case CH_TRAILER_LINE:
        if (ch == '\n')
            c->state = CH_TRAILER_BOL;
        else if (++c->line_bytes > CHUNK_LINE_MAX)
            return KVR_EPROTO;
        return 0;
    case CH_FINAL_LF:
        if (ch != '\n')
            return KVR_EPROTO;
        c->state = CH_DONE;
        return 0;
    default:
        return KVR_EPROTO;
    }
}

int kvr_chunked_feed(struct kvr_chunked *c, const char *in, size_t n, size_t *consumed,
                     int (*sink)(void *ud, const char *p, size_t n), void *ud)
{
    size_t i = 0;
    while (i < n && c->state != CH_DONE) {
        if (c->state == CH_DATA) {
            size_t take = n - i;
            if (take > c->remaining)
                take = (size_t)c->remaining;
            if (sink) {
                int rc = sink(ud, in + i, take);
                if (rc) {
                    *consumed = i + take;
                    return rc;
                }
            }
            i += take;
            c->remaining -= take;
            if (c->remaining == 0)
                c->state = CH_DATA_END;
            continue;
        }
        bool in_size = c->state == CH_SIZE || c->state == CH_EXT || c->state == CH_SIZE_LF;
        int rc = in_size ? size_byte(c, in[i]) : after_data_byte(c, in[i]);
        if (rc)
            return rc;
        i++;
    }
    c->done = c->state == CH_DONE;
    *consumed = i;
    return 0;
}

/* ---- Server-Sent Events -------------------------------------------------------------------- */

void kvr_sse_init(struct kvr_sse *s)
{
    memset(s, 0, sizeof *s);
    kvr_sbuf_init(&s->line);
    kvr_sbuf_init(&s->data);
}

void kvr_sse_fini(struct kvr_sse *s)
{
    kvr_sbuf_fini(&s->line);
    kvr_sbuf_fini(&s->data);
}

/* One complete line (without its terminator). */
static int sse_line(struct kvr_sse *s, const char *line, size_t len, kvr_httpc_event_fn on_event,
                    void *ud, uint64_t t_ns)
{
    if (len == 0) {
        if (!s->has_data)
            return 0;
        s->has_data = false;
        if (s->data.failed)
            return KVR_ENOMEM;
        const char *d = s->data.data ? s->data.data : "";
        size_t dlen = s->data.len;
        int rc = on_event ? on_event(ud, d, dlen, t_ns) : 0;
        kvr_sbuf_clear(&s->data);
        return rc;
    }
    if (line[0] == ':')
        return 0; /* comment, e.g. a keep-alive ": ping" */
    const char *colon = memchr(line, ':', len);
    size_t name_len = colon ? (size_t)(colon - line) : len;
    if (name_len != 4 || memcmp(line, "data", 4))
        return 0; /* event, id, retry and unknown fields do not matter here */
    const char *v = colon ? colon + 1 : line + len;
    size_t vlen = (size_t)(line + len - v);
    if (vlen && *v == ' ')
        v++, vlen--;
    if (s->data.len + vlen + 1 > KVR_SSE_MAX_EVENT_BYTES)
        return KVR_ERANGE;
    if (s->has_data)
        kvr_sbuf_append(&s->data, "\n", 1);
    kvr_sbuf_append(&s->data, v, vlen);
    if (!s->data.data) /* an empty first data line: make sure there is a buffer */
        kvr_sbuf_append(&s->data, "", 0);
    s->has_data = true;
    return s->data.failed ? KVR_ENOMEM : 0;
}

int kvr_sse_feed(struct kvr_sse *s, const char *p, size_t n, kvr_httpc_event_fn on_event, void *ud,
                 uint64_t t_ns)
{
    size_t i = 0;
    if (n && s->last_cr && p[0] == '\n')
        i = 1; /* the LF of a CRLF split across two reads */
    s->last_cr = false;
    while (i < n) {
        size_t j = i;
        while (j < n && p[j] != '\n' && p[j] != '\r')
            j++;
        if (j == n) { /* an unfinished line: keep it for the next read */
            if (s->line.len + (n - i) > KVR_SSE_MAX_EVENT_BYTES)
                return KVR_ERANGE;
            kvr_sbuf_append(&s->line, p + i, n - i);
            return s->line.failed ? KVR_ENOMEM : 0;
        }
        int rc;
        if (j - i > KVR_SSE_MAX_EVENT_BYTES)
            return KVR_ERANGE; /* the same limit whether or not the line came in pieces */
        if (s->line.len) {
            if (s->line.len + (j - i) > KVR_SSE_MAX_EVENT_BYTES)
                return KVR_ERANGE;
            kvr_sbuf_append(&s->line, p + i, j - i);
            if (s->line.failed)
                return KVR_ENOMEM;
            rc = sse_line(s, s->line.data, s->line.len, on_event, ud, t_ns);
            kvr_sbuf_clear(&s->line);
        } else {
            rc = sse_line(s, p + i, j - i, on_event, ud, t_ns);
        }
        if (rc)
            return rc;
        if (p[j] == '\r') {
            if (j + 1 < n && p[j + 1] == '\n')
                j++;
            else if (j + 1 == n)
                s->last_cr = true;
        }
        i = j + 1;
    }
    return 0;
}

/* ---- sockets ------------------------------------------------------------------------------- */

struct conn {
    int fd;
    const struct kvr_httpc_req *req;
    uint32_t io_timeout_ms;
};

/* Wait for `events` on the socket: 0 when ready, KVR_ETIMEDOUT, KVR_ECLOSED (cancelled). */
static int wait_fd(const struct conn *c, short events, struct kvr_err *err)
{
    uint64_t start = kvr_now_ns(), io_end = start + (uint64_t)c->io_timeout_ms * 1000000ull;
    for (;;) {
        if (c->req->cancel && *c->req->cancel)
            return kvr_err_set(err, KVR_ECLOSED, "cancelled");
        uint64_t now = kvr_now_ns(), end = io_end;
        if (c->req->deadline_ns && c->req->deadline_ns < end)
            end = c->req->deadline_ns;
        if (now >= end)
            return kvr_err_set(err, KVR_ETIMEDOUT, "%s",
                               end == io_end ? "no progress within the socket timeout"
                                             : "the request's deadline passed");
        uint64_t left_ms = (end - now + 999999) / 1000000;
        int slice = left_ms > CANCEL_SLICE_MS ? CANCEL_SLICE_MS : (int)left_ms;
        struct pollfd pfd = {.fd = c->fd, .events = events};
        int r = poll(&pfd, 1, slice);
        if (r > 0)
            return 0;
        if (r < 0 && errno != EINTR)
            return kvr_err_set(err, KVR_EIO, "poll: %s", strerror(errno));
    }
}

static int connect_any(struct conn *c, const struct kvr_httpc_url *u, struct kvr_err *err)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(u->host, u->port, &hints, &res);
    if (gai)
        return kvr_err_set(err, KVR_EIO, "%s: %s", u->host, gai_strerror(gai));
    int rc = kvr_err_set(err, KVR_EIO, "%s:%s: no address", u->host, u->port);
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        int fd;
        if ((rc = kvr_sock_open(ai, &fd, err)) != 0)
            continue;
        c->fd = fd;
        struct kvr_err e = {0};
        int wait_rc = 0;
        rc = kvr_sock_connect_begin(fd, ai, &e);
        if (rc == KVR_EAGAIN && (wait_rc = rc = wait_fd(c, POLLOUT, err)) == 0)
            rc = kvr_sock_connect_result(fd, &e);
        if (rc && !wait_rc) /* the connect failed (not the wait): try the next address */
            rc = kvr_err_set(err, KVR_EIO, "connect %s:%s: %s", u->host, u->port, e.msg);
        if (rc == 0) {
            kvr_sock_set_nodelay(fd, NULL); /* small requests, streamed tokens */
            break;
        }
        close(fd);
        c->fd = -1;
        if (rc == KVR_ETIMEDOUT || rc == KVR_ECLOSED)
            break;
    }
    freeaddrinfo(res);
    return rc;
}

static int send_all(struct conn *c, const char *p, size_t n, struct kvr_err *err)
{
    while (n > 0) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int rc = wait_fd(c, POLLOUT, err);
            if (rc)
                return rc;
            continue;
        }
        return kvr_err_set(err, errno == EPIPE || errno == ECONNRESET ? KVR_ECLOSED : KVR_EIO,
                           "send: %s", strerror(errno));
    }
    return 0;
}

/* Read what is available (waiting if nothing is): bytes read, 0 at EOF, or a status. */
static long recv_some(struct conn *c, char *buf, size_t cap, struct kvr_err *err)
{
    for (;;) {
        ssize_t r = recv(c->fd, buf, cap, 0);
        if (r >= 0)
            return (long)r;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = wait_fd(c, POLLIN, err);
            if (rc)
                return rc;
            continue;
        }
        return kvr_err_set(err, errno == ECONNRESET ? KVR_ECLOSED : KVR_EIO, "recv: %s",
                           strerror(errno));
    }
}

/* ---- response head ------------------------------------------------------------------------- */

struct head {
    bool chunked;
    bool has_length;
    uint64_t length;
};

static bool header_is(const char *name, size_t name_len, const char *want)
{
    return strlen(want) == name_len && !strncasecmp(name, want, name_len);
}

static void trim(const char **v, size_t *len)
{
    while (*len && (**v == ' ' || **v == '\t'))
        (*v)++, (*len)--;
    while (*len && ((*v)[*len - 1] == ' ' || (*v)[*len - 1] == '\t'))
        (*len)--;
}

/* Parse the head (status line and header lines, CRLF or LF endings; `len` excludes the
 * blank line). */
static int parse_head(const char *p, size_t len, struct kvr_httpc_resp *resp, struct head *h,
                      struct kvr_err *err)
{
    const char *end = p + len;
    const char *eol = memchr(p, '\n', len);
    if (!eol)
        eol = end;
    if (len < 12 || strncmp(p, "HTTP/1.", 7) || p[8] != ' ')
        return kvr_err_set(err, KVR_EPROTO, "not an HTTP/1.x status line");
    int status = 0;
    for (int i = 9; i < 12; i++) {
        if (p[i] < '0' || p[i] > '9')
            return kvr_err_set(err, KVR_EPROTO, "bad status code");
        status = status * 10 + (p[i] - '0');
    }
    if (status < 100)
        return kvr_err_set(err, KVR_EPROTO, "bad status code %d", status);
    resp->status = status;
    for (const char *line = eol < end ? eol + 1 : end; line < end;) {
        const char *nl = memchr(line, '\n', (size_t)(end - line));
        const char *le = nl ? nl : end;
        size_t ll = (size_t)(le - line);
        if (ll && line[ll - 1] == '\r')
            ll--;
        const char *colon = memchr(line, ':', ll);
        if (!colon)
            return kvr_err_set(err, KVR_EPROTO, "header line without ':'");
        size_t nlen = (size_t)(colon - line);
        const char *v = colon + 1;
        size_t vlen = ll - nlen - 1;
        trim(&v, &vlen);
        if (header_is(line, nlen, "content-length")) {
            uint64_t x = 0;
            if (vlen == 0 || vlen > 18)
                return kvr_err_set(err, KVR_EPROTO, "bad Content-Length");
            for (size_t i = 0; i < vlen; i++) {
                if (v[i] < '0' || v[i] > '9')
                    return kvr_err_set(err, KVR_EPROTO, "bad Content-Length");
                x = x * 10 + (uint64_t)(v[i] - '0');
            }
            if (h->has_length && h->length != x)
                return kvr_err_set(err, KVR_EPROTO, "conflicting Content-Length headers");
            h->has_length = true;
            h->length = x;
        } else if (header_is(line, nlen, "transfer-encoding")) {
            /* chunked must be the last coding; anything else we cannot decode. */
            size_t k = vlen;
            while (k && v[k - 1] != ',' && v[k - 1] != ' ')
                k--;
            if (vlen - k != 7 || strncasecmp(v + k, "chunked", 7))
                return kvr_err_set(err, KVR_EPROTO, "unsupported Transfer-Encoding");
            h->chunked = true;
        } else if (header_is(line, nlen, "content-type")) {
            size_t k = vlen < sizeof resp->content_type - 1 ? vlen : sizeof resp->content_type - 1;
            memcpy(resp->content_type, v, k);
            resp->content_type[k] = 0;
        } else if (header_is(line, nlen, "retry-after")) {
            uint32_t x = 0;
            size_t i = 0;
            for (; i < vlen && i < 9 && v[i] >= '0' && v[i] <= '9'; i++)
                x = x * 10 + (uint32_t)(v[i] - '0');
            if (i == vlen && vlen > 0) { /* the HTTP-date form is ignored */
                resp->has_retry_after = true;
                resp->retry_after_s = x;
            }
        }
        line = nl ? nl + 1 : end;
    }
    return 0;
}

/* Find the blank line ending the head: the offset of the body, or 0 if not there yet. */
static size_t head_end(const char *p, size_t len, size_t *head_len)
{
    for (size_t i = 0; i + 1 < len; i++) {
        if (p[i] != '\n')
            continue;
        if (p[i + 1] == '\n') {
            *head_len = i;
            return i + 2;
        }
        if (p[i + 1] == '\r' && i + 2 < len && p[i + 2] == '\n') {
            *head_len = i;
            return i + 3;
        }
    }
    return 0;
}

/* ---- body sinks ---------------------------------------------------------------------------- */

struct body_ctx {
    struct kvr_httpc_resp *resp;
    const struct kvr_httpc_req *req;
    struct kvr_sse sse;
    struct kvr_sbuf buf;
    size_t max_body;
    uint64_t t_ns; /* time of the read being decoded */
    int sink_rc;   /* why the sink stopped */
};

/* The caller's on_event may return any nonzero value to stop; make it 1 so that it cannot
 * be mistaken for one of the parser's negative statuses. */
static int event_trampoline(void *ud, const char *data, size_t len, uint64_t t_ns)
{
    const struct body_ctx *b = ud;
    return b->req->on_event(b->req->ud, data, len, t_ns) ? 1 : 0;
}

static int body_sink(void *ud, const char *p, size_t n)
{
    struct body_ctx *b = ud;
    int rc;
    if (b->resp->is_sse) {
        rc = kvr_sse_feed(&b->sse, p, n, event_trampoline, b, b->t_ns);
        if (rc > 0)
            b->resp->stopped = true;
    } else if (b->buf.len + n > b->max_body) {
        rc = KVR_ERANGE;
    } else {
        kvr_sbuf_append(&b->buf, p, n);
        rc = b->buf.failed ? KVR_ENOMEM : 0;
    }
    b->sink_rc = rc;
    return rc;
}

/* ---- the exchange -------------------------------------------------------------------------- */

static int build_request(struct kvr_sbuf *out, const struct kvr_httpc_url *u,
                         const struct kvr_httpc_req *req)
{
    bool v6 = strchr(u->host, ':') != NULL;
    kvr_sbuf_printf(out, "%s %s%s HTTP/1.1\r\nHost: %s%s%s:%s\r\n", req->method, u->base_path,
                    req->path, v6 ? "[" : "", u->host, v6 ? "]" : "", u->port);
    kvr_sbuf_puts(out, "User-Agent: kvasir-httpc\r\nAccept: */*\r\nConnection: close\r\n");
    if (req->api_key && req->api_key[0])
        kvr_sbuf_printf(out, "Authorization: Bearer %s\r\n", req->api_key);
    if (req->extra_headers)
        kvr_sbuf_puts(out, req->extra_headers);
    if (req->body)
        kvr_sbuf_printf(out, "Content-Type: application/json\r\nContent-Length: %zu\r\n",
                        req->body_len);
    kvr_sbuf_puts(out, "\r\n");
    return out->failed ? KVR_ENOMEM : 0;
}

static bool has_header_injection(const char *s)
{
    return s && strpbrk(s, "\r\n") != NULL;
}

/* Read until the blank line that ends the response head. head gets every byte read so
 * far (the body's first bytes too); *body_off is where the body starts, *head_len the head's
 * length without the blank line. */
static int read_head(struct conn *c, struct kvr_sbuf *head, char *buf, size_t cap,
                     struct body_ctx *b, size_t *body_off, size_t *head_len, struct kvr_err *err)
{
    for (;;) {
        long r = recv_some(c, buf, cap, err);
        if (r < 0)
            return (int)r;
        if (r == 0)
            return kvr_err_set(err, KVR_ECLOSED, "the server closed the connection %s",
                               head->len ? "inside the response head" : "without answering");
        b->t_ns = kvr_now_ns();
        size_t scan_from = head->len > 3 ? head->len - 3 : 0;
        kvr_sbuf_append(head, buf, (size_t)r);
        if (head->failed)
            return kvr_err_set(err, KVR_ENOMEM, "out of memory");
        size_t hl = 0;
        size_t off = head_end(head->data + scan_from, head->len - scan_from, &hl);
        if (off) {
            *body_off = off + scan_from;
            *head_len = hl + scan_from;
            return 0;
        }
        if (head->len > HEAD_MAX_BYTES)
            return kvr_err_set(err, KVR_ERANGE, "response head over %u bytes", HEAD_MAX_BYTES);
    }
}

/* Decode body bytes p[0..n) (chunked or by length) into the sink. Sets *done when the body
 * is complete. Returns 0, 1 when on_event asked to stop, or a negative status. */
static int feed_body(const struct head *h, struct kvr_chunked *ch, uint64_t *left,
                     struct body_ctx *b, const char *p, size_t n, bool *done, struct kvr_err *err)
{
    int rc;
    if (h->chunked) {
        size_t used = 0;
        rc = kvr_chunked_feed(ch, p, n, &used, body_sink, b);
        if (rc == KVR_EPROTO)
            return kvr_err_set(err, rc, "malformed chunked body");
        *done = ch->done;
    } else {
        size_t take = n;
        if (h->has_length && take > *left)
            take = (size_t)*left;
        rc = body_sink(b, p, take);
        *left -= h->has_length ? take : 0;
        *done = h->has_length && *left == 0;
    }
    if (rc > 0)
        return 1;
    if (rc)
        kvr_err_set(err, rc, "%s",
                    rc == KVR_ERANGE ? "response body or event too large" : "out of memory");
    return rc;
}

/* The body: the bytes already read after the head (p[0..n)), then more reads until it
 * ends. Returns as feed_body. */
static int read_body(struct conn *c, const struct head *h, bool no_body, struct body_ctx *b,
                     const char *p, size_t n, char *buf, size_t cap, struct kvr_err *err)
{
    struct kvr_chunked ch;
    kvr_chunked_init(&ch);
    uint64_t left = h->length;
    bool done = no_body || (!h->chunked && h->has_length && h->length == 0);
    for (;;) {
        if (!done && n > 0) {
            int rc = feed_body(h, &ch, &left, b, p, n, &done, err);
            if (rc)
                return rc;
        }
        if (done)
            return 0;
        long r = recv_some(c, buf, cap, err);
        if (r < 0)
            return (int)r;
        b->t_ns = kvr_now_ns();
        if (r == 0) {
            if (h->chunked || h->has_length)
                return kvr_err_set(err, KVR_ECLOSED,
                                   "the server closed the connection inside "
                                   "the response body");
            return 0; /* body delimited by the end of the connection */
        }
        p = buf;
        n = (size_t)r;
    }
}

/* Connect, send the request, read the head and the body. */
static int exchange(struct conn *c, const struct kvr_httpc_url *u, const struct kvr_httpc_req *req,
                    struct kvr_httpc_resp *resp, struct body_ctx *b, struct kvr_sbuf *head,
                    struct kvr_err *err)
{
    char buf[16384];
    int rc = build_request(head, u, req);
    if (rc)
        return kvr_err_set(err, rc, "out of memory");
    if ((rc = connect_any(c, u, err)) != 0)
        return rc;
    if ((rc = send_all(c, head->data, head->len, err)) != 0 ||
        (req->body && (rc = send_all(c, req->body, req->body_len, err)) != 0))
        return rc;
    resp->t_sent_ns = kvr_now_ns();
    kvr_sbuf_clear(head);
    size_t body_off = 0, head_len = 0;
    if ((rc = read_head(c, head, buf, sizeof buf, b, &body_off, &head_len, err)) != 0)
        return rc;
    resp->t_head_ns = b->t_ns;
    struct head h = {0};
    if ((rc = parse_head(head->data, head_len, resp, &h, err)) != 0)
        return rc;
    bool no_body = !strcmp(req->method, "HEAD") || resp->status < 200 || resp->status == 204 ||
                   resp->status == 304;
    resp->is_sse = req->on_event && resp->status >= 200 && resp->status < 300 &&
                   !strncasecmp(resp->content_type, "text/event-stream", 17);
    if (!resp->is_sse && h.has_length && h.length > b->max_body)
        return kvr_err_set(err, KVR_ERANGE, "response body of %llu bytes is over the %zu allowed",
                           (unsigned long long)h.length, b->max_body);
    rc = read_body(c, &h, no_body, b, head->data + body_off, head->len - body_off, buf, sizeof buf,
                   err);
    if (rc)
        return rc > 0 ? 0 : rc; /* rc > 0: on_event asked to stop */
    /* An event not terminated by a blank line before the end of the body is dropped, as the
     * event-stream format says. */
    if (!resp->is_sse && b->buf.len) {
        resp->body = kvr_sbuf_take(&b->buf, &resp->body_len);
        if (!resp->body)
            return kvr_err_set(err, KVR_ENOMEM, "out of memory");
    }
    return 0;
}

int kvr_httpc_do(const struct kvr_httpc_url *u, const struct kvr_httpc_req *req,
                 struct kvr_httpc_resp *resp, struct kvr_err *err)
{
    memset(resp, 0, sizeof *resp);
    if (!req->method || !req->path || req->path[0] != '/' || has_header_injection(req->path) ||
        has_header_injection(req->api_key) || has_header_injection(req->method))
        return kvr_err_set(err, KVR_EINVAL, "bad request method, path or key");
    struct conn c = {.fd = -1,
                     .req = req,
                     .io_timeout_ms =
                         req->io_timeout_ms ? req->io_timeout_ms : DEFAULT_IO_TIMEOUT_MS};
    struct body_ctx b = {.resp = resp,
                         .req = req,
                         .max_body = req->max_body_bytes ? req->max_body_bytes : DEFAULT_MAX_BODY};
    kvr_sse_init(&b.sse);
    kvr_sbuf_init(&b.buf);
    struct kvr_sbuf head;
    kvr_sbuf_init(&head);
    int rc = exchange(&c, u, req, resp, &b, &head, err);
    resp->t_end_ns = kvr_now_ns();
    if (c.fd >= 0)
        close(c.fd);
    kvr_sbuf_fini(&head);
    kvr_sbuf_fini(&b.buf);
    kvr_sse_fini(&b.sse);
    return rc;
}

void kvr_httpc_resp_fini(struct kvr_httpc_resp *resp)
{
    kvr_free(resp->body);
    resp->body = NULL;
    resp->body_len = 0;
}

int kvr_httpc_get(const struct kvr_httpc_url *u, const char *path, const char *api_key,
                  uint32_t timeout_ms, struct kvr_httpc_resp *resp, struct kvr_err *err)
{
    struct kvr_httpc_req req = {
        .method = "GET",
        .path = path,
        .api_key = api_key,
        .io_timeout_ms = timeout_ms,
        .deadline_ns = kvr_now_ns() +
                       (uint64_t)(timeout_ms ? timeout_ms : DEFAULT_IO_TIMEOUT_MS) * 1000000ull};
    return kvr_httpc_do(u, &req, resp, err);
}
