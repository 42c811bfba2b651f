/* test_httpc.c - the HTTP client: URL parsing, the SSE parser and the chunked decoder fed in
 * every possible split, then real exchanges with a scripted server on 127.0.0.1 (chunked
 * SSE, Content-Length, body to EOF, refusals with Retry-After, a server that stalls, one that
 * closes mid-body, a malformed head, a cancel flag). Also the Prometheus text reader. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "client/httpc.h"
#include "client/promtext.h"
#include "core/alloc.h"
#include "core/clock.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- URLs ----------------------------------------------------------------------------- */

static void test_url(void **state)
{
    (void)state;
    struct kvr_httpc_url u;
    struct kvr_err err = {0};
    assert_int_equal(kvr_httpc_url_parse(&u, "http://127.0.0.1:8080", &err), 0);
    assert_string_equal(u.host, "127.0.0.1");
    assert_string_equal(u.port, "8080");
    assert_string_equal(u.base_path, "");
    assert_int_equal(kvr_httpc_url_parse(&u, "localhost:9/api/", &err), 0);
    assert_string_equal(u.host, "localhost");
    assert_string_equal(u.port, "9");
    assert_string_equal(u.base_path, "/api");
    assert_int_equal(kvr_httpc_url_parse(&u, "http://[::1]:7000/x", &err), 0);
    assert_string_equal(u.host, "::1");
    assert_string_equal(u.port, "7000");
    assert_string_equal(u.base_path, "/x");
    assert_int_equal(kvr_httpc_url_parse(&u, "HTTP://example", &err), 0);
    assert_string_equal(u.port, "80");
    const char *bad[] = {"https://a",      "http://",    "http://:80",   "http://a:0",
                         "http://a:65536", "http://a:x", "http://u@a",   "http://a/?q",
                         "http://[::1",    "ftp://a",    "http://[::1]x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(kvr_httpc_url_parse(&u, bad[i], &err), KVR_EINVAL);
}

/* ---- SSE ------------------------------------------------------------------------------- */

struct events {
    char all[4096]; /* events joined by '|' */
    size_t n;
    int stop_after; /* ask to stop after this many (0 = never) */
};

static int collect(void *ud, const char *data, size_t len, uint64_t t_ns)
{
    (void)t_ns;
    struct events *e = ud;
    assert_int_equal(data[len], 0);
    size_t used = strlen(e->all);
    snprintf(e->all + used, sizeof e->all - used, "%.*s|", (int)len, data);
    e->n++;
    return e->stop_after && e->n >= (size_t)e->stop_after ? 7 : 0;
}

static const char sse_text[] = ": comment\r\n"
                               "data: one\r\n\r\n"
                               "event: x\nid: 3\ndata:two\ndata:  lines\n\n"
                               "data\n\n"      /* a field without colon: empty data */
                               "retry: 10\n\n" /* no data: not dispatched */
                               "data: cr\r\rdata: {\"a\":1}\n\n"
                               "data: unterminated";
static const char sse_want[] = "one|two\n lines||cr|{\"a\":1}|";

static void test_sse_splits(void **state)
{
    (void)state;
    size_t n = sizeof sse_text - 1;
    /* Every split point, and byte by byte. */
    for (size_t cut = 0; cut <= n; cut++) {
        struct kvr_sse s;
        struct events e = {0};
        kvr_sse_init(&s);
        assert_int_equal(kvr_sse_feed(&s, sse_text, cut, collect, &e, 0), 0);
        assert_int_equal(kvr_sse_feed(&s, sse_text + cut, n - cut, collect, &e, 0), 0);
        assert_string_equal(e.all, sse_want);
        kvr_sse_fini(&s);
    }
    struct kvr_sse s;
    struct events e = {0};
    kvr_sse_init(&s);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(kvr_sse_feed(&s, sse_text + i, 1, collect, &e, 0), 0);
    assert_string_equal(e.all, sse_want);
    kvr_sse_fini(&s);

    /* The callback's stop value comes back; parsing stops there. */
    struct events stop = {.stop_after = 2};
    kvr_sse_init(&s);
    assert_int_equal(kvr_sse_feed(&s, sse_text, n, collect, &stop, 0), 7);
    assert_int_equal(stop.n, 2);
    kvr_sse_fini(&s);
}

static void test_sse_too_large(void **state)
{
    (void)state;
    size_t big = KVR_SSE_MAX_EVENT_BYTES / 4 + 16;
    char *chunk = kvr_malloc(big);
    assert_non_null(chunk);
    memset(chunk, 'a', big);
    memcpy(chunk, "data: ", 6);
    chunk[big - 1] = '\n';
    struct kvr_sse s;
    struct events e = {0};
    kvr_sse_init(&s);
    int rc = 0;
    for (int i = 0; i < 8 && rc == 0; i++)
        rc = kvr_sse_feed(&s, chunk, big, collect, &e, 0);
    assert_int_equal(rc, KVR_ERANGE);
    assert_int_equal(e.n, 0);
    kvr_sse_fini(&s);
    /* An endless line without a terminator is bounded too. */
    kvr_sse_init(&s);
    memset(chunk, 'b', big);
    rc = 0;
    for (int i = 0; i < 8 && rc == 0; i++)
        rc = kvr_sse_feed(&s, chunk, big, collect, &e, 0);
    assert_int_equal(rc, KVR_ERANGE);
    kvr_sse_fini(&s);
    kvr_free(chunk);
}

/* ---- chunked ---------------------------------------------------------------------------- */

static int append_sink(void *ud, const char *p, size_t n)
{
    struct kvr_sbuf *b = ud;
    kvr_sbuf_append(b, p, n);
    return 0;
}

static void test_chunked(void **state)
{
    (void)state;
    static const char body[] = "5\r\nhello\r\n1;ext=1\r\n \r\nB\nworld, body\n0\r\nX-T: 1\r\n\r\n"
                               "AFTER";
    size_t n = sizeof body - 1, end = n - 5;
    for (size_t cut = 0; cut <= n; cut++) {
        struct kvr_chunked c;
        struct kvr_sbuf out;
        kvr_chunked_init(&c);
        kvr_sbuf_init(&out);
        size_t used1 = 0, used2 = 0;
        assert_int_equal(kvr_chunked_feed(&c, body, cut, &used1, append_sink, &out), 0);
        assert_int_equal(used1, cut < end ? cut : end);
        if (!c.done)
            assert_int_equal(kvr_chunked_feed(&c, body + cut, n - cut, &used2, append_sink, &out),
                             0);
        assert_true(c.done);
        assert_int_equal(used1 + used2, end);
        assert_string_equal(out.data, "hello world, body");
        kvr_sbuf_fini(&out);
    }
    const char *bad[] = {"x\r\n",   "\r\n", "5\r\nhelloXX", "5\rX", "FFFFFFFFFFFFFFFF\r\n",
                         "0\r\n\rX"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct kvr_chunked c;
        size_t used;
        kvr_chunked_init(&c);
        assert_int_equal(kvr_chunked_feed(&c, bad[i], strlen(bad[i]), &used, NULL, NULL),
                         KVR_EPROTO);
    }
}

/* ---- a scripted server -------------------------------------------------------------------- */

/* Accepts one connection, reads the request head (and a body as long as Content-Length),
 * then writes each part of `reply` in turn (paced by `acked` if set), then closes (or, with
 * hang, keeps the socket open until the test ends). */
struct server {
    int listen_fd;
    uint16_t port;
    const char *const *reply;
    /* With `acked` set, part i > 1 waits (up to 2 s) until *acked >= i - 1, the number of
     * events the client has stamped, and sent_ns[i] is when it was sent: the test then
     * judges each stamp against the sends instead of against the pause. */
    atomic_int *acked;
    uint64_t sent_ns[8];
    bool hang;
    char request[8192];
    pthread_t thread;
    atomic_int quit; /* set by the test thread, read by the server thread */
};

static void *server_main(void *arg)
{
    struct server *s = arg;
    int fd = accept(s->listen_fd, NULL, NULL);
    if (fd < 0)
        return NULL;
    size_t got = 0;
    for (;;) {
        ssize_t r = recv(fd, s->request + got, sizeof s->request - 1 - got, 0);
        if (r <= 0)
            break;
        got += (size_t)r;
        s->request[got] = 0;
        char *he = strstr(s->request, "\r\n\r\n");
        if (!he)
            continue;
        const char *cl = strstr(s->request, "Content-Length: ");
        size_t want = (size_t)(he + 4 - s->request) + (cl ? (size_t)atoi(cl + 16) : 0);
        if (got >= want)
            break;
    }
    for (size_t i = 0; s->reply[i]; i++) {
        if (s->acked && i > 1) {
            uint64_t give_up = kvr_now_ns() + 2000000000ull;
            while (atomic_load(s->acked) < (int)i - 1 && kvr_now_ns() < give_up)
                kvr_sleep_ns(1000000ull);
        }
        if (i < sizeof s->sent_ns / sizeof s->sent_ns[0])
            s->sent_ns[i] = kvr_now_ns();
        if (send(fd, s->reply[i], strlen(s->reply[i]), MSG_NOSIGNAL) < 0)
            break;
    }
    while (s->hang && !s->quit)
        kvr_sleep_ns(10 * 1000000ull);
    close(fd);
    return NULL;
}

static void server_start(struct server *s, const char *const *reply)
{
    memset(s, 0, sizeof *s);
    s->reply = reply;
    s->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(s->listen_fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(s->listen_fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(s->listen_fd, 4), 0);
    socklen_t len = sizeof a;
    getsockname(s->listen_fd, (struct sockaddr *)&a, &len);
    s->port = ntohs(a.sin_port);
}

static void server_run(struct server *s)
{
    assert_int_equal(pthread_create(&s->thread, NULL, server_main, s), 0);
}

static void server_stop(struct server *s)
{
    s->quit = 1;
    pthread_join(s->thread, NULL);
    close(s->listen_fd);
}

static void url_of(struct kvr_httpc_url *u, const struct server *s)
{
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%u", s->port);
    struct kvr_err err = {0};
    assert_int_equal(kvr_httpc_url_parse(u, url, &err), 0);
}

struct timed_events {
    struct events e;
    uint64_t t[16];
    atomic_int acked; /* events stamped so far, read by the server thread */
};

static int collect_timed(void *ud, const char *data, size_t len, uint64_t t_ns)
{
    struct timed_events *te = ud;
    if (te->e.n < 16)
        te->t[te->e.n] = t_ns;
    int rc = collect(&te->e, data, len, t_ns);
    atomic_store(&te->acked, (int)te->e.n);
    return rc;
}

static void test_exchange_sse(void **state)
{
    (void)state;
    static const char *const reply[] = {
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
        "\r\n",
        "d\r\ndata: first\n\n\r\n", "e\r\ndata: second\n\n\r\n",
        "e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n", NULL};
    struct server s;
    struct timed_events te = {0};
    server_start(&s, reply);
    s.acked = &te.acked;
    server_run(&s);
    struct kvr_httpc_url u;
    url_of(&u, &s);
    const char body[] = "{\"x\": 1}";
    struct kvr_httpc_req req = {.method = "POST",
                                .path = "/v1/completions",
                                .api_key = "k3y",
                                .extra_headers = "X-Latency-Budget-Ms: 500\r\n",
                                .body = body,
                                .body_len = sizeof body - 1,
                                .io_timeout_ms = 5000,
                                .on_event = collect_timed,
                                .ud = &te};
    struct kvr_httpc_resp resp;
    struct kvr_err err = {0};
    int rc = kvr_httpc_do(&u, &req, &resp, &err);
    server_stop(&s);
    assert_int_equal(rc, 0);
    assert_int_equal(resp.status, 200);
    assert_true(resp.is_sse);
    assert_null(resp.body);
    assert_string_equal(te.e.all, "first|second|[DONE]|");
    /* Each event is stamped when it arrived, not when the stream ended: after its own part
     * was sent (part k + 1 carries event k) and before the next one was. The server sends
     * the next part only once the client has stamped the event before it, so no pause and
     * no scheduling delay is judged. */
    for (int k = 0; k < 3; k++) {
        assert_true(te.t[k] >= s.sent_ns[k + 1]);
        if (k < 2)
            assert_true(te.t[k] < s.sent_ns[k + 2]);
    }
    assert_true(resp.t_head_ns <= te.t[0] && te.t[2] <= resp.t_end_ns);
    assert_non_null(strstr(s.request, "POST /v1/completions HTTP/1.1\r\n"));
    assert_non_null(strstr(s.request, "Authorization: Bearer k3y\r\n"));
    assert_non_null(strstr(s.request, "X-Latency-Budget-Ms: 500\r\n"));
    assert_non_null(strstr(s.request, "Content-Length: 8\r\n"));
    assert_non_null(strstr(s.request, "\r\n\r\n{\"x\": 1}"));
    kvr_httpc_resp_fini(&resp);
}

static void test_exchange_refusal(void **state)
{
    (void)state;
    static const char *const reply[] = {
        "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
        "Retry-After: 3\r\nContent-Length: 26\r\n\r\n",
        "{\"error\": {\"code\": \"x\"}}\n\n", NULL};
    struct server s;
    server_start(&s, reply);
    server_run(&s);
    struct kvr_httpc_url u;
    url_of(&u, &s);
    struct events e = {0};
    struct kvr_httpc_req req = {.method = "POST",
                                .path = "/v1/completions",
                                .body = "{}",
                                .body_len = 2,
                                .io_timeout_ms = 5000,
                                .on_event = collect,
                                .ud = &e};
    struct kvr_httpc_resp resp;
    struct kvr_err err = {0};
    int rc = kvr_httpc_do(&u, &req, &resp, &err);
    server_stop(&s);
    assert_int_equal(rc, 0);
    assert_int_equal(resp.status, 429);
    assert_false(resp.is_sse);
    assert_true(resp.has_retry_after);
    assert_int_equal(resp.retry_after_s, 3);
    assert_string_equal(resp.content_type, "application/json");
    assert_int_equal(resp.body_len, 26);
    assert_string_equal(resp.body, "{\"error\": {\"code\": \"x\"}}\n\n");
    assert_int_equal(e.n, 0);
    kvr_httpc_resp_fini(&resp);
}

static void test_exchange_body_to_eof(void **state)
{
    (void)state;
    static const char *const reply[] = {"HTTP/1.0 200 OK\nContent-Type: text/plain\n\n", "abc",
                                        "def", NULL};
    struct server s;
    server_start(&s, reply);
    server_run(&s);
    struct kvr_httpc_url u;
    url_of(&u, &s);
    struct kvr_httpc_resp resp;
    struct kvr_err err = {0};
    int rc = kvr_httpc_get(&u, "/metrics", NULL, 5000, &resp, &err);
    server_stop(&s);
    assert_int_equal(rc, 0);
    assert_int_equal(resp.status, 200);
    assert_string_equal(resp.body, "abcdef");
    assert_non_null(strstr(s.request, "GET /metrics HTTP/1.1\r\n"));
    assert_null(strstr(s.request, "Authorization"));
    kvr_httpc_resp_fini(&resp);
}

/* Failures: each must come back quickly with the right status. */
static void expect_failure(const char *const *reply, bool hang, uint32_t timeout_ms,
                           const volatile int *cancel, int want_rc, size_t max_body)
{
    struct server s;
    server_start(&s, reply);
    s.hang = hang;
    server_run(&s);
    struct kvr_httpc_url u;
    url_of(&u, &s);
    struct events e = {0};
    struct kvr_httpc_req req = {.method = "GET",
                                .path = "/",
                                .io_timeout_ms = timeout_ms,
                                .on_event = collect,
                                .ud = &e,
                                .cancel = cancel,
                                .max_body_bytes = max_body};
    struct kvr_httpc_resp resp;
    struct kvr_err err = {0};
    uint64_t t0 = kvr_now_ns();
    int rc = kvr_httpc_do(&u, &req, &resp, &err);
    uint64_t took_ms = (kvr_now_ns() - t0) / 1000000;
    s.quit = 1;
    server_stop(&s);
    if (rc != want_rc)
        fail_msg("got %d (%s), want %d", rc, err.msg, want_rc);
    assert_true(err.msg[0] != 0);
    assert_true(took_ms < timeout_ms + 1000);
    kvr_httpc_resp_fini(&resp);
}

static void test_exchange_failures(void **state)
{
    (void)state;
    static const char *const stall_head[] = {"HTTP/1.1 200 OK\r\n", NULL};
    expect_failure(stall_head, true, 300, NULL, KVR_ETIMEDOUT, 0);
    static const char *const stall_body[] = {
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 100\r\n\r\n"
        "data: a\n\n",
        NULL};
    expect_failure(stall_body, true, 300, NULL, KVR_ETIMEDOUT, 0);
    static const char *const cut_body[] = {
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", NULL};
    expect_failure(cut_body, false, 3000, NULL, KVR_ECLOSED, 0);
    static const char *const no_answer[] = {NULL};
    expect_failure(no_answer, false, 3000, NULL, KVR_ECLOSED, 0);
    static const char *const garbage[] = {"SSH-2.0-OpenSSH\r\n\r\n", NULL};
    expect_failure(garbage, false, 3000, NULL, KVR_EPROTO, 0);
    static const char *const bad_chunk[] = {
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", NULL};
    expect_failure(bad_chunk, false, 3000, NULL, KVR_EPROTO, 0);
    static const char *const too_big[] = {"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", NULL};
    expect_failure(too_big, false, 3000, NULL, KVR_ERANGE, 10);
    static const char *const bad_te[] = {"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
                                         NULL};
    expect_failure(bad_te, false, 3000, NULL, KVR_EPROTO, 0);
    /* A raised cancel flag ends a stalled exchange within about 100 ms. */
    static volatile int cancel = 1;
    expect_failure(stall_head, true, 10000, &cancel, KVR_ECLOSED, 0);

    /* Nobody listening. */
    struct server s;
    server_start(&s, no_answer);
    close(s.listen_fd);
    struct kvr_httpc_url u;
    url_of(&u, &s);
    struct kvr_httpc_resp resp;
    struct kvr_err err = {0};
    assert_int_equal(kvr_httpc_get(&u, "/", NULL, 2000, &resp, &err), KVR_EIO);
    kvr_httpc_resp_fini(&resp);
    /* Header injection through the path is refused before connecting. */
    assert_int_equal(kvr_httpc_get(&u, "/\r\nX: y", NULL, 2000, &resp, &err), KVR_EINVAL);
}

/* ---- Prometheus text --------------------------------------------------------------------- */

static void test_promtext(void **state)
{
    (void)state;
    static const char text[] =
        "# HELP kvasir:ring_up 1 when up.\n"
        "# TYPE kvasir:ring_up gauge\n"
        "kvasir:ring_up 1\n"
        "kvasir:stage_utilization{stage=\"0\"} 0.25\n"
        "kvasir:stage_utilization{stage=\"1\"} 7.5e-01 1700000000000\r\n"
        "kvasir:request_refused_total{reason=\"over_budget\",code=\"429\"} 12\n"
        "weird{a=\"x\\\"y\\\\z\\n\", b=\"\"} +Inf\n"
        "nan_metric NaN\n"
        "   \n"
        "broken{stage=\"0\" 1\n"
        "no_value\n"
        "bad_value abc\n"
        "9starts_with_digit 1\n"
        "trailing 1 junk\n"
        "last_line_without_newline -2";
    struct kvr_prom p;
    assert_int_equal(kvr_prom_parse(&p, text, sizeof text - 1), 0);
    assert_int_equal(p.n_samples, 7);
    assert_int_equal(p.n_skipped, 5);
    assert_true(kvr_prom_value(&p, "kvasir:ring_up", NULL, -1) == 1);
    const char *s0[] = {"stage", "0", NULL}, *s1[] = {"stage", "1", NULL},
               *s2[] = {"stage", "2", NULL};
    assert_true(kvr_prom_value(&p, "kvasir:stage_utilization", s0, -1) == 0.25);
    assert_true(kvr_prom_value(&p, "kvasir:stage_utilization", s1, -1) == 0.75);
    assert_true(kvr_prom_value(&p, "kvasir:stage_utilization", s2, -1) == -1);
    const char *rb[] = {"reason", "over_budget", NULL};
    assert_true(kvr_prom_value(&p, "kvasir:request_refused_total", rb, 0) == 12);
    const struct kvr_prom_sample *w = kvr_prom_find(&p, "weird", NULL);
    assert_non_null(w);
    assert_string_equal(kvr_prom_label(w, "a"), "x\"y\\z\n");
    assert_string_equal(kvr_prom_label(w, "b"), "");
    assert_null(kvr_prom_label(w, "c"));
    assert_true(isinf(w->value) && w->value > 0);
    assert_true(isnan(kvr_prom_value(&p, "nan_metric", NULL, 0)));
    assert_true(kvr_prom_value(&p, "last_line_without_newline", NULL, 0) == -2);
    assert_null(kvr_prom_find(&p, "broken", NULL));
    kvr_prom_fini(&p);

    /* Allocation failures anywhere are reported, and the struct can still be freed. */
    for (long k = 0; k < 40; k++) {
        kvr_alloc_fail_after(k);
        int rc = kvr_prom_parse(&p, text, sizeof text - 1);
        kvr_alloc_fail_after(-1);
        assert_true(rc == 0 || rc == KVR_ENOMEM);
        kvr_prom_fini(&p);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_url),
        cmocka_unit_test(test_sse_splits),
        cmocka_unit_test(test_sse_too_large),
        cmocka_unit_test(test_chunked),
        cmocka_unit_test(test_exchange_sse),
        cmocka_unit_test(test_exchange_refusal),
        cmocka_unit_test(test_exchange_body_to_eof),
        cmocka_unit_test(test_exchange_failures),
        cmocka_unit_test(test_promtext),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
