/* test_seal.c - sealed frames: the pure module (seal.h) against libsodium's one-shot AEAD,
 * every way of cutting a frame into pieces, each single-byte alteration, replay, reordering,
 * the wrong key; then sealed links (net.h) over 127.0.0.1, where frames are replayed and
 * altered on the wire by hand and the receiver must refuse them with a reason. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/rng.h"
#include "ring/auth.h"
#include "ring/net.h"
#include "ring/plan.h"
#include "ring/seal.h"
#include "ring/wire.h"

#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define FRAME_MAX 600

static const uint8_t KEY[KVR_SEAL_KEY_BYTES] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};

static void fill(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)kvr_splitmix64(&s);
}

static void nonce_of(uint64_t r, uint8_t n[12])
{
    memset(n, 0, 12);
    for (int i = 0; i < 8; i++)
        n[i] = (uint8_t)(r >> (8 * i));
}

/* Seal `frame` (n bytes) cut at the given points into pieces. */
static size_t seal_cut(struct kvr_seal *s, const uint8_t *frame, size_t n, const size_t *cuts,
                       int n_cuts, uint8_t *out)
{
    struct iovec iov[16];
    size_t at = 0;
    int k = 0;
    for (int i = 0; i < n_cuts; i++) {
        iov[k++] = (struct iovec){(void *)(frame + at), cuts[i] - at};
        at = cuts[i];
    }
    iov[k++] = (struct iovec){(void *)(frame + at), n - at};
    size_t got = 0;
    struct kvr_err err = {0};
    if (kvr_seal_frame(s, iov, k, n, out, kvr_seal_frame_bytes(n), &got, &err))
        fail_msg("seal: %s", err.msg);
    assert_int_equal(got, kvr_seal_frame_bytes(n));
    return got;
}

/* The sealed bytes are exactly RFC 8439's AEAD of header and body, records 0 and 1. */
static void test_matches_libsodium(void **state)
{
    (void)state;
    assert_true(sodium_init() >= 0);
    for (size_t body = 0; body < 300; body += 37) {
        uint8_t frame[FRAME_MAX], out[FRAME_MAX + 32], want[FRAME_MAX + 32], nonce[12];
        size_t n = KVR_SEAL_HEADER_BYTES + body;
        fill(frame, n, body);
        struct kvr_seal s;
        kvr_seal_init(&s, KEY);
        size_t cuts[] = {KVR_SEAL_HEADER_BYTES};
        size_t got = seal_cut(&s, frame, n, cuts, 0, out);
        nonce_of(0, nonce);
        crypto_aead_chacha20poly1305_ietf_encrypt_detached(want, want + 40, NULL, frame, 40, NULL,
                                                           0, NULL, nonce, KEY);
        if (body) {
            nonce_of(1, nonce);
            crypto_aead_chacha20poly1305_ietf_encrypt_detached(
                want + 56, want + 56 + body, NULL, frame + 40, body, NULL, 0, NULL, nonce, KEY);
        }
        assert_int_equal(got, body ? n + 32 : n + 16);
        assert_memory_equal(out, want, got);
        assert_int_equal(s.next, body ? 2 : 1);
        kvr_seal_wipe(&s);
    }
}

/* However the frame is cut into iovecs (as kvr_wire_encode cuts it: header and records,
 * payload, timings; at any byte, inside a 64-byte block or on its edge), the sealed bytes
 * are the same, and they open back to the frame. */
static void test_any_cut(void **state)
{
    (void)state;
    uint64_t rng = 42;
    uint8_t frame[FRAME_MAX], ref[FRAME_MAX + 32], out[FRAME_MAX + 32];
    for (int trial = 0; trial < 400; trial++) {
        size_t n = KVR_SEAL_HEADER_BYTES + kvr_splitmix64(&rng) % (FRAME_MAX - 40);
        fill(frame, n, (uint64_t)trial);
        struct kvr_seal a, b, r;
        kvr_seal_init(&a, KEY);
        kvr_seal_init(&b, KEY);
        size_t got = seal_cut(&a, frame, n, NULL, 0, ref);
        int n_cuts = (int)(kvr_splitmix64(&rng) % 15);
        size_t cuts[15];
        for (int i = 0; i < n_cuts; i++)
            cuts[i] = kvr_splitmix64(&rng) % (n + 1);
        for (int i = 1; i < n_cuts; i++) /* sort: pieces in order, some empty */
            for (int j = i; j > 0 && cuts[j - 1] > cuts[j]; j--) {
                size_t t = cuts[j];
                cuts[j] = cuts[j - 1];
                cuts[j - 1] = t;
            }
        assert_int_equal(seal_cut(&b, frame, n, cuts, n_cuts, out), got);
        assert_memory_equal(out, ref, got);
        /* Open it. */
        kvr_seal_init(&r, KEY);
        struct kvr_err err = {0};
        assert_int_equal(kvr_seal_open_header(&r, out, &err), 0);
        assert_memory_equal(out, frame, 40);
        if (n > 40) {
            assert_int_equal(kvr_seal_open_body(&r, out + 56, n - 40, &err), 0);
            assert_memory_equal(out + 56, frame + 40, n - 40);
        }
    }
}

/* Flip each bit position's byte of a sealed frame in turn: the record it falls in fails to
 * open, with a message that says why, and the seal refuses everything afterwards. */
static void test_every_byte_altered(void **state)
{
    (void)state;
    uint8_t frame[200], sealed[232], copy[232];
    fill(frame, sizeof frame, 7);
    struct kvr_seal s;
    kvr_seal_init(&s, KEY);
    size_t n = seal_cut(&s, frame, sizeof frame, NULL, 0, sealed);
    for (size_t i = 0; i < n; i++) {
        memcpy(copy, sealed, n);
        copy[i] ^= (uint8_t)(1u << (i % 8));
        struct kvr_seal r;
        kvr_seal_init(&r, KEY);
        struct kvr_err err = {0};
        int rh = kvr_seal_open_header(&r, copy, &err);
        if (i < KVR_SEAL_SEALED_HEADER_BYTES) {
            assert_int_equal(rh, KVR_EAUTH);
            assert_non_null(strstr(err.msg, "frame header (record 0, 40 bytes) failed "
                                            "authentication"));
            assert_int_equal(kvr_seal_open_body(&r, copy + 56, 160, &err), KVR_EAUTH);
            continue;
        }
        assert_int_equal(rh, 0);
        assert_int_equal(kvr_seal_open_body(&r, copy + 56, 160, &err), KVR_EAUTH);
        assert_non_null(strstr(err.msg, "frame body (record 1, 160 bytes) failed"));
        assert_non_null(strstr(err.msg, "altered, replayed, reordered or forged"));
    }
}

/* Record numbers are implicit: a frame opened twice, two frames swapped, a frame dropped, or
 * a frame sealed for the other direction (other key) all fail. */
static void test_replay_reorder_drop_key(void **state)
{
    (void)state;
    uint8_t f1[100], f2[100], s1[132], s2[132], c[132];
    fill(f1, sizeof f1, 1);
    fill(f2, sizeof f2, 2);
    struct kvr_seal tx, rx;
    kvr_seal_init(&tx, KEY);
    seal_cut(&tx, f1, sizeof f1, NULL, 0, s1);
    seal_cut(&tx, f2, sizeof f2, NULL, 0, s2);
    struct kvr_err err = {0};

    kvr_seal_init(&rx, KEY); /* in order: fine */
    memcpy(c, s1, sizeof c);
    assert_int_equal(kvr_seal_open_header(&rx, c, &err) | kvr_seal_open_body(&rx, c + 56, 60, &err),
                     0);
    memcpy(c, s2, sizeof c);
    assert_int_equal(kvr_seal_open_header(&rx, c, &err) | kvr_seal_open_body(&rx, c + 56, 60, &err),
                     0);
    assert_memory_equal(c + 56, f2 + 40, 60);

    kvr_seal_init(&rx, KEY); /* replayed */
    memcpy(c, s1, sizeof c);
    assert_int_equal(kvr_seal_open_header(&rx, c, &err) | kvr_seal_open_body(&rx, c + 56, 60, &err),
                     0);
    memcpy(c, s1, sizeof c);
    assert_int_equal(kvr_seal_open_header(&rx, c, &err), KVR_EAUTH);

    kvr_seal_init(&rx, KEY); /* reordered, or the first one dropped */
    memcpy(c, s2, sizeof c);
    assert_int_equal(kvr_seal_open_header(&rx, c, &err), KVR_EAUTH);
    assert_true(rx.failed);
    memcpy(c, s1, sizeof c); /* a dead seal opens nothing, even the right frame */
    assert_int_equal(kvr_seal_open_header(&rx, c, &err), KVR_EAUTH);

    uint8_t other[KVR_SEAL_KEY_BYTES];
    memcpy(other, KEY, sizeof other);
    other[31] ^= 0x80;
    kvr_seal_init(&rx, other);
    memcpy(c, s1, sizeof c);
    assert_int_equal(kvr_seal_open_header(&rx, c, &err), KVR_EAUTH);
    kvr_seal_wipe(&rx);
    for (size_t i = 0; i < sizeof rx.key; i++)
        assert_int_equal(rx.key[i], 0);
}

/* Inconsistent sizes are refused before any record number is used. */
static void test_bad_sizes(void **state)
{
    (void)state;
    uint8_t frame[100], out[200];
    struct kvr_seal s;
    kvr_seal_init(&s, KEY);
    struct kvr_err err = {0};
    size_t got = 0;
    struct iovec iov = {frame, sizeof frame};
    assert_int_equal(kvr_seal_frame(&s, &iov, 1, 99, out, sizeof out, &got, &err), KVR_EINVAL);
    assert_int_equal(kvr_seal_frame(&s, &iov, 1, 100, out, 131, &got, &err), KVR_EINVAL);
    struct iovec shorty = {frame, 39};
    assert_int_equal(kvr_seal_frame(&s, &shorty, 1, 39, out, sizeof out, &got, &err), KVR_EINVAL);
    assert_int_equal(kvr_seal_frame(&s, &iov, 0, 100, out, sizeof out, &got, &err), KVR_EINVAL);
    assert_int_equal(s.next, 0);
    assert_int_equal(kvr_seal_frame(&s, &iov, 1, 100, out, 132, &got, &err), 0);
    assert_int_equal(kvr_seal_open_body(&s, out, 0, &err), KVR_EINVAL);
}

/* ---- Sealed links over 127.0.0.1 -------------------------------------------------------- */

#define N_EMBD 8
#define N_VOCAB 100
#define TIMEOUT_MS 5000

static struct kvr_plan plan;

static void make_plan(struct kvr_plan *p, bool encrypt)
{
    memset(p, 0, sizeof *p);
    strcpy(p->model_path, "m.gguf");
    p->n_stages = 2;
    for (uint32_t i = 0; i < 2; i++) {
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
    p->encrypt = encrypt;
    p->secret_bytes = 16;
    memcpy(p->secret, "0123456789abcdef", 16);
    struct kvr_err err = {0};
    if (kvr_plan_validate(p, 2, &err))
        fail_msg("plan: %s", err.msg);
}

struct server {
    int lfd, rc;
    struct kvr_link link;
    struct kvr_err err;
};

static void *server_main(void *arg)
{
    struct server *s = arg;
    int fd = -1;
    struct kvr_wire_limits lim;
    if ((s->rc = kvr_net_accept(s->lfd, kvr_net_deadline(TIMEOUT_MS), &fd, NULL, 0, &s->err)))
        return NULL;
    if ((s->rc = kvr_wire_limits_init(&lim, &plan, N_EMBD, N_VOCAB, 1, &s->err))) {
        close(fd);
        return NULL;
    }
    if ((s->rc = kvr_link_init(&s->link, fd, "client", &lim, KVR_LINK_RECV, &s->err)) == 0)
        s->rc =
            kvr_link_handshake_server(&s->link, &plan, KVR_AUTH_ROLE_STAGE, 1, TIMEOUT_MS, &s->err);
    return NULL;
}

/* Stage 0 (client) connects to stage 1 (server) and both handshake. */
static void connect_pair(struct kvr_link *client, struct server *srv)
{
    memset(srv, 0, sizeof *srv);
    uint16_t port = 0;
    struct kvr_err err = {0};
    assert_int_equal(kvr_net_listen("127.0.0.1:0", 4, &srv->lfd, &port, &err), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, server_main, srv), 0);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    int fd = -1;
    struct kvr_wire_limits lim;
    assert_int_equal(kvr_net_connect(addr, kvr_net_deadline(TIMEOUT_MS), &fd, &err), 0);
    assert_int_equal(kvr_wire_limits_init(&lim, &plan, N_EMBD, N_VOCAB, 1, &err), 0);
    assert_int_equal(kvr_link_init(client, fd, addr, &lim, KVR_LINK_SEND, &err), 0);
    int rc = kvr_link_handshake_client(client, &plan, KVR_AUTH_ROLE_STAGE, 0, TIMEOUT_MS, &err);
    pthread_join(th, NULL);
    close(srv->lfd);
    if (rc || srv->rc)
        fail_msg("handshake: client %d \"%s\", server %d \"%s\"", rc, err.msg, srv->rc,
                 srv->err.msg);
}

/* A BATCH of two f32 rows with one control record and one timing record. */
static void send_batch(struct kvr_link *l, uint64_t id, const float *rows)
{
    struct kvr_seg seg = {.seq = 1, .pos0 = 0, .n_tokens = 2, .flags = KVR_SEG_PREFILL};
    struct kvr_wire_ctrl ctrl = {.type = KVR_WIRE_CTRL_FREE, .seq = 5};
    struct kvr_wire_timing tim = {.stage = 0, .held_ns = 77};
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .batch_id = id,
                             .ctrl = &ctrl,
                             .n_ctrl = 1,
                             .segs = &seg,
                             .n_segs = 1,
                             .payload = KVR_WIRE_PAYLOAD_F32,
                             .payload_data = rows,
                             .payload_bytes = 2 * N_EMBD * sizeof(float),
                             .timings = &tim,
                             .n_timings = 1};
    struct kvr_err err = {0};
    if (kvr_link_send(l, &m, kvr_net_deadline(TIMEOUT_MS), &err))
        fail_msg("send: %s", err.msg);
}

static size_t batch_wire_bytes(bool sealed)
{
    size_t plain = KVR_WIRE_HEADER_BYTES + KVR_WIRE_CTRL_BYTES + KVR_WIRE_SEG_BYTES +
                   2 * N_EMBD * sizeof(float) + KVR_WIRE_TIMING_BYTES;
    return sealed ? kvr_seal_frame_bytes(plain) : plain;
}

/* Take the next `n` bytes off the receiver's socket, as an attacker on the path would. */
static void grab(struct server *srv, uint8_t *buf, size_t n)
{
    struct kvr_err err = {0};
    assert_int_equal(
        kvr_net_read_full(srv->link.fd, buf, n, kvr_net_deadline(TIMEOUT_MS), NULL, &err), 0);
}

/* ... and put bytes on the wire toward it, from the sender's socket. */
static void inject(struct kvr_link *client, const uint8_t *buf, size_t n)
{
    struct kvr_err err = {0};
    struct iovec iov = {(void *)buf, n};
    assert_int_equal(kvr_net_writev_full(client->fd, &iov, 1, kvr_net_deadline(TIMEOUT_MS), &err),
                     0);
}

static void recv_ok(struct server *srv, uint64_t id, const float *rows)
{
    const struct kvr_wire_frame *f = NULL;
    struct kvr_err err = {0};
    if (kvr_link_recv(&srv->link, kvr_net_deadline(TIMEOUT_MS), &f, &err))
        fail_msg("recv: %s", err.msg);
    assert_int_equal(f->hdr.type, KVR_WIRE_BATCH);
    assert_true(f->hdr.batch_id == id);
    assert_int_equal(f->hdr.n_ctrl, 1);
    assert_int_equal(f->timings[0].held_ns, 77);
    assert_memory_equal(f->payload, rows, 2 * N_EMBD * sizeof(float));
}

static void recv_refused(struct server *srv, const char *want)
{
    const struct kvr_wire_frame *f = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_link_recv(&srv->link, kvr_net_deadline(TIMEOUT_MS), &f, &err), KVR_EPROTO);
    if (!strstr(err.msg, want))
        fail_msg("refusal says \"%s\", wanted \"%s\"", err.msg, want);
    assert_true(srv->link.broken);
}

/* Sealed frames arrive intact; on the wire they are not the plain frame; heartbeats (no
 * body) are sealed too; a frame replayed, or altered in one byte, closes the link. */
static void test_sealed_link(void **state)
{
    (void)state;
    float rows[2 * N_EMBD];
    for (int i = 0; i < 2 * N_EMBD; i++)
        rows[i] = (float)i * 0.25f;
    make_plan(&plan, true);
    struct kvr_link client = {.fd = -1};
    struct server srv;
    connect_pair(&client, &srv);
    assert_true(client.sealed && srv.link.sealed);

    send_batch(&client, 1, rows);
    recv_ok(&srv, 1, rows);
    struct kvr_err err = {0};
    assert_int_equal(kvr_link_send_heartbeat(&client, 9, kvr_net_deadline(TIMEOUT_MS), &err), 0);
    const struct kvr_wire_frame *f = NULL;
    assert_int_equal(kvr_link_recv(&srv.link, kvr_net_deadline(TIMEOUT_MS), &f, &err), 0);
    assert_int_equal(f->hdr.type, KVR_WIRE_HEARTBEAT);
    assert_int_equal(srv.link.bytes_in, batch_wire_bytes(true) + KVR_SEAL_SEALED_HEADER_BYTES);

    /* What goes on the wire: neither the frame magic nor the rows in the clear. */
    uint8_t wire[512];
    size_t n = batch_wire_bytes(true);
    send_batch(&client, 2, rows);
    grab(&srv, wire, n);
    assert_memory_not_equal(wire, "KVFR", 4);
    for (size_t o = 0; o + 16 <= n; o++)
        assert_memory_not_equal(wire + o, rows + 1, 16);
    inject(&client, wire, n); /* passed on unchanged: accepted */
    recv_ok(&srv, 2, rows);
    inject(&client, wire, n); /* the same bytes again: a replay */
    recv_refused(&srv, "failed authentication");
    kvr_link_fini(&client);
    kvr_link_fini(&srv.link);

    /* One byte of the body altered on the way: refused, and the reason names the link. */
    connect_pair(&client, &srv);
    send_batch(&client, 3, rows);
    grab(&srv, wire, n);
    wire[KVR_SEAL_SEALED_HEADER_BYTES + 70] ^= 0x01;
    inject(&client, wire, n);
    recv_refused(&srv, "frame body (record 1");
    kvr_link_fini(&client);
    kvr_link_fini(&srv.link);

    /* One byte of the header: refused before its lengths are believed. */
    connect_pair(&client, &srv);
    send_batch(&client, 4, rows);
    grab(&srv, wire, n);
    wire[20] ^= 0x40;
    inject(&client, wire, n);
    recv_refused(&srv, "frame header (record 0");
    kvr_link_fini(&client);
    kvr_link_fini(&srv.link);
}

/* With "encrypt": false the frame goes as before, byte for byte the plain encoding. */
static void test_plain_link(void **state)
{
    (void)state;
    float rows[2 * N_EMBD] = {1.5f};
    make_plan(&plan, false);
    struct kvr_link client = {.fd = -1};
    struct server srv;
    connect_pair(&client, &srv);
    assert_false(client.sealed || srv.link.sealed);
    uint8_t wire[512];
    size_t n = batch_wire_bytes(false);
    send_batch(&client, 5, rows);
    grab(&srv, wire, n);
    assert_memory_equal(wire, "KVFR", 4);
    inject(&client, wire, n);
    recv_ok(&srv, 5, rows);
    kvr_link_fini(&client);
    kvr_link_fini(&srv.link);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_libsodium),  cmocka_unit_test(test_any_cut),
        cmocka_unit_test(test_every_byte_altered), cmocka_unit_test(test_replay_reorder_drop_key),
        cmocka_unit_test(test_bad_sizes),          cmocka_unit_test(test_sealed_link),
        cmocka_unit_test(test_plain_link),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
