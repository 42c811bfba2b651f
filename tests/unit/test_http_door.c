/* test_http_door.c - the HTTP connection guard (bridge/http_door.h) without a server: its
 * connections are socket pairs, its clock is the test's, its thread is not started. A
 * connection the door closes has its socket shut down, which the other end sees as EOF.
 * Checked: each deadline (headers, body, idle) closes at its time and not before, whatever
 * the connection did meanwhile; a working connection has none; making room closes the
 * oldest idle connection first, then the oldest fresh one, never a working one; a full
 * house of working connections refuses; the counts and their Prometheus text. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/http_door.h"
#include "core/err.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define S 1000000000ull /* one second in ns */

struct pair {
    int server, client;
    struct kvr_http_door_conn *c;
};

static struct kvr_http_door *door(uint32_t max_connections)
{
    struct kvr_http_door_config cfg = {.max_connections = max_connections,
                                       .max_per_client = 4,
                                       .header_timeout_s = 10,
                                       .body_timeout_s = 30,
                                       .idle_timeout_s = 60};
    struct kvr_http_door *d = NULL;
    assert_int_equal(kvr_http_door_create(&d, &cfg), KVR_OK);
    return d;
}

/* Admit and open a connection at `now`. */
static void open_pair(struct kvr_http_door *d, struct pair *p, uint64_t now)
{
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    p->server = sv[0];
    p->client = sv[1];
    assert_true(kvr_http_door_admit(d, now));
    p->c = kvr_http_door_opened(d, p->server, now);
    assert_non_null(p->c);
}

/* Has the door shut the connection down? */
static bool shut(const struct pair *p)
{
    char b;
    ssize_t k = recv(p->client, &b, 1, MSG_DONTWAIT);
    return k == 0;
}

static void close_pair(struct kvr_http_door *d, struct pair *p)
{
    kvr_http_door_closed(d, p->c);
    close(p->server);
    close(p->client);
}

static void test_deadlines(void **state)
{
    (void)state;
    struct kvr_http_door *d = door(16);
    uint64_t t = 1000 * S;
    struct pair fresh, body, idle, work;
    open_pair(d, &fresh, t);
    open_pair(d, &body, t);
    open_pair(d, &idle, t);
    open_pair(d, &work, t);
    kvr_http_door_headers(d, body.c, t + 1 * S);
    kvr_http_door_headers(d, idle.c, t + 1 * S);
    kvr_http_door_working(d, idle.c);
    kvr_http_door_idle(d, idle.c, t + 2 * S);
    kvr_http_door_headers(d, work.c, t + 1 * S);
    kvr_http_door_working(d, work.c);
    assert_int_equal(kvr_http_door_open(d), 4);

    /* Nothing before its time; the next deadline is the fresh one's. */
    assert_int_equal(kvr_http_door_tick(d, t + 10 * S - 1), t + 10 * S);
    assert_false(shut(&fresh));
    /* Headers 10 s after connecting: closed, however it trickled meanwhile. */
    assert_int_equal(kvr_http_door_tick(d, t + 10 * S), t + 20 * S); /* the log window */
    assert_true(shut(&fresh));
    assert_false(shut(&body));
    assert_int_equal(kvr_http_door_count(d, KVR_HTTP_DOOR_HEADER_TIMEOUT), 1);
    assert_int_equal(kvr_http_door_open(d), 3);
    /* The body 30 s after the headers. */
    kvr_http_door_tick(d, t + 31 * S);
    assert_true(shut(&body));
    assert_int_equal(kvr_http_door_count(d, KVR_HTTP_DOOR_BODY_TIMEOUT), 1);
    /* The next request 60 s after the last answer; a working connection never. */
    kvr_http_door_tick(d, t + 61 * S);
    assert_false(shut(&idle));
    kvr_http_door_tick(d, t + 62 * S);
    assert_true(shut(&idle));
    assert_int_equal(kvr_http_door_count(d, KVR_HTTP_DOOR_IDLE_TIMEOUT), 1);
    kvr_http_door_tick(d, t + 10000 * S);
    assert_false(shut(&work));
    /* The burst's windows have closed: nothing left to wait for but the working one. */
    assert_int_equal(kvr_http_door_tick(d, t + 10100 * S), UINT64_MAX);
    assert_int_equal(kvr_http_door_open(d), 1);
    /* A closed record is free again; a late event on a closing one changes nothing. */
    kvr_http_door_headers(d, fresh.c, t + 10001 * S);
    close_pair(d, &fresh);
    close_pair(d, &body);
    close_pair(d, &idle);
    close_pair(d, &work);
    assert_int_equal(kvr_http_door_open(d), 0);
    assert_int_equal(kvr_http_door_tick(d, t + 20000 * S), UINT64_MAX);
    kvr_http_door_destroy(d);
}

/* 16 connections: 14 may wait (16 - 16/8). */
static void test_make_room(void **state)
{
    (void)state;
    struct kvr_http_door *d = door(16);
    uint64_t t = 1000 * S;
    struct pair p[20];
    /* Two working connections hold reserve slots, two idle ones and 12 fresh ones fill the
     * waiting share. */
    for (int i = 0; i < 4; i++) {
        open_pair(d, &p[i], t);
        kvr_http_door_headers(d, p[i].c, t + S);
        kvr_http_door_working(d, p[i].c);
        if (i >= 2)
            kvr_http_door_idle(d, p[i].c, t + 2 * S);
    }
    for (int i = 4; i < 16; i++)
        open_pair(d, &p[i], t + (uint64_t)i * S / 100);
    for (int i = 0; i < 16; i++)
        assert_false(shut(&p[i]));
    /* Each newcomer closes an idle one (oldest first), then the oldest fresh ones. */
    open_pair(d, &p[16], t + 3 * S);
    assert_true(shut(&p[2]));
    assert_false(shut(&p[3]));
    open_pair(d, &p[17], t + 3 * S);
    assert_true(shut(&p[3]));
    open_pair(d, &p[18], t + 3 * S);
    assert_true(shut(&p[4]));
    assert_false(shut(&p[5]));
    for (int i = 0; i < 2; i++)
        assert_false(shut(&p[i])); /* working connections are never evicted */
    assert_int_equal(kvr_http_door_count(d, KVR_HTTP_DOOR_EVICTED), 3);
    assert_int_equal(kvr_http_door_open(d), 16);

    /* Every slot answering a request: refused, and counted. */
    for (int i = 0; i < 19; i++)
        if (!shut(&p[i])) {
            kvr_http_door_headers(d, p[i].c, t + 4 * S);
            kvr_http_door_working(d, p[i].c);
        }
    assert_false(kvr_http_door_admit(d, t + 5 * S));
    assert_int_equal(kvr_http_door_count(d, KVR_HTTP_DOOR_REFUSED_FULL), 1);
    kvr_http_door_refused(d, KVR_HTTP_DOOR_REFUSED_CLIENT, t + 5 * S);

    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    kvr_http_door_print(d, &b);
    assert_false(b.failed);
    static const char *const want[] = {
        "kvasir:http_connections_open 16\n",
        "kvasir:http_connections_closed_total{reason=\"evicted\"} 3\n",
        "kvasir:http_connections_closed_total{reason=\"refused_full\"} 1\n",
        "kvasir:http_connections_closed_total{reason=\"refused_per_client\"} 1\n",
        "kvasir:http_connections_closed_total{reason=\"header_timeout\"} 0\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(b.data, want[i]))
            fail_msg("lacks '%s' in:\n%s", want[i], b.data);
    kvr_sbuf_fini(&b);
    /* The burst's summary is written when its window ends; then the window closes. */
    assert_true(kvr_http_door_tick(d, t + 5 * S) <= t + 15 * S + S);
    for (int i = 0; i < 19; i++)
        close_pair(d, &p[i]);
    kvr_http_door_destroy(d);
}

static void test_config(void **state)
{
    (void)state;
    struct kvr_http_door_config cfg = {
        .max_connections = 8, .header_timeout_s = 1, .body_timeout_s = 1, .idle_timeout_s = 0};
    struct kvr_http_door *d = NULL;
    assert_int_equal(kvr_http_door_create(&d, &cfg), KVR_EINVAL);
    cfg.idle_timeout_s = 1;
    cfg.thread = true;
    assert_int_equal(kvr_http_door_create(&d, &cfg), KVR_OK);
    assert_int_equal(kvr_http_door_capacity(d), 8 + 1 + 8);
    kvr_http_door_destroy(d);
    kvr_http_door_destroy(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_deadlines),
        cmocka_unit_test(test_make_room),
        cmocka_unit_test(test_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
