/* auth.c - the link handshake as a pure state machine (see auth.h).
 *
 * Handshake message (144 bytes, all four steps), integers little-endian:
 *   off size field
 *     0   4  magic       "KVSR" (0x4b 0x56 0x53 0x52)
 *     4   2  version     KVR_AUTH_VERSION (5)
 *     6   1  step        enum kvr_auth_step: 1 HELLO, 2 CHALLENGE, 3 PROOF, 4 VERDICT
 *     7   1  role        enum kvr_auth_role of the sender: 1 bridge, 2 stage, 3 agent
 *     8   2  index       the sender's stage (or agent) index; 0xffff for the bridge, 0xfffe
 *                        for the bridge's control link to a stage (re-planning)
 *    10   2  status      VERDICT: enum kvr_auth_status; otherwise 0
 *    12   4  reserved    0
 *    16  32  plan_hash   the sender's kvr_plan_hash (kvr_plan_experts_link_hash on a link
 *                        to or from an expert agent)
 *    48  32  nonce       HELLO, CHALLENGE: 32 fresh random bytes; otherwise 0
 *    80  32  kx          HELLO, CHALLENGE: the sender's ephemeral X25519 public key
 *                        (crypto_kx); otherwise 0
 *   112  32  mac         CHALLENGE: HMAC(K, "kvasir-auth-1 server"  | m1 | m2[0..112))
 *                        PROOF:     HMAC(K, "kvasir-auth-1 client"  | m1 | m2 | m3[0..112))
 *                        VERDICT:   HMAC(K, "kvasir-auth-1 verdict" | m1 | m2 | m3 |
 *                                           m4[0..112))  (absent messages are skipped)
 *                        HELLO: 0
 *
 * K = BLAKE2b-256(key = cluster secret, message = "kvasir-auth-key-1"). HMAC is
 * HMAC-SHA512-256 (crypto_auth_hmacsha512256). Session keys: see kvr_auth_session_keys. */
#include "ring/auth.h"

#include "ring/wire.h"

#include <sodium.h>
#include <stdio.h>
#include <string.h>

#define MAC_OFF 112 /* the MAC field; everything before it is MACed */

static const char *status_reason(uint32_t status)
{
    switch (status) {
    case KVR_AUTH_BAD_MESSAGE:
        return "malformed or unexpected handshake message";
    case KVR_AUTH_BAD_PLAN:
        return "different plan hash";
    case KVR_AUTH_BAD_PEER:
        return "wrong role or stage index for this link";
    case KVR_AUTH_BAD_MAC:
        return "authentication failed (wrong cluster secret?)";
    default:
        return "unknown reason";
    }
}

void kvr_auth_id_str(struct kvr_auth_id id, char *out, size_t cap)
{
    if (id.role == KVR_AUTH_ROLE_BRIDGE && id.index == KVR_AUTH_INDEX_CONTROL)
        snprintf(out, cap, "the bridge (control)");
    else if (id.role == KVR_AUTH_ROLE_BRIDGE)
        snprintf(out, cap, "the bridge");
    else if (id.role == KVR_AUTH_ROLE_STAGE)
        snprintf(out, cap, id.index == KVR_AUTH_INDEX_ANY ? "a stage" : "stage %u", id.index);
    else if (id.role == KVR_AUTH_ROLE_AGENT)
        snprintf(out, cap, "expert agent %u", id.index);
    else
        snprintf(out, cap, "unknown role %u (index %u)", id.role, id.index);
}

int kvr_auth_topology(const struct kvr_plan *plan, enum kvr_auth_role role, uint32_t index,
                      bool is_client, struct kvr_auth_id *self, struct kvr_auth_id *peer,
                      struct kvr_err *err)
{
    const struct kvr_auth_id bridge = {KVR_AUTH_ROLE_BRIDGE, KVR_AUTH_INDEX_NONE};
    uint32_t n = plan->n_stages;
    if (role == KVR_AUTH_ROLE_BRIDGE) {
        *self = bridge;
        *peer = (struct kvr_auth_id){KVR_AUTH_ROLE_STAGE, is_client ? 0 : n - 1};
        return n >= 2 ? KVR_OK : kvr_err_set(err, KVR_EINVAL, "auth: the plan has %u stages", n);
    }
    if (role == KVR_AUTH_ROLE_AGENT && !is_client && index < plan->n_agents) {
        *self = (struct kvr_auth_id){KVR_AUTH_ROLE_AGENT, index};
        *peer = (struct kvr_auth_id){KVR_AUTH_ROLE_STAGE, KVR_AUTH_INDEX_ANY};
        return KVR_OK;
    }
    if (role != KVR_AUTH_ROLE_STAGE || index >= n || n < 2)
        return kvr_err_set(err, KVR_EINVAL, "auth: role %d index %u is not part of the plan",
                           (int)role, index);
    *self = (struct kvr_auth_id){KVR_AUTH_ROLE_STAGE, index};
    if (is_client) /* connects downstream */
        *peer = index + 1 < n ? (struct kvr_auth_id){KVR_AUTH_ROLE_STAGE, index + 1} : bridge;
    else /* accepts upstream */
        *peer = index > 0 ? (struct kvr_auth_id){KVR_AUTH_ROLE_STAGE, index - 1} : bridge;
    return KVR_OK;
}

int kvr_auth_init(struct kvr_auth *a, const struct kvr_plan *plan, bool is_client,
                  struct kvr_auth_id self, struct kvr_auth_id peer, struct kvr_err *err)
{
    static const char label[] = "kvasir-auth-key-1";
    memset(a, 0, sizeof *a);
    if (sodium_init() < 0)
        return kvr_err_set(err, KVR_EIO, "auth: libsodium failed to initialise");
    if (plan->secret_bytes < crypto_generichash_KEYBYTES_MIN ||
        plan->secret_bytes > crypto_generichash_KEYBYTES_MAX ||
        plan->secret_bytes > sizeof plan->secret)
        return kvr_err_set(err, KVR_EINVAL,
                           "auth: the plan's secret is %u bytes; 16 to 64 "
                           "are needed",
                           plan->secret_bytes);
    a->is_client = is_client;
    a->self = self;
    a->peer = peer;
    a->expect = is_client ? KVR_AUTH_CHALLENGE : KVR_AUTH_HELLO;
    crypto_generichash(a->key, sizeof a->key, (const unsigned char *)label, sizeof label - 1,
                       plan->secret, plan->secret_bytes);
    if (self.role == KVR_AUTH_ROLE_AGENT || peer.role == KVR_AUTH_ROLE_AGENT)
        kvr_plan_experts_link_hash(plan, a->plan_hash); /* survives a re-plan (plan.h) */
    else
        kvr_plan_hash(plan, a->plan_hash);
    a->n_stages = plan->n_stages;
    randombytes_buf(a->nonce, sizeof a->nonce);
    crypto_kx_keypair(a->kx_pk, a->kx_sk);
    return KVR_OK;
}

int kvr_auth_session_keys(const struct kvr_auth *a, uint8_t to_server[KVR_AUTH_KEY_BYTES],
                          uint8_t to_client[KVR_AUTH_KEY_BYTES], struct kvr_err *err)
{
    static const char label[] = "kvasir-seal-2";
    if (!a->done)
        return kvr_err_set(err, KVR_EINVAL, "auth: no session keys before the handshake is done");
    /* The X25519 exchange: the peer's public key is in its HELLO or CHALLENGE, which both
     * MACs cover, so nobody without K could have replaced it. kx[0..32) is the client's
     * direction, kx[32..64) the server's, on both sides. */
    uint8_t kx[2 * crypto_kx_SESSIONKEYBYTES], both[2 * KVR_AUTH_KEY_BYTES];
    const uint8_t *peer_pk = a->msgs[a->is_client ? 1 : 0] + 80;
    int bad = a->is_client ? crypto_kx_client_session_keys(kx + crypto_kx_SESSIONKEYBYTES, kx,
                                                           a->kx_pk, a->kx_sk, peer_pk)
                           : crypto_kx_server_session_keys(kx, kx + crypto_kx_SESSIONKEYBYTES,
                                                           a->kx_pk, a->kx_sk, peer_pk);
    if (bad) {
        sodium_memzero(kx, sizeof kx);
        return kvr_err_set(err, KVR_EAUTH, "auth: the peer's key exchange value is invalid");
    }
    crypto_generichash_state st;
    crypto_generichash_init(&st, a->key, sizeof a->key, sizeof both);
    crypto_generichash_update(&st, (const unsigned char *)label, sizeof label - 1);
    crypto_generichash_update(&st, kx, sizeof kx);
    for (int i = 0; i < 3; i++)
        crypto_generichash_update(&st, a->msgs[i], KVR_AUTH_MSG_BYTES);
    crypto_generichash_final(&st, both, sizeof both);
    memcpy(to_server, both, KVR_AUTH_KEY_BYTES);
    memcpy(to_client, both + KVR_AUTH_KEY_BYTES, KVR_AUTH_KEY_BYTES);
    sodium_memzero(kx, sizeof kx);
    sodium_memzero(both, sizeof both);
    sodium_memzero(&st, sizeof st);
    return KVR_OK;
}

void kvr_auth_wipe(struct kvr_auth *a)
{
    sodium_memzero(a, sizeof *a);
}

/* ---- Messages -------------------------------------------------------------------------- */

static void put_msg(const struct kvr_auth *a, uint32_t step, uint32_t status, uint8_t *m)
{
    memset(m, 0, KVR_AUTH_MSG_BYTES);
    kvr_st32(m, KVR_AUTH_MAGIC);
    kvr_st16(m + 4, KVR_AUTH_VERSION);
    m[6] = (uint8_t)step;
    m[7] = (uint8_t)a->self.role;
    kvr_st16(m + 8, (uint16_t)a->self.index);
    kvr_st16(m + 10, (uint16_t)status);
    memcpy(m + 16, a->plan_hash, KVR_PLAN_HASH_BYTES);
    if (step == KVR_AUTH_HELLO || step == KVR_AUTH_CHALLENGE) {
        memcpy(m + 48, a->nonce, KVR_AUTH_NONCE_BYTES);
        memcpy(m + 80, a->kx_pk, KVR_AUTH_KX_BYTES);
    }
}

/* MAC of step `step` (2, 3 or 4) over the transcript and the message `m` itself (its first
 * 112 bytes, everything but the MAC field). The transcript holds messages 1..step-1; a
 * rejecting VERDICT may come early, and then covers only the messages that exist. */
static void mac_of(const struct kvr_auth *a, uint32_t step, uint32_t n_prev, const uint8_t *m,
                   uint8_t out[KVR_AUTH_MAC_BYTES])
{
    static const char *const labels[] = {"", "", "kvasir-auth-1 server", "kvasir-auth-1 client",
                                         "kvasir-auth-1 verdict"};
    crypto_auth_hmacsha512256_state st;
    crypto_auth_hmacsha512256_init(&st, a->key, sizeof a->key);
    crypto_auth_hmacsha512256_update(&st, (const unsigned char *)labels[step],
                                     strlen(labels[step]));
    for (uint32_t i = 0; i < n_prev; i++)
        crypto_auth_hmacsha512256_update(&st, a->msgs[i], KVR_AUTH_MSG_BYTES);
    crypto_auth_hmacsha512256_update(&st, m, MAC_OFF);
    crypto_auth_hmacsha512256_final(&st, out);
    sodium_memzero(&st, sizeof st);
}

/* Messages of the transcript held so far: every message before the one we expect (the
 * client stored its own HELLO, the server its CHALLENGE, as they were sent). */
static uint32_t transcript_len(const struct kvr_auth *a)
{
    uint32_t n = a->expect - 1;
    return n > 3 ? 3 : n;
}

int kvr_auth_hello(struct kvr_auth *a, uint8_t out[KVR_AUTH_MSG_BYTES], struct kvr_err *err)
{
    if (!a->is_client || a->expect != KVR_AUTH_CHALLENGE || a->failed || a->done)
        return kvr_err_set(err, KVR_EINVAL, "auth: HELLO is the client's first message");
    put_msg(a, KVR_AUTH_HELLO, 0, out);
    memcpy(a->msgs[0], out, KVR_AUTH_MSG_BYTES);
    return KVR_OK;
}

/* Reject: fill a VERDICT with `status` for the peer, mark the auth dead, and return rc. */
static int reject(struct kvr_auth *a, uint32_t status, uint8_t *out, bool *send, int rc)
{
    put_msg(a, KVR_AUTH_VERDICT, status, out);
    uint32_t n = transcript_len(a);
    mac_of(a, KVR_AUTH_VERDICT, n, out, out + MAC_OFF);
    *send = true;
    a->failed = true;
    return rc;
}

/* The status code a refusal carries to the caller: a malformed message is a protocol
 * error, a different plan or peer a configuration error, a bad MAC an authentication one. */
static int status_rc(uint32_t status)
{
    return status == KVR_AUTH_BAD_MAC                                   ? KVR_EAUTH
           : status == KVR_AUTH_BAD_PLAN || status == KVR_AUTH_BAD_PEER ? KVR_EINVAL
                                                                        : KVR_EPROTO;
}

/* A message from a Kvasir peer of our protocol version, or the status to refuse it with. */
static uint32_t check_magic(const uint8_t *in, struct kvr_err *err)
{
    uint32_t magic = kvr_ld32(in);
    if (magic != KVR_AUTH_MAGIC) {
        kvr_err_set(err, KVR_EPROTO,
                    "peer sent bytes %02x %02x %02x %02x, not a Kvasir handshake (magic "
                    "\"KVSR\")",
                    in[0], in[1], in[2], in[3]);
        return KVR_AUTH_BAD_MESSAGE;
    }
    uint32_t version = kvr_ld16(in + 4);
    if (version != KVR_AUTH_VERSION) {
        kvr_err_set(err, KVR_EPROTO, "peer speaks protocol version %u, we speak %u", version,
                    KVR_AUTH_VERSION);
        return KVR_AUTH_BAD_MESSAGE;
    }
    return KVR_AUTH_ACCEPTED;
}

/* The peer rejected us. Not authenticated (it may not share our key): report it as the
 * peer's claim, and send nothing back. */
static int peer_rejected(struct kvr_auth *a, const uint8_t *in, uint32_t status, const char *got_id,
                         struct kvr_err *err)
{
    a->failed = true;
    int rc = status_rc(status);
    if (status == KVR_AUTH_BAD_PLAN) {
        char theirs[20], ours[20];
        kvr_plan_hash_hex(in + 16, 8, theirs, sizeof theirs);
        kvr_plan_hash_hex(a->plan_hash, 8, ours, sizeof ours);
        return kvr_err_set(err, rc,
                           "%s rejected the handshake: different plan hash (it has %s, "
                           "we have %s)",
                           got_id, theirs, ours);
    }
    return kvr_err_set(err, rc, "%s rejected the handshake: %s", got_id, status_reason(status));
}

/* The message is the step we expect, from the peer we expect, under our plan, with a live
 * nonce where it carries one; or the status to refuse it with. A server whose peer may be
 * one of two (or any stage) learns here which one it talks to. */
static uint32_t check_claims(struct kvr_auth *a, const uint8_t *in, struct kvr_auth_id id,
                             const char *got_id, struct kvr_err *err)
{
    uint32_t step = in[6], status = kvr_ld16(in + 10);
    if (step != a->expect || kvr_ld32(in + 12) != 0 || status != 0) {
        kvr_err_set(err, KVR_EPROTO, "peer sent handshake step %u (status %u), expected step %u",
                    step, status, a->expect);
        return KVR_AUTH_BAD_MESSAGE;
    }
    if (step == KVR_AUTH_HELLO || step == KVR_AUTH_CHALLENGE) {
        memcpy(a->peer_plan_hash, in + 16, KVR_PLAN_HASH_BYTES);
        if (sodium_memcmp(in + 16, a->plan_hash, KVR_PLAN_HASH_BYTES) != 0) {
            char theirs[20], ours[20];
            kvr_plan_hash_hex(in + 16, 8, theirs, sizeof theirs);
            kvr_plan_hash_hex(a->plan_hash, 8, ours, sizeof ours);
            kvr_err_set(err, KVR_EINVAL,
                        "peer has plan hash %s, we have %s: the two processes loaded "
                        "different plans",
                        theirs, ours);
            return KVR_AUTH_BAD_PLAN;
        }
    } else if (sodium_memcmp(in + 16, a->plan_hash, KVR_PLAN_HASH_BYTES) != 0) {
        kvr_err_set(err, KVR_EPROTO, "peer changed its plan hash during the handshake");
        return KVR_AUTH_BAD_MESSAGE;
    }
    char want[48];
    kvr_auth_id_str(a->peer, want, sizeof want);
    bool is_alt = a->has_alt && id.role == a->alt_peer.role && id.index == a->alt_peer.index;
    if (is_alt && step == KVR_AUTH_HELLO) { /* the server learns which one it talks to */
        a->peer = a->alt_peer;
        a->peer_is_alt = true;
    }
    bool any = a->peer.index == KVR_AUTH_INDEX_ANY && step == KVR_AUTH_HELLO &&
               id.role == KVR_AUTH_ROLE_STAGE && id.index < a->n_stages;
    if (any)
        a->peer.index = id.index; /* the stage it claims to be; its PROOF must show it */
    if (id.role != a->peer.role || id.index != a->peer.index) {
        kvr_err_set(err, KVR_EINVAL, "expected %s on this link, but the peer says it is %s", want,
                    got_id);
        return KVR_AUTH_BAD_PEER;
    }
    if (step == KVR_AUTH_HELLO || step == KVR_AUTH_CHALLENGE) {
        /* A nonce of all zeros means a broken peer RNG: refuse it. */
        static const uint8_t zero[KVR_AUTH_NONCE_BYTES];
        if (sodium_memcmp(in + 48, zero, sizeof zero) == 0) {
            kvr_err_set(err, KVR_EPROTO, "peer sent an all-zero nonce");
            return KVR_AUTH_BAD_MESSAGE;
        }
    }
    return KVR_AUTH_ACCEPTED;
}

/* Verify the MAC of what we received (HELLO has none), store it, and answer. */
static int answer(struct kvr_auth *a, const uint8_t *in, uint8_t *out, bool *send,
                  const char *got_id, struct kvr_err *err)
{
    uint32_t step = in[6];
    uint8_t mac[KVR_AUTH_MAC_BYTES];
    switch (step) {
    case KVR_AUTH_HELLO: /* server */
        memcpy(a->msgs[0], in, KVR_AUTH_MSG_BYTES);
        a->expect = KVR_AUTH_PROOF;
        put_msg(a, KVR_AUTH_CHALLENGE, 0, out);
        mac_of(a, KVR_AUTH_CHALLENGE, 1, out, out + MAC_OFF);
        memcpy(a->msgs[1], out, KVR_AUTH_MSG_BYTES);
        *send = true;
        return KVR_OK;
    case KVR_AUTH_CHALLENGE: /* client */
        mac_of(a, KVR_AUTH_CHALLENGE, 1, in, mac);
        break;
    case KVR_AUTH_PROOF: /* server */
        mac_of(a, KVR_AUTH_PROOF, 2, in, mac);
        break;
    default: /* VERDICT accepted, client */
        mac_of(a, KVR_AUTH_VERDICT, 3, in, mac);
        break;
    }
    if (crypto_verify_32(mac, in + MAC_OFF) != 0) {
        kvr_err_set(err, KVR_EAUTH, "peer (%s) failed authentication: wrong cluster secret?",
                    got_id);
        return reject(a, KVR_AUTH_BAD_MAC, out, send, KVR_EAUTH);
    }
    switch (step) {
    case KVR_AUTH_CHALLENGE:
        memcpy(a->msgs[1], in, KVR_AUTH_MSG_BYTES);
        a->expect = KVR_AUTH_VERDICT;
        put_msg(a, KVR_AUTH_PROOF, 0, out);
        mac_of(a, KVR_AUTH_PROOF, 2, out, out + MAC_OFF);
        memcpy(a->msgs[2], out, KVR_AUTH_MSG_BYTES);
        *send = true;
        return KVR_OK;
    case KVR_AUTH_PROOF:
        memcpy(a->msgs[2], in, KVR_AUTH_MSG_BYTES);
        put_msg(a, KVR_AUTH_VERDICT, KVR_AUTH_ACCEPTED, out);
        mac_of(a, KVR_AUTH_VERDICT, 3, out, out + MAC_OFF);
        *send = true;
        a->done = true;
        return KVR_OK;
    default:
        a->done = true;
        return KVR_OK;
    }
}

int kvr_auth_recv(struct kvr_auth *a, const uint8_t in[KVR_AUTH_MSG_BYTES],
                  uint8_t out[KVR_AUTH_MSG_BYTES], bool *send, struct kvr_err *err)
{
    *send = false;
    if (a->failed || a->done)
        return kvr_err_set(err, KVR_EINVAL, "auth: the handshake is already over");
    uint32_t refuse = check_magic(in, err);
    if (refuse)
        return reject(a, refuse, out, send, status_rc(refuse));
    uint32_t step = in[6], status = kvr_ld16(in + 10);
    struct kvr_auth_id id = {in[7], kvr_ld16(in + 8)};
    char got_id[48];
    kvr_auth_id_str(id, got_id, sizeof got_id);
    if (step == KVR_AUTH_VERDICT && status != KVR_AUTH_ACCEPTED)
        return peer_rejected(a, in, status, got_id, err);
    if ((refuse = check_claims(a, in, id, got_id, err)))
        return reject(a, refuse, out, send, status_rc(refuse));
    return answer(a, in, out, send, got_id, err);
}
