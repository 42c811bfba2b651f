/* test_auth.c - the handshake state machine: success, and each way it must fail (wrong
 * secret, different plan, wrong peer, wrong magic or version, replayed, reflected, tampered
 * or out-of-order messages), checked on both sides. No sockets: messages are passed in
 * memory (test_net.c runs the same over TCP). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "ring/auth.h"
#include "ring/plan.h"
#include "ring/wire.h"

#include <stdio.h>
#include <string.h>

static struct kvr_plan plan_c, plan_s;

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
    p->row_width = 8;
    p->microbatches = 2;
    p->max_seqs = 4;
    p->n_ctx = 64;
    p->kv_block_tokens = 16;
    p->kv_blocks = 16;
    p->wire_dtype = KVR_DTYPE_F32;
    p->secret_bytes = 32;
    for (int i = 0; i < 32; i++)
        p->secret[i] = (uint8_t)(i * 7 + 1);
    struct kvr_err err = {0};
    if (kvr_plan_validate(p, 3, &err))
        fail_msg("plan: %s", err.msg);
}

static void setup_plans(void)
{
    make_plan(&plan_c);
    make_plan(&plan_s);
}

static const struct kvr_auth_id STAGE0 = {KVR_AUTH_ROLE_STAGE, 0};
static const struct kvr_auth_id STAGE1 = {KVR_AUTH_ROLE_STAGE, 1};
static const struct kvr_auth_id BRIDGE = {KVR_AUTH_ROLE_BRIDGE, KVR_AUTH_INDEX_NONE};

struct run {
    int rc_client, rc_server;
    struct kvr_err err_client, err_server;
    uint8_t msgs[5][KVR_AUTH_MSG_BYTES]; /* what was sent, step by step (4 at most) */
    int n_msgs;
    uint8_t keys_c[2][KVR_AUTH_KEY_BYTES]; /* session keys (to server, to client) */
    uint8_t keys_s[2][KVR_AUTH_KEY_BYTES];
};

/* The server's one other acceptable identity in run_handshake (NULL: none), and whether
 * the peer it accepted was that one. */
static const struct kvr_auth_id *server_alt;
static bool server_took_alt;

/* Stage 0 (client) connects to stage 1 (server) unless told otherwise. Messages alternate
 * until one side stops sending. */
static void run_handshake(struct run *r, struct kvr_auth_id c_self, struct kvr_auth_id c_peer,
                          struct kvr_auth_id s_self, struct kvr_auth_id s_peer)
{
    struct kvr_auth c, s;
    memset(r, 0, sizeof *r);
    assert_int_equal(kvr_auth_init(&c, &plan_c, true, c_self, c_peer, NULL), 0);
    assert_int_equal(kvr_auth_init(&s, &plan_s, false, s_self, s_peer, NULL), 0);
    if (server_alt) {
        s.alt_peer = *server_alt;
        s.has_alt = true;
    }
    assert_int_equal(kvr_auth_hello(&c, r->msgs[0], NULL), 0);
    r->n_msgs = 1;
    bool to_server = true, send = true;
    while (send) {
        assert_true(r->n_msgs <= 4);
        struct kvr_auth *who = to_server ? &s : &c;
        struct kvr_err *err = to_server ? &r->err_server : &r->err_client;
        int rc = kvr_auth_recv(who, r->msgs[r->n_msgs - 1], r->msgs[r->n_msgs], &send, err);
        *(to_server ? &r->rc_server : &r->rc_client) = rc;
        if (send)
            r->n_msgs++;
        to_server = !to_server;
    }
    if (r->rc_client == 0 && r->rc_server == 0) {
        assert_true(c.done);
        assert_true(s.done);
        assert_int_equal(kvr_auth_session_keys(&c, r->keys_c[0], r->keys_c[1], NULL), 0);
        assert_int_equal(kvr_auth_session_keys(&s, r->keys_s[0], r->keys_s[1], NULL), 0);
    }
    server_took_alt = s.peer_is_alt;
    kvr_auth_wipe(&c);
    kvr_auth_wipe(&s);
}

static void expect(int rc, const struct kvr_err *err, int want_rc, const char *want_msg,
                   const char *side)
{
    if (rc != want_rc || !strstr(err->msg, want_msg))
        fail_msg("%s: rc %d \"%s\", wanted %d \"%s\"", side, rc, err->msg, want_rc, want_msg);
}

static void test_success(void **state)
{
    (void)state;
    setup_plans();
    struct run r;
    run_handshake(&r, STAGE0, STAGE1, STAGE1, STAGE0);
    assert_int_equal(r.rc_client, 0);
    assert_int_equal(r.rc_server, 0);
    assert_int_equal(r.n_msgs, 4);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kvr_ld32(r.msgs[i]), KVR_AUTH_MAGIC);
        assert_int_equal(r.msgs[i][6], i + 1);
    }
    assert_int_equal(kvr_ld16(r.msgs[3] + 10), KVR_AUTH_ACCEPTED);
    /* The secret never appears in what was sent. */
    for (int i = 0; i < 4; i++)
        for (int o = 0; o + 8 <= KVR_AUTH_MSG_BYTES; o++)
            assert_memory_not_equal(r.msgs[i] + o, plan_c.secret, 8);
    /* The bridge's links: bridge -> stage 0, tail -> bridge. */
    run_handshake(&r, BRIDGE, STAGE0, STAGE0, BRIDGE);
    assert_int_equal(r.rc_client | r.rc_server, 0);
    struct kvr_auth_id tail = {KVR_AUTH_ROLE_STAGE, 2};
    run_handshake(&r, tail, BRIDGE, BRIDGE, tail);
    assert_int_equal(r.rc_client | r.rc_server, 0);
}

/* Both ends derive the same two keys; each direction has its own; every handshake gives new
 * ones (fresh nonces); a handshake that is not done gives none. */
static void test_session_keys(void **state)
{
    (void)state;
    setup_plans();
    struct run r1, r2;
    run_handshake(&r1, STAGE0, STAGE1, STAGE1, STAGE0);
    run_handshake(&r2, STAGE0, STAGE1, STAGE1, STAGE0);
    assert_int_equal(r1.rc_client | r1.rc_server | r2.rc_client | r2.rc_server, 0);
    assert_memory_equal(r1.keys_c, r1.keys_s, sizeof r1.keys_c);
    assert_memory_not_equal(r1.keys_c[0], r1.keys_c[1], KVR_AUTH_KEY_BYTES);
    assert_memory_not_equal(r1.keys_c[0], r2.keys_c[0], KVR_AUTH_KEY_BYTES);
    assert_memory_not_equal(r1.keys_c[1], r2.keys_c[1], KVR_AUTH_KEY_BYTES);
    static const uint8_t zero[KVR_AUTH_KEY_BYTES];
    assert_memory_not_equal(r1.keys_c[0], zero, KVR_AUTH_KEY_BYTES);
    /* No key is sent: it appears nowhere in the transcript. */
    for (int i = 0; i < 4; i++)
        for (int o = 0; o + 8 <= KVR_AUTH_MSG_BYTES; o++)
            for (int k = 0; k < 2; k++)
                assert_memory_not_equal(r1.msgs[i] + o, r1.keys_c[k], 8);

    /* The ephemeral X25519 keys travel in HELLO and CHALLENGE only, fresh every time. */
    static const uint8_t zero_kx[KVR_AUTH_KX_BYTES];
    for (int i = 0; i < 4; i++)
        if (i < 2)
            assert_memory_not_equal(r1.msgs[i] + 80, zero_kx, KVR_AUTH_KX_BYTES);
        else
            assert_memory_equal(r1.msgs[i] + 80, zero_kx, KVR_AUTH_KX_BYTES);
    assert_memory_not_equal(r1.msgs[0] + 80, r2.msgs[0] + 80, KVR_AUTH_KX_BYTES);
    assert_memory_not_equal(r1.msgs[0] + 80, r1.msgs[1] + 80, KVR_AUTH_KX_BYTES);

    struct kvr_auth c;
    struct kvr_err err = {0};
    uint8_t k0[KVR_AUTH_KEY_BYTES], k1[KVR_AUTH_KEY_BYTES], hello[KVR_AUTH_MSG_BYTES];
    assert_int_equal(kvr_auth_init(&c, &plan_c, true, STAGE0, STAGE1, NULL), 0);
    assert_int_equal(kvr_auth_hello(&c, hello, NULL), 0);
    assert_int_equal(kvr_auth_session_keys(&c, k0, k1, &err), KVR_EINVAL);

    /* A key exchange value replaced on the way (here by the all-zero point, which gives no
     * shared secret) is caught: the server's MAC covers the HELLO it received, which is not
     * the one the client sent. */
    struct kvr_auth s;
    uint8_t challenge[KVR_AUTH_MSG_BYTES], out[KVR_AUTH_MSG_BYTES];
    bool send = false;
    assert_int_equal(kvr_auth_init(&s, &plan_s, false, STAGE1, STAGE0, NULL), 0);
    memset(hello + 80, 0, KVR_AUTH_KX_BYTES);
    assert_int_equal(kvr_auth_recv(&s, hello, challenge, &send, &err), 0);
    assert_true(send);
    assert_int_equal(kvr_auth_recv(&c, challenge, out, &send, &err), KVR_EAUTH);
    kvr_auth_wipe(&c);
    kvr_auth_wipe(&s);
}

static void test_wrong_secret(void **state)
{
    (void)state;
    setup_plans();
    plan_s.secret[5] ^= 1;
    struct run r;
    run_handshake(&r, STAGE0, STAGE1, STAGE1, STAGE0);
    /* The client checks the server's MAC first, and tells the server why it hangs up. */
    expect(r.rc_client, &r.err_client, KVR_EAUTH,
           "peer (stage 1) failed authentication: wrong cluster secret?", "client");
    expect(r.rc_server, &r.err_server, KVR_EAUTH,
           "stage 0 rejected the handshake: authentication failed (wrong cluster secret?)",
           "server");
    /* A secret of another length is just as wrong. */
    setup_plans();
    plan_s.secret_bytes = 31;
    run_handshake(&r, STAGE0, STAGE1, STAGE1, STAGE0);
    assert_int_equal(r.rc_client, KVR_EAUTH);
}

static void test_different_plan(void **state)
{
    (void)state;
    setup_plans();
    plan_s.row_width = 16;
    uint8_t hc[32], hs[32];
    char hex_c[20], hex_s[20], want[128];
    kvr_plan_hash(&plan_c, hc);
    kvr_plan_hash(&plan_s, hs);
    kvr_plan_hash_hex(hc, 8, hex_c, sizeof hex_c);
    kvr_plan_hash_hex(hs, 8, hex_s, sizeof hex_s);
    struct run r;
    run_handshake(&r, STAGE0, STAGE1, STAGE1, STAGE0);
    snprintf(want, sizeof want, "peer has plan hash %s, we have %s", hex_c, hex_s);
    expect(r.rc_server, &r.err_server, KVR_EINVAL, want, "server");
    snprintf(want, sizeof want, "different plan hash (it has %s, we have %s)", hex_s, hex_c);
    expect(r.rc_client, &r.err_client, KVR_EINVAL, want, "client");
    assert_int_equal(r.n_msgs, 2); /* HELLO, then the rejecting VERDICT */
    /* A different secret does NOT change the plan hash (it is checked by the MACs). */
    setup_plans();
    plan_s.secret[0] ^= 0xff;
    kvr_plan_hash(&plan_c, hc);
    kvr_plan_hash(&plan_s, hs);
    assert_memory_equal(hc, hs, 32);
}

/* An expert link is bound to the placement, not the ring's epoch (plan.h
 * kvr_plan_experts_link_hash): a stage of a re-planned ring (epoch 1, fewer stages,
 * other layers) links an agent still on the plan it started with; a ring link between
 * the two plans is refused, and so is an expert link once the placements differ. */
static void test_expert_link_epoch(void **state)
{
    (void)state;
    static const struct kvr_auth_id AGENT0 = {KVR_AUTH_ROLE_AGENT, 0};
    static const struct kvr_auth_id ANY = {KVR_AUTH_ROLE_STAGE, KVR_AUTH_INDEX_ANY};
    setup_plans();
    for (int k = 0; k < 2; k++) {
        struct kvr_plan *p = k ? &plan_s : &plan_c;
        p->n_agents = 1;
        snprintf(p->agents[0].addr, sizeof p->agents[0].addr, "127.0.0.1:7101");
        p->agents[0].n_holds = 1;
        p->agents[0].holds[0] = (struct kvr_plan_hold){0, 2, 0, 3};
    }
    plan_c.epoch = 1; /* the stage's plan: stage 1 of the old three lost, stage 2 now 1 */
    plan_c.n_stages = 2;
    plan_c.stages[0].last_layer = 1;
    plan_c.stages[1] = plan_s.stages[2];
    plan_c.stages[1].first_layer = 2;
    memset(&plan_c.stages[2], 0, sizeof plan_c.stages[2]);
    struct run r;
    run_handshake(&r, STAGE1, AGENT0, AGENT0, ANY);
    assert_int_equal(r.rc_client, 0);
    assert_int_equal(r.rc_server, 0);
    assert_memory_equal(r.keys_c, r.keys_s, sizeof r.keys_c);
    run_handshake(&r, STAGE0, STAGE1, STAGE1, STAGE0); /* a ring link: different plans */
    expect(r.rc_server, &r.err_server, KVR_EINVAL, "peer has plan hash", "server");
    plan_s.agents[0].holds[0].last_expert = 2; /* the agent holds other experts */
    run_handshake(&r, STAGE1, AGENT0, AGENT0, ANY);
    expect(r.rc_server, &r.err_server, KVR_EINVAL, "peer has plan hash", "server");
    expect(r.rc_client, &r.err_client, KVR_EINVAL, "different plan hash", "client");
}

static void test_wrong_peer(void **state)
{
    (void)state;
    setup_plans();
    struct run r;
    /* Stage 2 dials stage 1's address by mistake: stage 1 expects stage 0 upstream. */
    struct kvr_auth_id stage2 = {KVR_AUTH_ROLE_STAGE, 2};
    run_handshake(&r, stage2, STAGE1, STAGE1, STAGE0);
    expect(r.rc_server, &r.err_server, KVR_EINVAL,
           "expected stage 0 on this link, but the peer says it is stage 2", "server");
    expect(r.rc_client, &r.err_client, KVR_EINVAL, "wrong role or stage index", "client");
    /* The server is not who the client meant to reach (stage 1 where the bridge belongs):
     * the client refuses, and the server hears why. */
    run_handshake(&r, STAGE0, BRIDGE, STAGE1, STAGE0);
    expect(r.rc_client, &r.err_client, KVR_EINVAL,
           "expected the bridge on this link, but the peer says it is stage 1", "client");
    expect(r.rc_server, &r.err_server, KVR_EINVAL, "stage 0 rejected the handshake", "server");
}

/* The bridge's control link (re-planning): a stage accepts it beside its upstream only
 * when told to (kvr_link_handshake_accept), and knows which of the two came; nobody else
 * may claim either identity. */
static void test_control(void **state)
{
    (void)state;
    setup_plans();
    const struct kvr_auth_id control = {KVR_AUTH_ROLE_BRIDGE, KVR_AUTH_INDEX_CONTROL};
    struct run r;
    server_alt = &control;
    run_handshake(&r, control, STAGE1, STAGE1, STAGE0);
    assert_int_equal(r.rc_client | r.rc_server, 0);
    assert_true(server_took_alt);
    run_handshake(&r, STAGE0, STAGE1, STAGE1, STAGE0); /* the upstream still gets in */
    assert_int_equal(r.rc_client | r.rc_server, 0);
    assert_false(server_took_alt);
    struct kvr_auth_id stage2 = {KVR_AUTH_ROLE_STAGE, 2};
    run_handshake(&r, stage2, STAGE1, STAGE1, STAGE0); /* and nobody else */
    expect(r.rc_server, &r.err_server, KVR_EINVAL,
           "expected stage 0 on this link, but the peer says it is stage 2", "server");
    server_alt = NULL;
    run_handshake(&r, control, STAGE1, STAGE1, STAGE0); /* a server not told refuses it */
    expect(r.rc_server, &r.err_server, KVR_EINVAL,
           "expected stage 0 on this link, but the peer says it is the bridge (control)", "server");
    /* A different plan (an old epoch) is refused on a control link like on any other. */
    server_alt = &control;
    plan_s.epoch = 1;
    run_handshake(&r, control, STAGE1, STAGE1, STAGE0);
    expect(r.rc_server, &r.err_server, KVR_EINVAL, "loaded different plans", "server");
    plan_s.epoch = 0;
    server_alt = NULL;
}

/* Feed one message to a fresh server (expecting HELLO) and return its verdict. */
static int server_gets(const uint8_t *msg, struct kvr_err *err, bool *sent_verdict)
{
    struct kvr_auth s;
    uint8_t out[KVR_AUTH_MSG_BYTES];
    assert_int_equal(kvr_auth_init(&s, &plan_s, false, STAGE1, STAGE0, NULL), 0);
    int rc = kvr_auth_recv(&s, msg, out, sent_verdict, err);
    if (*sent_verdict && rc)
        assert_int_equal(out[6], KVR_AUTH_VERDICT);
    kvr_auth_wipe(&s);
    return rc;
}

static void test_bad_messages(void **state)
{
    (void)state;
    setup_plans();
    struct kvr_auth c;
    uint8_t hello[KVR_AUTH_MSG_BYTES], m[KVR_AUTH_MSG_BYTES];
    struct kvr_err err = {0};
    bool sent = false;
    assert_int_equal(kvr_auth_init(&c, &plan_c, true, STAGE0, STAGE1, NULL), 0);
    assert_int_equal(kvr_auth_hello(&c, hello, NULL), 0);

    memcpy(m, hello, sizeof m);
    memcpy(m, "GET ", 4); /* an HTTP client on the stage port */
    assert_int_equal(server_gets(m, &err, &sent), KVR_EPROTO);
    assert_non_null(strstr(err.msg, "not a Kvasir handshake"));
    assert_true(sent);

    memcpy(m, hello, sizeof m);
    kvr_st16(m + 4, 1); /* a peer from before RESET and REPLAY */
    assert_int_equal(server_gets(m, &err, &sent), KVR_EPROTO);
    char want[64];
    snprintf(want, sizeof want, "peer speaks protocol version 1, we speak %d", KVR_AUTH_VERSION);
    assert_non_null(strstr(err.msg, want));

    memcpy(m, hello, sizeof m);
    m[6] = KVR_AUTH_PROOF; /* out of order */
    assert_int_equal(server_gets(m, &err, &sent), KVR_EPROTO);
    assert_non_null(strstr(err.msg, "expected step 1"));

    memcpy(m, hello, sizeof m);
    m[12] = 1; /* reserved */
    assert_int_equal(server_gets(m, &err, &sent), KVR_EPROTO);

    memcpy(m, hello, sizeof m);
    memset(m + 48, 0, KVR_AUTH_NONCE_BYTES);
    assert_int_equal(server_gets(m, &err, &sent), KVR_EPROTO);
    assert_non_null(strstr(err.msg, "all-zero nonce"));

    /* The untouched HELLO is fine. */
    assert_int_equal(server_gets(hello, &err, &sent), 0);
    assert_true(sent);

    /* After a failure the state machine refuses to go on. */
    struct kvr_auth s;
    uint8_t out[KVR_AUTH_MSG_BYTES];
    assert_int_equal(kvr_auth_init(&s, &plan_s, false, STAGE1, STAGE0, NULL), 0);
    memcpy(m, hello, sizeof m);
    m[0] = 0;
    assert_int_equal(kvr_auth_recv(&s, m, out, &sent, &err), KVR_EPROTO);
    assert_int_equal(kvr_auth_recv(&s, hello, out, &sent, &err), KVR_EINVAL);
    assert_false(sent);
    kvr_auth_wipe(&s);
    /* Only a client says HELLO. */
    assert_int_equal(kvr_auth_init(&s, &plan_s, false, STAGE1, STAGE0, NULL), 0);
    assert_int_equal(kvr_auth_hello(&s, out, &err), KVR_EINVAL);
    kvr_auth_wipe(&s);
    kvr_auth_wipe(&c);
}

/* A recorded session replayed against fresh peers fails: each side MACs over the other's
 * new nonce. */
static void test_replay(void **state)
{
    (void)state;
    setup_plans();
    struct run rec;
    run_handshake(&rec, STAGE0, STAGE1, STAGE1, STAGE0);
    assert_int_equal(rec.rc_client | rec.rc_server, 0);

    /* Replaying the client's HELLO and PROOF to a new server. */
    struct kvr_auth s;
    uint8_t out[KVR_AUTH_MSG_BYTES];
    bool sent;
    struct kvr_err err = {0};
    assert_int_equal(kvr_auth_init(&s, &plan_s, false, STAGE1, STAGE0, NULL), 0);
    assert_int_equal(kvr_auth_recv(&s, rec.msgs[0], out, &sent, &err), 0);
    assert_memory_not_equal(out + 48, rec.msgs[1] + 48, KVR_AUTH_NONCE_BYTES);
    assert_int_equal(kvr_auth_recv(&s, rec.msgs[2], out, &sent, &err), KVR_EAUTH);
    assert_non_null(strstr(err.msg, "failed authentication"));
    assert_false(s.done);
    kvr_auth_wipe(&s);

    /* Replaying the server's CHALLENGE and VERDICT to a new client. */
    struct kvr_auth c;
    uint8_t hello[KVR_AUTH_MSG_BYTES];
    assert_int_equal(kvr_auth_init(&c, &plan_c, true, STAGE0, STAGE1, NULL), 0);
    assert_int_equal(kvr_auth_hello(&c, hello, NULL), 0);
    assert_int_equal(kvr_auth_recv(&c, rec.msgs[1], out, &sent, &err), KVR_EAUTH);
    assert_false(c.done);
    kvr_auth_wipe(&c);

    /* Reflection: the server's own CHALLENGE sent back to it as a PROOF. */
    assert_int_equal(kvr_auth_init(&s, &plan_s, false, STAGE1, STAGE0, NULL), 0);
    uint8_t challenge[KVR_AUTH_MSG_BYTES];
    assert_int_equal(kvr_auth_recv(&s, rec.msgs[0], challenge, &sent, &err), 0);
    challenge[6] = KVR_AUTH_PROOF;
    challenge[7] = KVR_AUTH_ROLE_STAGE;
    kvr_st16(challenge + 8, 0);
    memset(challenge + 48, 0, KVR_AUTH_NONCE_BYTES);
    assert_int_equal(kvr_auth_recv(&s, challenge, out, &sent, &err), KVR_EAUTH);
    kvr_auth_wipe(&s);
}

/* Any single flipped bit in a CHALLENGE, PROOF or accepting VERDICT is caught. */
static void test_tampering(void **state)
{
    (void)state;
    setup_plans();
    for (int step = 1; step <= 3; step++) {
        for (int bit = 0; bit < KVR_AUTH_MSG_BYTES * 8; bit += 5) {
            struct kvr_auth c, s;
            uint8_t m[4][KVR_AUTH_MSG_BYTES];
            bool sent;
            struct kvr_err err = {0};
            assert_int_equal(kvr_auth_init(&c, &plan_c, true, STAGE0, STAGE1, NULL), 0);
            assert_int_equal(kvr_auth_init(&s, &plan_s, false, STAGE1, STAGE0, NULL), 0);
            assert_int_equal(kvr_auth_hello(&c, m[0], NULL), 0);
            int rc = kvr_auth_recv(&s, m[0], m[1], &sent, &err);
            assert_int_equal(rc, 0);
            if (step == 1)
                m[1][bit / 8] ^= (uint8_t)(1u << (bit % 8));
            rc = kvr_auth_recv(&c, m[1], m[2], &sent, &err);
            if (step == 1) {
                if (rc == 0)
                    fail_msg("flipped bit %d of CHALLENGE accepted", bit);
                goto next;
            }
            assert_int_equal(rc, 0);
            if (step == 2)
                m[2][bit / 8] ^= (uint8_t)(1u << (bit % 8));
            rc = kvr_auth_recv(&s, m[2], m[3], &sent, &err);
            if (step == 2) {
                if (rc == 0)
                    fail_msg("flipped bit %d of PROOF accepted", bit);
                goto next;
            }
            assert_int_equal(rc, 0);
            m[3][bit / 8] ^= (uint8_t)(1u << (bit % 8));
            rc = kvr_auth_recv(&c, m[3], m[0], &sent, &err);
            if (rc == 0)
                fail_msg("flipped bit %d of VERDICT accepted", bit);
        next:
            kvr_auth_wipe(&c);
            kvr_auth_wipe(&s);
        }
    }
}

static void test_topology(void **state)
{
    (void)state;
    setup_plans();
    struct kvr_auth_id self, peer;
    struct kvr_err err = {0};
    /* The bridge dials the head and accepts the tail. */
    assert_int_equal(kvr_auth_topology(&plan_c, KVR_AUTH_ROLE_BRIDGE, 0, true, &self, &peer, &err),
                     0);
    assert_memory_equal(&self, &BRIDGE, sizeof self);
    assert_memory_equal(&peer, &STAGE0, sizeof peer);
    assert_int_equal(kvr_auth_topology(&plan_c, KVR_AUTH_ROLE_BRIDGE, 0, false, &self, &peer, &err),
                     0);
    assert_int_equal(peer.index, 2);
    /* Stage 0 accepts the bridge and dials stage 1; the tail dials the bridge. */
    assert_int_equal(kvr_auth_topology(&plan_c, KVR_AUTH_ROLE_STAGE, 0, false, &self, &peer, &err),
                     0);
    assert_memory_equal(&peer, &BRIDGE, sizeof peer);
    assert_int_equal(kvr_auth_topology(&plan_c, KVR_AUTH_ROLE_STAGE, 0, true, &self, &peer, &err),
                     0);
    assert_memory_equal(&peer, &STAGE1, sizeof peer);
    assert_int_equal(kvr_auth_topology(&plan_c, KVR_AUTH_ROLE_STAGE, 2, true, &self, &peer, &err),
                     0);
    assert_memory_equal(&peer, &BRIDGE, sizeof peer);
    assert_int_equal(kvr_auth_topology(&plan_c, KVR_AUTH_ROLE_STAGE, 1, false, &self, &peer, &err),
                     0);
    assert_memory_equal(&peer, &STAGE0, sizeof peer);
    assert_int_equal(kvr_auth_topology(&plan_c, KVR_AUTH_ROLE_STAGE, 3, true, &self, &peer, &err),
                     KVR_EINVAL);
    assert_int_equal(kvr_auth_topology(&plan_c, 7, 0, true, &self, &peer, &err), KVR_EINVAL);

    /* A plan without a usable secret cannot start a handshake. */
    struct kvr_auth a;
    plan_c.secret_bytes = 8;
    assert_int_equal(kvr_auth_init(&a, &plan_c, true, STAGE0, STAGE1, &err), KVR_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_success),           cmocka_unit_test(test_session_keys),
        cmocka_unit_test(test_wrong_secret),      cmocka_unit_test(test_different_plan),
        cmocka_unit_test(test_wrong_peer),        cmocka_unit_test(test_bad_messages),
        cmocka_unit_test(test_expert_link_epoch), cmocka_unit_test(test_replay),
        cmocka_unit_test(test_tampering),         cmocka_unit_test(test_topology),
        cmocka_unit_test(test_control),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
