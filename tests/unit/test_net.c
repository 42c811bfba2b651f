/* test_net.c - socket helpers and links over 127.0.0.1 and socketpairs: addresses, listen /
 * accept / connect, exact reads and gathered writes with deadlines, the handshake over TCP
 * (success, wrong secret, different plan, wrong peer), frames in and out, and the ways a
 * peer can break a link (a frame beyond the plan's limits, a frame cut short, a timeout in
 * the middle of a frame, a vanished peer). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/clock.h"
#include "core/log.h"
#include "ring/addr.h"
#include "ring/dial.h"
#include "ring/net.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define N_EMBD 8
#define N_VOCAB 100
#define TIMEOUT_MS 5000

static struct kvr_plan plan, plan_other;

static void make_plan(struct kvr_plan *p)
{
    memset(p, 0, sizeof *p);
    strcpy(p->model_path, "m.gguf");
    p->n_stages = 3;
    for (uint32_t i = 0; i < 3; i++) {
        snprintf(p->stages[i].addr, sizeof p->stages[i].addr, "127.0.0.1:%u", 7001 + i);
        p->stages[i].first_layer = i;
        p->stages[i].last_layer = i;
    }
    strcpy(p->bridge_addr, "127.0.0.1:7000");
    p->row_width = 16;
    p->microbatches = 2;
    p->max_seqs = 8;
    p->n_ctx = 128;
    p->kv_block_tokens = 16;
    p->kv_blocks = 64;
    p->wire_dtype = KVR_DTYPE_F32;
    p->secret_bytes = 16;
    memcpy(p->secret, "0123456789abcdef", 16);
    struct kvr_err err = {0};
    if (kvr_plan_validate(p, 3, &err))
        fail_msg("plan: %s", err.msg);
}

static void limits_for(const struct kvr_plan *p, int receiver, struct kvr_wire_limits *lim)
{
    struct kvr_err err = {0};
    if (kvr_wire_limits_init(lim, p, N_EMBD, N_VOCAB, receiver, &err))
        fail_msg("limits: %s", err.msg);
}

/* ---- Addresses and raw sockets --------------------------------------------------------- */

static void test_parse_addr(void **state)
{
    (void)state;
    char host[KVR_ADDR_HOST_BYTES];
    uint16_t port = 0;
    struct kvr_err err = {0};
    assert_int_equal(kvr_addr_parse("127.0.0.1:7001", host, sizeof host, &port, false, &err), 0);
    assert_string_equal(host, "127.0.0.1");
    assert_int_equal(port, 7001);
    assert_int_equal(kvr_addr_parse("[::1]:80", host, sizeof host, &port, false, &err), 0);
    assert_string_equal(host, "::1");
    assert_int_equal(port, 80);
    assert_int_equal(
        kvr_addr_parse("node-3.rack_a.example:65535", host, sizeof host, &port, false, &err), 0);
    assert_int_equal(port, 65535);
    const char *bad[] = {"",           ":",       "host",    "host:",       ":1",    "host:0",
                         "host:65536", "host:-1", "host:1x", "host:123456", "a b:1", "[::1]",
                         "[::1]:",     "[zz]:1",  "::1:80",  "host:+1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (kvr_addr_parse(bad[i], host, sizeof host, &port, false, &err) == 0)
            fail_msg("\"%s\" was accepted", bad[i]);
    /* A host too long for the caller's buffer is refused, not truncated. */
    char small[4];
    assert_int_equal(kvr_addr_parse("abcd:1", small, sizeof small, &port, false, &err), KVR_EINVAL);

    assert_true(kvr_addr_equal("Node:1", "node:1"));
    assert_true(kvr_addr_equal("[::1]:5", "[::1]:5"));
    assert_false(kvr_addr_equal("node:1", "node:2"));
    assert_false(kvr_addr_equal("localhost:1", "127.0.0.1:1"));
    assert_false(kvr_addr_equal("bad", "bad"));
}

static int nodelay(int fd)
{
    int v = 0;
    socklen_t len = sizeof v;
    assert_int_equal(getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &v, &len), 0);
    return v;
}

static void test_listen_accept_connect(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    int lfd = -1, cfd = -1, afd = -1;
    uint16_t port = 0;
    assert_int_equal(kvr_net_listen("127.0.0.1:0", 4, &lfd, &port, &err), 0);
    assert_true(port != 0);
    char addr[64], peer[128];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    /* Nobody connected yet: accept times out. */
    uint64_t t0 = kvr_now_ns();
    assert_int_equal(kvr_net_accept(lfd, kvr_net_deadline(50), &afd, peer, sizeof peer, &err),
                     KVR_ETIMEDOUT);
    assert_true(kvr_now_ns() - t0 >= 40 * 1000000ull);
    assert_int_equal(kvr_net_connect(addr, kvr_net_deadline(TIMEOUT_MS), &cfd, &err), 0);
    assert_int_equal(
        kvr_net_accept(lfd, kvr_net_deadline(TIMEOUT_MS), &afd, peer, sizeof peer, &err), 0);
    assert_non_null(strstr(peer, "127.0.0.1:"));
    assert_true(nodelay(cfd));
    assert_true(nodelay(afd));
    assert_true(fcntl(cfd, F_GETFD) & FD_CLOEXEC);
    /* A second listener on the same port is refused with a message naming it. */
    int lfd2 = -1;
    assert_int_equal(kvr_net_listen(addr, 4, &lfd2, NULL, &err), KVR_EIO);
    assert_non_null(strstr(err.msg, addr));
    close(afd);
    close(cfd);
    close(lfd);
    /* Now the port is free again: connecting is refused. */
    assert_true(kvr_net_connect(addr, kvr_net_deadline(TIMEOUT_MS), &cfd, &err) < 0);
    assert_non_null(strstr(err.msg, "connect to"));
    assert_int_equal(kvr_net_connect("nonsense", kvr_net_deadline(100), &cfd, &err), KVR_EINVAL);
}

static void socket_pair(int sv[2])
{
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
}

static void test_read_full(void **state)
{
    (void)state;
    int sv[2];
    uint8_t b[16];
    size_t got = 0;
    struct kvr_err err = {0};
    socket_pair(sv);
    assert_int_equal(kvr_net_read_full(sv[0], b, 4, kvr_net_deadline(30), &got, &err),
                     KVR_ETIMEDOUT);
    assert_int_equal(write(sv[1], "abcdef", 6), 6);
    assert_int_equal(kvr_net_read_full(sv[0], b, 4, kvr_net_deadline(TIMEOUT_MS), &got, &err), 0);
    assert_int_equal(got, 4);
    assert_memory_equal(b, "abcd", 4);
    close(sv[1]);
    /* 2 bytes left, then EOF inside the 4 we ask for. */
    assert_int_equal(kvr_net_read_full(sv[0], b, 4, kvr_net_deadline(TIMEOUT_MS), &got, &err),
                     KVR_EPROTO);
    assert_int_equal(got, 2);
    assert_non_null(strstr(err.msg, "after 2 of 4 bytes"));
    assert_int_equal(kvr_net_read_full(sv[0], b, 4, kvr_net_deadline(TIMEOUT_MS), &got, &err),
                     KVR_ECLOSED);
    assert_int_equal(got, 0);
    close(sv[0]);
}

struct reader {
    int fd;
    uint8_t *buf;
    size_t n;
    int rc;
};

static void *reader_main(void *arg)
{
    struct reader *r = arg;
    r->rc = kvr_net_read_full(r->fd, r->buf, r->n, kvr_net_deadline(TIMEOUT_MS), NULL, NULL);
    return NULL;
}

/* Several megabytes through a socket buffer of a few hundred KB: partial writes happen and
 * must resume exactly where they stopped, iovec boundaries included. */
static void test_writev_full(void **state)
{
    (void)state;
    const size_t sizes[5] = {1, 3 << 20, 0, 12345, 1 << 20};
    size_t total = 0;
    for (int i = 0; i < 5; i++)
        total += sizes[i];
    uint8_t *src = malloc(total), *dst = malloc(total);
    assert_non_null(src);
    assert_non_null(dst);
    for (size_t i = 0; i < total; i++)
        src[i] = (uint8_t)(i * 131 + (i >> 13));
    struct iovec iov[5];
    size_t o = 0;
    for (int i = 0; i < 5; i++) {
        iov[i].iov_base = src + o;
        iov[i].iov_len = sizes[i];
        o += sizes[i];
    }
    int sv[2];
    socket_pair(sv);
    struct reader r = {.fd = sv[1], .buf = dst, .n = total};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, reader_main, &r), 0);
    struct kvr_err err = {0};
    assert_int_equal(kvr_net_writev_full(sv[0], iov, 5, kvr_net_deadline(TIMEOUT_MS), &err), 0);
    pthread_join(th, NULL);
    assert_int_equal(r.rc, 0);
    assert_memory_equal(src, dst, total);

    /* Nobody reads: the write times out instead of blocking forever. */
    iov[0].iov_base = src;
    iov[0].iov_len = total;
    assert_int_equal(kvr_net_writev_full(sv[0], iov, 1, kvr_net_deadline(50), &err), KVR_ETIMEDOUT);
    close(sv[1]);
    /* The peer is gone: EPIPE becomes KVR_ECLOSED, and no SIGPIPE kills the test. */
    assert_int_equal(kvr_net_writev_full(sv[0], iov, 1, kvr_net_deadline(TIMEOUT_MS), &err),
                     KVR_ECLOSED);
    close(sv[0]);
    free(src);
    free(dst);
}

/* ---- Handshake over TCP ---------------------------------------------------------------- */

struct server {
    int lfd;
    const struct kvr_plan *plan;
    enum kvr_auth_role role;
    uint32_t index;
    struct kvr_link link;
    int rc;
    struct kvr_err err;
};

static void *server_main(void *arg)
{
    struct server *s = arg;
    int fd = -1;
    char peer[128];
    struct kvr_wire_limits lim;
    s->rc = kvr_net_accept(s->lfd, kvr_net_deadline(TIMEOUT_MS), &fd, peer, sizeof peer, &s->err);
    if (s->rc)
        return NULL;
    int receiver = s->role == KVR_AUTH_ROLE_BRIDGE ? KVR_WIRE_RECV_BRIDGE : (int)s->index;
    if (kvr_wire_limits_init(&lim, s->plan, N_EMBD, N_VOCAB, receiver, &s->err)) {
        close(fd);
        s->rc = -100;
        return NULL;
    }
    s->rc = kvr_link_init(&s->link, fd, peer, &lim, KVR_LINK_RECV, &s->err);
    if (s->rc == 0)
        s->rc =
            kvr_link_handshake_server(&s->link, s->plan, s->role, s->index, TIMEOUT_MS, &s->err);
    return NULL;
}

struct pair {
    struct server srv;
    struct kvr_link client;
    int rc_client;
    struct kvr_err err_client;
};

/* The client (playing c_role/c_index with plan `pc`) connects to a server (s_role/s_index,
 * plan `ps`) over 127.0.0.1, and both run the handshake. */
static void connect_pair(struct pair *p, const struct kvr_plan *pc, enum kvr_auth_role c_role,
                         uint32_t c_index, const struct kvr_plan *ps, enum kvr_auth_role s_role,
                         uint32_t s_index)
{
    memset(p, 0, sizeof *p);
    p->client.fd = -1;
    uint16_t port = 0;
    struct kvr_err err = {0};
    assert_int_equal(kvr_net_listen("127.0.0.1:0", 4, &p->srv.lfd, &port, &err), 0);
    p->srv.plan = ps;
    p->srv.role = s_role;
    p->srv.index = s_index;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, server_main, &p->srv), 0);

    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    int fd = -1;
    assert_int_equal(kvr_net_connect(addr, kvr_net_deadline(TIMEOUT_MS), &fd, &err), 0);
    /* The client sends to the server: it uses the server's receiving limits. */
    struct kvr_wire_limits lim;
    limits_for(pc, s_role == KVR_AUTH_ROLE_BRIDGE ? KVR_WIRE_RECV_BRIDGE : (int)s_index, &lim);
    assert_int_equal(kvr_link_init(&p->client, fd, addr, &lim, KVR_LINK_SEND, &err), 0);
    p->rc_client =
        kvr_link_handshake_client(&p->client, pc, c_role, c_index, TIMEOUT_MS, &p->err_client);
    pthread_join(th, NULL);
    close(p->srv.lfd);
}

static void close_pair(struct pair *p)
{
    kvr_link_fini(&p->client);
    kvr_link_fini(&p->srv.link);
}

static void test_handshake_ok_and_frames(void **state)
{
    (void)state;
    make_plan(&plan);
    struct pair p;
    connect_pair(&p, &plan, KVR_AUTH_ROLE_STAGE, 0, &plan, KVR_AUTH_ROLE_STAGE, 1);
    if (p.rc_client || p.srv.rc)
        fail_msg("client %d \"%s\", server %d \"%s\"", p.rc_client, p.err_client.msg, p.srv.rc,
                 p.srv.err.msg);
    assert_true(p.client.authenticated);
    assert_true(p.srv.link.authenticated);
    assert_non_null(strstr(p.client.peer, "stage 1"));
    assert_non_null(strstr(p.srv.link.peer, "stage 0"));

    /* A BATCH of f32 rows, sent from the "activation buffer" and received intact. */
    struct kvr_seg segs[2] = {
        {.seq = 1, .pos0 = 0, .n_tokens = 3, .flags = KVR_SEG_PREFILL},
        {.seq = 2, .pos0 = 9, .n_tokens = 1, .flags = KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN}};
    struct kvr_wire_ctrl ctrl = {.type = KVR_WIRE_CTRL_FREE, .seq = 5};
    struct kvr_wire_timing tim = {.stage = 0, .held_ns = 123};
    float rows[4 * N_EMBD];
    for (int i = 0; i < 4 * N_EMBD; i++)
        rows[i] = (float)i / 3.0f;
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .batch_id = 42,
                             .ctrl = &ctrl,
                             .n_ctrl = 1,
                             .segs = segs,
                             .n_segs = 2,
                             .payload = KVR_WIRE_PAYLOAD_F32,
                             .payload_data = rows,
                             .payload_bytes = sizeof rows,
                             .timings = &tim,
                             .n_timings = 1};
    struct kvr_err err = {0};
    for (int k = 0; k < 3; k++) {
        m.batch_id = 42 + (uint64_t)k;
        assert_int_equal(kvr_link_send(&p.client, &m, kvr_net_deadline(TIMEOUT_MS), &err), 0);
    }
    assert_int_equal(kvr_link_send_heartbeat(&p.client, 7, kvr_net_deadline(TIMEOUT_MS), &err), 0);
    assert_int_equal(kvr_link_send_goodbye(&p.client, KVR_WIRE_GOODBYE_SHUTDOWN,
                                           kvr_net_deadline(TIMEOUT_MS), &err),
                     0);
    const struct kvr_wire_frame *f = NULL;
    for (int k = 0; k < 3; k++) {
        assert_int_equal(kvr_link_recv(&p.srv.link, kvr_net_deadline(TIMEOUT_MS), &f, &err), 0);
        assert_int_equal(f->hdr.type, KVR_WIRE_BATCH);
        assert_true(f->hdr.batch_id == 42 + (uint64_t)k);
        assert_memory_equal(f->segs, segs, sizeof segs);
        assert_int_equal(f->ctrl[0].seq, 5);
        assert_memory_equal(f->payload, rows, sizeof rows);
        assert_int_equal((uintptr_t)f->payload % 16, 0); /* usable in place as floats */
        assert_true(f->timings[0].held_ns == 123);
    }
    assert_int_equal(kvr_link_recv(&p.srv.link, kvr_net_deadline(TIMEOUT_MS), &f, &err), 0);
    assert_int_equal(f->hdr.type, KVR_WIRE_HEARTBEAT);
    assert_true(f->hdr.batch_id == 7);
    assert_int_equal(kvr_link_recv(&p.srv.link, kvr_net_deadline(TIMEOUT_MS), &f, &err), 0);
    assert_int_equal(f->hdr.type, KVR_WIRE_GOODBYE);
    assert_true(p.client.frames_out == 5 && p.srv.link.frames_in == 5);
    assert_true(p.client.bytes_out == p.srv.link.bytes_in);

    /* The client closes: the server sees an orderly end between frames. */
    kvr_link_fini(&p.client);
    assert_int_equal(kvr_link_recv(&p.srv.link, kvr_net_deadline(TIMEOUT_MS), &f, &err),
                     KVR_ECLOSED);
    assert_int_equal(kvr_link_recv(&p.srv.link, kvr_net_deadline(TIMEOUT_MS), &f, &err),
                     KVR_ECLOSED);
    close_pair(&p);

    /* The bridge's two links handshake too. */
    connect_pair(&p, &plan, KVR_AUTH_ROLE_BRIDGE, 0, &plan, KVR_AUTH_ROLE_STAGE, 0);
    assert_int_equal(p.rc_client | p.srv.rc, 0);
    close_pair(&p);
    connect_pair(&p, &plan, KVR_AUTH_ROLE_STAGE, 2, &plan, KVR_AUTH_ROLE_BRIDGE, 0);
    assert_int_equal(p.rc_client | p.srv.rc, 0);
    assert_non_null(strstr(p.srv.link.peer, "stage 2"));
    close_pair(&p);
}

static void expect_fail(int rc, const struct kvr_err *err, int want, const char *msg,
                        const char *who)
{
    if (rc != want || !strstr(err->msg, msg))
        fail_msg("%s: rc %d \"%s\", wanted %d \"%s\"", who, rc, err->msg, want, msg);
}

static void test_handshake_rejections(void **state)
{
    (void)state;
    struct pair p;
    struct kvr_err err = {0};
    const struct kvr_wire_frame *f;

    /* Wrong secret: both sides refuse, both say why. */
    make_plan(&plan);
    make_plan(&plan_other);
    plan_other.secret[0] ^= 1;
    connect_pair(&p, &plan, KVR_AUTH_ROLE_STAGE, 0, &plan_other, KVR_AUTH_ROLE_STAGE, 1);
    expect_fail(p.rc_client, &p.err_client, KVR_EAUTH, "wrong cluster secret?", "client");
    expect_fail(p.srv.rc, &p.srv.err, KVR_EAUTH, "wrong cluster secret?", "server");
    assert_true(p.client.broken && p.srv.link.broken);
    assert_false(p.client.authenticated || p.srv.link.authenticated);
    /* A broken link refuses to carry frames. */
    struct kvr_wire_msg hb = {.type = KVR_WIRE_HEARTBEAT};
    assert_int_equal(kvr_link_send(&p.client, &hb, kvr_net_deadline(TIMEOUT_MS), &err),
                     KVR_ECLOSED);
    assert_int_equal(kvr_link_recv(&p.srv.link, kvr_net_deadline(TIMEOUT_MS), &f, &err),
                     KVR_ECLOSED);
    close_pair(&p);

    /* Different plans. */
    make_plan(&plan_other);
    plan_other.n_ctx = 256;
    connect_pair(&p, &plan, KVR_AUTH_ROLE_STAGE, 0, &plan_other, KVR_AUTH_ROLE_STAGE, 1);
    expect_fail(p.srv.rc, &p.srv.err, KVR_EINVAL, "peer has plan hash", "server");
    expect_fail(p.rc_client, &p.err_client, KVR_EINVAL, "different plan hash", "client");
    close_pair(&p);

    /* Stage 2 dialing stage 1 (which expects stage 0 upstream). */
    connect_pair(&p, &plan, KVR_AUTH_ROLE_STAGE, 2, &plan, KVR_AUTH_ROLE_STAGE, 1);
    expect_fail(p.srv.rc, &p.srv.err, KVR_EINVAL,
                "expected stage 0 on this link, but the peer says it is stage 2", "server");
    expect_fail(p.rc_client, &p.err_client, KVR_EINVAL, "wrong role or stage index", "client");
    close_pair(&p);
}

/* Something that is not a Kvasir peer connects (e.g. a port scanner or HTTP client). */
static void test_handshake_garbage_and_timeout(void **state)
{
    (void)state;
    make_plan(&plan);
    int sv[2];
    struct kvr_err err = {0};
    struct kvr_wire_limits lim;
    limits_for(&plan, 1, &lim);
    socket_pair(sv);
    struct kvr_link link;
    assert_int_equal(kvr_link_init(&link, sv[0], "scanner", &lim, KVR_LINK_RECV, &err), 0);
    char junk[KVR_AUTH_MSG_BYTES];
    memset(junk, 'x', sizeof junk);
    memcpy(junk, "GET / HTTP/1.1\r\n", 16);
    assert_int_equal(write(sv[1], junk, sizeof junk), (ssize_t)sizeof junk);
    assert_int_equal(
        kvr_link_handshake_server(&link, &plan, KVR_AUTH_ROLE_STAGE, 1, TIMEOUT_MS, &err),
        KVR_EPROTO);
    assert_non_null(strstr(err.msg, "not a Kvasir handshake"));
    kvr_link_fini(&link);
    close(sv[1]);

    /* A peer that connects and says nothing is dropped at the deadline. */
    socket_pair(sv);
    assert_int_equal(kvr_link_init(&link, sv[0], "silent", &lim, KVR_LINK_RECV, &err), 0);
    assert_int_equal(kvr_link_handshake_server(&link, &plan, KVR_AUTH_ROLE_STAGE, 1, 50, &err),
                     KVR_ETIMEDOUT);
    assert_true(link.broken);
    kvr_link_fini(&link);
    close(sv[1]);
}

/* Both ends in steps on one thread (as two event loops would run them): no step waits for
 * the peer, the two reach an authenticated link, and a frame goes through it. A peer that
 * sends nothing leaves the server's step returning at once. */
static void test_handshake_in_steps(void **state)
{
    (void)state;
    make_plan(&plan);
    int sv[2];
    struct kvr_err err = {0};
    struct kvr_wire_limits lim;
    limits_for(&plan, 1, &lim);
    socket_pair(sv);
    struct kvr_link srv, cli;
    assert_int_equal(kvr_link_init(&srv, sv[0], "upstream", &lim, KVR_LINK_RECV, &err), 0);
    assert_int_equal(kvr_link_init(&cli, sv[1], "downstream", &lim, KVR_LINK_SEND, &err), 0);
    struct kvr_link_hs hs_srv, hs_cli;
    assert_int_equal(kvr_link_hs_begin(&srv, &hs_srv, &plan, KVR_AUTH_ROLE_STAGE, 1, false, &err),
                     0);
    uint64_t t0 = kvr_now_ns();
    assert_int_equal(kvr_link_hs_step(&srv, &hs_srv, &err), KVR_EAGAIN); /* nothing yet */
    assert_true(kvr_now_ns() - t0 < 100 * 1000000ull);
    assert_false(hs_srv.want_write);
    assert_int_equal(kvr_link_hs_begin(&cli, &hs_cli, &plan, KVR_AUTH_ROLE_STAGE, 0, true, &err),
                     0);
    int rc_srv = KVR_EAGAIN, rc_cli = KVR_EAGAIN, turns = 0;
    while ((rc_srv == KVR_EAGAIN || rc_cli == KVR_EAGAIN) && turns++ < 16) {
        if (rc_cli == KVR_EAGAIN)
            rc_cli = kvr_link_hs_step(&cli, &hs_cli, &err);
        if (rc_srv == KVR_EAGAIN)
            rc_srv = kvr_link_hs_step(&srv, &hs_srv, &err);
    }
    if (rc_srv || rc_cli)
        fail_msg("server %d, client %d: %s", rc_srv, rc_cli, err.msg);
    assert_true(turns <= 4); /* hello, reply, proof, verdict */
    assert_true(srv.authenticated && cli.authenticated);
    assert_non_null(strstr(srv.peer, "stage 0"));
    assert_true(hs_srv.progress == 4 && hs_cli.progress == 4);
    assert_int_equal(kvr_link_send_heartbeat(&cli, 9, kvr_net_deadline(TIMEOUT_MS), &err), 0);
    const struct kvr_wire_frame *f = NULL;
    assert_int_equal(kvr_link_recv(&srv, kvr_net_deadline(TIMEOUT_MS), &f, &err), 0);
    assert_int_equal(f->hdr.type, KVR_WIRE_HEARTBEAT);
    assert_true(f->hdr.batch_id == 9);
    kvr_link_fini(&srv);
    kvr_link_fini(&cli);

    /* A wrong secret in steps: the server refuses (its VERDICT is tried once), and the
     * client hears why. */
    plan_other = plan;
    plan_other.secret[0] ^= 1;
    socket_pair(sv);
    assert_int_equal(kvr_link_init(&srv, sv[0], "upstream", &lim, KVR_LINK_RECV, &err), 0);
    assert_int_equal(kvr_link_init(&cli, sv[1], "downstream", &lim, KVR_LINK_SEND, &err), 0);
    struct kvr_err err_cli = {0};
    assert_int_equal(kvr_link_hs_begin(&srv, &hs_srv, &plan, KVR_AUTH_ROLE_STAGE, 1, false, &err),
                     0);
    assert_int_equal(
        kvr_link_hs_begin(&cli, &hs_cli, &plan_other, KVR_AUTH_ROLE_STAGE, 0, true, &err_cli), 0);
    rc_srv = rc_cli = KVR_EAGAIN;
    for (turns = 0; (rc_srv == KVR_EAGAIN || rc_cli == KVR_EAGAIN) && turns < 16; turns++) {
        if (rc_cli == KVR_EAGAIN)
            rc_cli = kvr_link_hs_step(&cli, &hs_cli, &err_cli);
        if (rc_srv == KVR_EAGAIN)
            rc_srv = kvr_link_hs_step(&srv, &hs_srv, &err);
    }
    expect_fail(rc_srv, &err, KVR_EAUTH, "wrong cluster secret?", "server");
    expect_fail(rc_cli, &err_cli, KVR_EAUTH, "wrong cluster secret?", "client");
    assert_true(srv.broken && !srv.authenticated && !cli.authenticated);
    assert_false(hs_srv.active || hs_cli.active);
    kvr_link_fini(&srv);
    kvr_link_fini(&cli);
}

/* ---- Broken frames --------------------------------------------------------------------- */

/* A receiving link for stage 1 on sv[0]; the test writes raw bytes into sv[1]. */
static void raw_link(struct kvr_link *link, int sv[2])
{
    struct kvr_wire_limits lim;
    struct kvr_err err = {0};
    limits_for(&plan, 1, &lim);
    socket_pair(sv);
    assert_int_equal(kvr_link_init(link, sv[0], "raw peer", &lim, KVR_LINK_RECV, &err), 0);
}

static uint8_t frame_buf[1 << 16];

/* A valid f32 BATCH for stage 1 with `rows` rows in one prefill segment. */
static size_t encode_batch(uint32_t rows)
{
    static float data[64 * N_EMBD];
    struct kvr_seg seg = {.seq = 0, .pos0 = 0, .n_tokens = rows, .flags = KVR_SEG_PREFILL};
    struct kvr_wire_timing tim = {.stage = 0};
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .segs = &seg,
                             .n_segs = 1,
                             .payload = KVR_WIRE_PAYLOAD_F32,
                             .payload_data = data,
                             .payload_bytes = (size_t)rows * N_EMBD * 4,
                             .timings = &tim,
                             .n_timings = 1};
    size_t n = 0;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_encode_flat(&m, frame_buf, sizeof frame_buf, &n, &err), 0);
    return n;
}

/* Run fn with stderr captured into `out` (the link logs why it closes). */
static void capture_stderr(void (*fn)(void *), void *arg, char *out, size_t cap)
{
    char path[] = "/tmp/kvr_test_net_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    fn(arg);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    ssize_t n = pread(fd, out, cap - 1, 0);
    out[n > 0 ? n : 0] = 0;
    close(fd);
    unlink(path);
}

struct recv_call {
    struct kvr_link *link;
    int rc;
    struct kvr_err err;
};

static void do_recv(void *arg)
{
    struct recv_call *c = arg;
    const struct kvr_wire_frame *f;
    c->rc = kvr_link_recv(c->link, kvr_net_deadline(TIMEOUT_MS), &f, &c->err);
}

static void test_frame_over_the_limit(void **state)
{
    (void)state;
    make_plan(&plan);
    struct kvr_link link;
    int sv[2];
    raw_link(&link, sv);
    /* 17 rows: one more than the plan's row_width. The encoder does not know the plan. */
    size_t n = encode_batch(17);
    assert_int_equal(write(sv[1], frame_buf, n), (ssize_t)n);
    struct recv_call c = {.link = &link};
    char log[2048];
    capture_stderr(do_recv, &c, log, sizeof log);
    expect_fail(c.rc, &c.err, KVR_EPROTO, "17 rows; the plan's row_width is 16", "recv");
    assert_non_null(strstr(log, "closing"));
    assert_non_null(strstr(log, "row_width"));
    assert_true(link.broken);
    assert_int_equal(link.body_have, 0); /* refused before reading any of the body */
    /* The socket is shut down: the peer sees it. */
    char b;
    assert_int_equal(read(sv[1], &b, 1), 0);
    kvr_link_fini(&link);
    close(sv[1]);
}

/* Every cut of a valid frame, then the peer closes: ECLOSED when nothing was sent,
 * EPROTO with a reason otherwise, never a crash or a hang. */
static void test_truncated_frames(void **state)
{
    (void)state;
    make_plan(&plan);
    kvr_log_set_level(KVR_LOG_ERROR); /* one warning per cut would flood the output */
    size_t n = encode_batch(3);
    static uint8_t copy[1 << 16];
    memcpy(copy, frame_buf, n);
    for (size_t cut = 0; cut < n; cut++) {
        struct kvr_link link;
        int sv[2];
        raw_link(&link, sv);
        if (cut)
            assert_int_equal(write(sv[1], copy, cut), (ssize_t)cut);
        close(sv[1]);
        const struct kvr_wire_frame *f;
        struct kvr_err err = {0};
        int rc = kvr_link_recv(&link, kvr_net_deadline(TIMEOUT_MS), &f, &err);
        if (cut == 0)
            expect_fail(rc, &err, KVR_ECLOSED, "closed", "cut 0");
        else if (cut < KVR_WIRE_HEADER_BYTES)
            expect_fail(rc, &err, KVR_EPROTO, "inside a frame header", "header cut");
        else
            expect_fail(rc, &err, KVR_EPROTO, "inside a BATCH frame", "body cut");
        kvr_link_fini(&link);
    }
    kvr_log_set_level(KVR_LOG_INFO);
}

/* A deadline in the middle of a frame keeps what was read; the next call completes it. */
static void test_resume_after_timeout(void **state)
{
    (void)state;
    make_plan(&plan);
    struct kvr_link link;
    int sv[2];
    raw_link(&link, sv);
    size_t n = encode_batch(5);
    const struct kvr_wire_frame *f;
    struct kvr_err err = {0};
    size_t cuts[3] = {7, KVR_WIRE_HEADER_BYTES + 50, n};
    size_t sent = 0;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(write(sv[1], frame_buf + sent, cuts[i] - sent), (ssize_t)(cuts[i] - sent));
        sent = cuts[i];
        int rc = kvr_link_recv(&link, kvr_net_deadline(20), &f, &err);
        if (i < 2) {
            assert_int_equal(rc, KVR_ETIMEDOUT);
            assert_false(link.broken);
        } else {
            assert_int_equal(rc, 0);
            assert_int_equal(f->hdr.n_rows, 5);
        }
    }
    /* And the link goes on with the next frame. */
    assert_int_equal(write(sv[1], frame_buf, n), (ssize_t)n);
    assert_int_equal(kvr_link_recv(&link, kvr_net_deadline(TIMEOUT_MS), &f, &err), 0);
    /* A corrupt header (bad checksum) breaks it. */
    frame_buf[20] ^= 1;
    assert_int_equal(write(sv[1], frame_buf, n), (ssize_t)n);
    struct recv_call c = {.link = &link};
    char log[2048];
    capture_stderr(do_recv, &c, log, sizeof log);
    expect_fail(c.rc, &c.err, KVR_EPROTO, "checksum", "corrupt header");
    kvr_link_fini(&link);
    close(sv[1]);
}

static void test_send_to_vanished_peer(void **state)
{
    (void)state;
    make_plan(&plan);
    int sv[2];
    socket_pair(sv);
    struct kvr_wire_limits lim;
    limits_for(&plan, 1, &lim);
    struct kvr_link link;
    struct kvr_err err = {0};
    assert_int_equal(kvr_link_init(&link, sv[0], "gone", &lim, KVR_LINK_SEND, &err), 0);
    close(sv[1]);
    struct kvr_wire_msg hb = {.type = KVR_WIRE_HEARTBEAT};
    assert_int_equal(kvr_link_send(&link, &hb, kvr_net_deadline(TIMEOUT_MS), &err), KVR_ECLOSED);
    assert_true(link.broken);
    assert_non_null(strstr(err.msg, "HEARTBEAT"));
    /* A link set up only for sending cannot receive (and vice versa). */
    const struct kvr_wire_frame *f;
    link.broken = false;
    assert_int_equal(kvr_link_recv(&link, kvr_net_deadline(10), &f, &err), KVR_EINVAL);
    kvr_link_fini(&link);
    /* fini is safe twice, and on a zeroed link. */
    kvr_link_fini(&link);
    struct kvr_link zero;
    memset(&zero, 0, sizeof zero);
    kvr_link_fini(&zero);
}

/* ---- The dialler ------------------------------------------------------------------------ */

/* A peer that restarts is refused for a while, then listens: the dialler links to it within
 * moments of its listening, not on the next step of a doubling backoff (which, after a
 * second of refusals, would wait about half a second more). */
static void test_dialer_refused_then_listening(void **state)
{
    (void)state;
    make_plan(&plan);
    struct kvr_err err = {0};
    int lfd = -1;
    uint16_t port = 0;
    assert_int_equal(kvr_net_listen("127.0.0.1:0", 4, &lfd, &port, &err), 0);
    close(lfd); /* a port nobody listens on: connecting is refused */
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    struct kvr_wire_limits lim;
    limits_for(&plan, 1, &lim);
    struct kvr_dialer_config dc = {.plan = &plan,
                                   .addr = addr,
                                   .limits = &lim,
                                   .role = KVR_AUTH_ROLE_STAGE,
                                   .index = 0,
                                   .name = "stage 0",
                                   .handshake_ms = TIMEOUT_MS,
                                   .backoff_max_ms = 2000};
    struct kvr_dialer *d = NULL;
    assert_int_equal(kvr_dialer_start(&d, &dc, &err), 0);
    usleep(1000 * 1000);
    struct kvr_link link;
    assert_false(kvr_dialer_take(d, &link));
    char why[KVR_ERR_MSG_BYTES];
    kvr_dialer_last_error(d, why, sizeof why);
    assert_non_null(strstr(why, "refused"));

    struct server srv = {.plan = &plan, .role = KVR_AUTH_ROLE_STAGE, .index = 1};
    assert_int_equal(kvr_net_listen(addr, 4, &srv.lfd, NULL, &err), 0);
    uint64_t t0 = kvr_now_ns();
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, server_main, &srv), 0);
    bool have = false;
    while (!(have = kvr_dialer_take(d, &link)) && kvr_now_ns() - t0 < TIMEOUT_MS * 1000000ull)
        usleep(1000);
    uint64_t took_ms = (kvr_now_ns() - t0) / 1000000u;
    pthread_join(th, NULL);
    close(srv.lfd);
    assert_true(have);
    assert_int_equal(srv.rc, 0);
    if (took_ms >= 250)
        fail_msg("linked %llu ms after the peer listened", (unsigned long long)took_ms);
    kvr_link_fini(&link);
    kvr_link_fini(&srv.link);
    kvr_dialer_stop(d);
}

int main(void)
{
    /* Fix the level before any thread logs. */
    kvr_log_set_level(KVR_LOG_INFO);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_addr),
        cmocka_unit_test(test_listen_accept_connect),
        cmocka_unit_test(test_read_full),
        cmocka_unit_test(test_writev_full),
        cmocka_unit_test(test_handshake_ok_and_frames),
        cmocka_unit_test(test_handshake_rejections),
        cmocka_unit_test(test_handshake_garbage_and_timeout),
        cmocka_unit_test(test_handshake_in_steps),
        cmocka_unit_test(test_frame_over_the_limit),
        cmocka_unit_test(test_truncated_frames),
        cmocka_unit_test(test_resume_after_timeout),
        cmocka_unit_test(test_send_to_vanished_peer),
        cmocka_unit_test(test_dialer_refused_then_listening),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
