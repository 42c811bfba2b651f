/* auth.h - the handshake that opens every link of the ring (DESIGN.md 4; byte table in
 * auth.c and docs/PROTOCOL.md).
 *
 * Four fixed-size messages (KVR_AUTH_MSG_BYTES each) between the side that connected (the
 * client, upstream) and the side that accepted (the server, downstream):
 *
 *   1 HELLO      client -> server  who I am, my plan hash, my nonce Nc, my X25519 key
 *   2 CHALLENGE  server -> client  who I am, my plan hash, my nonce Ns, my X25519 key,
 *                                  MAC(K, "server" | msg1 | msg2)        proves the server
 *   3 PROOF      client -> server  MAC(K, "client" | msg1 | msg2 | msg3) proves the client
 *   4 VERDICT    server -> client  status, MAC(K, "verdict" | msg1..msg4)
 *
 * K is derived from the plan's cluster secret (BLAKE2b keyed with it); MAC is HMAC-SHA512-256
 * (libsodium crypto_auth). Each side's MAC covers the other side's fresh random nonce and
 * both identities, so a recorded handshake replayed later, a message reflected back to its
 * sender, or a message moved to a link between other stages all fail to verify. The secret
 * never crosses the wire. After a successful handshake both sides derive the link's two
 * session keys from an ephemeral X25519 exchange (libsodium crypto_kx, one key pair per
 * handshake), K and the transcript (kvr_auth_session_keys), with which seal.h encrypts and
 * authenticates every frame when the plan says "encrypt" (the default).
 *
 * Either side that rejects the other sends a VERDICT with a nonzero status (best effort,
 * not authenticated: it only helps the operator read the other side's log) and drops the
 * link. Rejections and their codes:
 *   KVR_EPROTO  wrong magic, version, message order or reserved fields
 *   KVR_EINVAL  different plan hash ("peer has plan hash X, we have Y"), or the peer is not
 *               the role/index the topology puts on this link
 *   KVR_EAUTH   a MAC does not verify ("peer failed authentication: wrong cluster secret?")
 *
 * The state machine is pure (no I/O): the link layer (net.h) moves the bytes. Nonces come
 * from libsodium's randombytes_buf in kvr_auth_init. One struct kvr_auth per handshake, used
 * by one thread; kvr_auth_wipe erases its key. */
#ifndef KVR_RING_AUTH_H
#define KVR_RING_AUTH_H

#include "core/err.h"
#include "ring/plan.h"

#include <stdbool.h>
#include <stdint.h>

#define KVR_AUTH_MAGIC 0x5253564bu /* "KVSR" as bytes on the wire */
/* 2: RESET frames and REPLAY control records (DESIGN.md 8); 3: sealed frames (seal.h);
 * 4: the bridge's control links and REPLAN frames (re-planning);
 * 5: expert agents (role 3, EXPERT and EXPERT_RESULT frames, ring/experts.h) */
#define KVR_AUTH_VERSION 5
#define KVR_AUTH_MSG_BYTES 144
#define KVR_AUTH_NONCE_BYTES 32
#define KVR_AUTH_MAC_BYTES 32
#define KVR_AUTH_KEY_BYTES 32
#define KVR_AUTH_KX_BYTES 32           /* crypto_kx_PUBLICKEYBYTES */
#define KVR_AUTH_INDEX_NONE 0xffffu    /* the bridge's index */
#define KVR_AUTH_INDEX_CONTROL 0xfffeu /* the bridge on a control link to a stage */
/* An expected peer's index that accepts any stage of the plan (an expert agent serves every
 * stage that owns layers it holds): kvr_auth_recv then records the index the peer proved. */
#define KVR_AUTH_INDEX_ANY 0xfffdu

/* AGENT: an expert agent (docs/EXPERTS.md), index = its place in the plan's "experts". */
enum kvr_auth_role {
    KVR_AUTH_ROLE_BRIDGE = 1,
    KVR_AUTH_ROLE_STAGE = 2,
    KVR_AUTH_ROLE_AGENT = 3,
    KVR_AUTH_ROLE_COUNT = 4
};

enum kvr_auth_step {
    KVR_AUTH_HELLO = 1,
    KVR_AUTH_CHALLENGE = 2,
    KVR_AUTH_PROOF = 3,
    KVR_AUTH_VERDICT = 4,
    KVR_AUTH_STEP_COUNT = 5
};

/* A VERDICT's status: why the sender rejected the handshake (0 = accepted). */
enum kvr_auth_status {
    KVR_AUTH_ACCEPTED = 0,
    KVR_AUTH_BAD_MESSAGE = 1, /* magic, version, order or reserved fields */
    KVR_AUTH_BAD_PLAN = 2,    /* plan hashes differ */
    KVR_AUTH_BAD_PEER = 3,    /* unexpected role or index on this link */
    KVR_AUTH_BAD_MAC = 4,     /* wrong cluster secret */
    KVR_AUTH_STATUS_COUNT = 5
};

struct kvr_auth_id {
    uint32_t role;  /* enum kvr_auth_role */
    uint32_t index; /* stage index; KVR_AUTH_INDEX_NONE for the bridge */
};

struct kvr_auth {
    bool is_client;
    bool done;       /* the handshake succeeded */
    bool failed;     /* a rejection happened: the auth is dead */
    uint32_t expect; /* enum kvr_auth_step of the next message to receive */
    struct kvr_auth_id self;
    struct kvr_auth_id peer; /* the identity the topology expects on this link */
    /* A server may accept one other identity (a stage: the bridge's control link, with
     * KVR_AUTH_INDEX_CONTROL); set has_alt and alt_peer after kvr_auth_init. If that one
     * says HELLO, peer becomes it and peer_is_alt is set. */
    struct kvr_auth_id alt_peer;
    bool has_alt;
    bool peer_is_alt;
    uint32_t n_stages; /* the plan's: a KVR_AUTH_INDEX_ANY peer is one of them */
    uint8_t key[KVR_AUTH_KEY_BYTES];
    uint8_t plan_hash[KVR_PLAN_HASH_BYTES];
    uint8_t peer_plan_hash[KVR_PLAN_HASH_BYTES]; /* what the peer sent (for messages) */
    uint8_t nonce[KVR_AUTH_NONCE_BYTES];
    uint8_t kx_pk[KVR_AUTH_KX_BYTES]; /* this handshake's ephemeral X25519 key pair */
    uint8_t kx_sk[KVR_AUTH_KX_BYTES];
    uint8_t msgs[3][KVR_AUTH_MSG_BYTES]; /* transcript: messages 1..3 */
};

/* Who is at each end of a link, from the ring's topology (net.h): the process playing
 * `role`/`index` either connects to its downstream (is_client) or accepts its upstream.
 * An expert agent (role AGENT, only as the server) accepts any stage (KVR_AUTH_INDEX_ANY).
 * KVR_EINVAL if the index is not a stage (or agent) of the plan. */
int kvr_auth_topology(const struct kvr_plan *plan, enum kvr_auth_role role, uint32_t index,
                      bool is_client, struct kvr_auth_id *self, struct kvr_auth_id *peer,
                      struct kvr_err *err);

/* Describe an identity: "the bridge" or "stage 3". */
void kvr_auth_id_str(struct kvr_auth_id id, char *out, size_t cap);

/* Prepare one handshake. The plan must be valid (its secret is used; its hash is
 * exchanged). Draws a fresh nonce. */
int kvr_auth_init(struct kvr_auth *a, const struct kvr_plan *plan, bool is_client,
                  struct kvr_auth_id self, struct kvr_auth_id peer, struct kvr_err *err);

/* Client only: write message 1 (HELLO) into out. */
int kvr_auth_hello(struct kvr_auth *a, uint8_t out[KVR_AUTH_MSG_BYTES], struct kvr_err *err);

/* Feed the next message from the peer. If *send is set on return, `out` holds a message
 * to send to the peer (the next step, or a rejecting VERDICT when the call fails). Returns 0
 * while the handshake goes on or when it has just succeeded (a->done), or a negative status
 * (see above) with a message; after a failure the struct only accepts kvr_auth_wipe. */
int kvr_auth_recv(struct kvr_auth *a, const uint8_t in[KVR_AUTH_MSG_BYTES],
                  uint8_t out[KVR_AUTH_MSG_BYTES], bool *send, struct kvr_err *err);

/* The link's session keys, once the handshake has succeeded (a->done; KVR_EINVAL before):
 *   c2s | s2c             = crypto_kx session keys of the two ephemeral X25519 key pairs
 *                           (client's direction first), from HELLO's and CHALLENGE's kx
 *   to_server | to_client = BLAKE2b-512(key = K, "kvasir-seal-2" | c2s | s2c | m1 | m2 | m3)
 * The exchange gives forward secrecy (a recorded session stays sealed even if the cluster
 * secret leaks later); K and the transcript (both fresh nonces, both identities, the plan
 * hash, both public keys) bind the keys to this link of this ring. to_server seals the
 * frames the client sends, to_client anything the server sends. KVR_EAUTH if the peer's
 * public key gives no valid shared secret. */
int kvr_auth_session_keys(const struct kvr_auth *a, uint8_t to_server[KVR_AUTH_KEY_BYTES],
                          uint8_t to_client[KVR_AUTH_KEY_BYTES], struct kvr_err *err);

/* Erase the key and transcript. */
void kvr_auth_wipe(struct kvr_auth *a);

#endif
