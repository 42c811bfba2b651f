/* net.h - TCP helpers and the link: one authenticated, framed connection between two
 * processes of a ring (DESIGN.md 4).
 *
 * Topology. Frames flow one way around the ring: bridge -> stage 0 -> ... -> stage N-1 ->
 * bridge. Every process LISTENS on its own plan address for its upstream and CONNECTS to
 * its downstream: the bridge connects to stage 0, stage k to stage k+1, the tail to the
 * bridge. So each link has a client (the upstream, which sends frames) and a server (the
 * downstream, which receives them); the handshake (auth.h) runs first, in both directions.
 *
 * Helpers (kvr_net_*) are thin wrappers over BSD sockets in the style of Redis anet.c: they
 * return 0 or a negative enum kvr_status and explain failures in `err`. Every blocking call
 * takes a deadline (absolute kvr_now_ns() value; 0 = wait forever) and waits with poll(),
 * so no call can hang past it. SIGPIPE is never raised (MSG_NOSIGNAL).
 *
 * The link (struct kvr_link) owns a socket and every buffer it needs, sized from the plan
 * by kvr_link_init (nothing is allocated afterwards):
 *   - receiving: a header buffer and a body buffer of the plan's largest frame. kvr_link_recv
 *     reads the 40-byte header, validates it against the receiver's limits (wire.h) BEFORE
 *     reading any body byte, then reads the body and decodes it into link->frame. Reading
 *     is resumable: a deadline that passes mid-frame returns KVR_ETIMEDOUT and the next call
 *     continues where it stopped.
 *   - sending: a scratch buffer for header + records; payload rows are sent straight from
 *     the caller's buffer with one sendmsg() of up to three iovecs (no copy).
 * Sealing: when the plan says "encrypt" (the default), the handshake also derives the link's
 * session keys (auth.h) and from then on every frame is sealed on send and opened on
 * receive (seal.h): the header record is opened before any length in it is trusted, and the
 * sender seals straight from the iovecs into one buffer of the plan's largest sealed frame
 * (allocated by the handshake), so sending stays a single pass over the payload.
 * A frame that breaks the limits, a bad checksum, a frame that fails authentication
 * (altered, replayed, reordered or forged), or a peer closing mid-frame is a protocol
 * error: the link logs the reason (KVR_WARN), shuts the socket down and stays broken
 * (every later call returns KVR_ECLOSED). The caller then closes it with kvr_link_fini.
 *
 * Threads: at most one thread receives (kvr_link_recv) and at most one other thread sends
 * (kvr_link_send*) on a link at a time; receive and send state are disjoint. kvr_link_init,
 * the handshakes and kvr_link_fini run while no other thread uses the link. */
#ifndef KVR_RING_NET_H
#define KVR_RING_NET_H

#include "core/err.h"
#include "ring/auth.h"
#include "ring/plan.h"
#include "ring/seal.h"
#include "ring/wire.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define KVR_NET_PEER_BYTES 320

/* ---- Sockets -------------------------------------------------------------------------- */

/* Listen on "host:port" (SO_REUSEADDR, close-on-exec). Port 0 is allowed here (tests): the
 * kernel picks a free port, returned in *bound_port (may be NULL). */
int kvr_net_listen(const char *addr, int backlog, int *out_fd, uint16_t *bound_port,
                   struct kvr_err *err);
/* Accept one connection (waits until the deadline). The new socket has TCP_NODELAY and
 * close-on-exec set; `peer` (may be NULL) receives "ip:port" of the other side. */
int kvr_net_accept(int listen_fd, uint64_t deadline_ns, int *out_fd, char *peer, size_t peer_cap,
                   struct kvr_err *err);

/* Connect to "host:port" (every address the name resolves to, in order) before the
 * deadline. The socket has TCP_NODELAY and close-on-exec set. KVR_ECLOSED when the
 * connection is refused (nobody listens there yet: a caller waiting for a peer to start
 * retries), KVR_ETIMEDOUT, KVR_EINVAL for a malformed address, KVR_EIO otherwise. Name
 * resolution (getaddrinfo) is not bounded by the deadline. */
int kvr_net_connect(const char *addr, uint64_t deadline_ns, int *out_fd, struct kvr_err *err);

int kvr_net_set_nodelay(int fd, struct kvr_err *err);

/* Read exactly n bytes. Returns KVR_ECLOSED if the peer closed before the first byte,
 * KVR_EPROTO if it closed after some bytes but before n, KVR_ETIMEDOUT at the deadline,
 * KVR_EIO on a socket error. *got (may be NULL) counts the bytes read in any case. */
int kvr_net_read_full(int fd, void *buf, size_t n, uint64_t deadline_ns, size_t *got,
                      struct kvr_err *err);

/* Write every byte of the iovecs (handles partial writes; n_iov <= 16). KVR_ECLOSED if the
 * peer is gone (EPIPE/ECONNRESET), KVR_ETIMEDOUT, KVR_EIO. Nothing useful can be said
 * about how much was sent after a failure: the connection must be dropped. */
int kvr_net_writev_full(int fd, const struct iovec *iov, int n_iov, uint64_t deadline_ns,
                        struct kvr_err *err);

/* Deadline helper: kvr_now_ns() + timeout_ms, or 0 (forever) when timeout_ms < 0. */
uint64_t kvr_net_deadline(int timeout_ms);
/* A deadline that has already passed: the call does what it can without waiting (an
 * event loop's reads and accepts). */
#define KVR_NET_NOW 1ull

/* ---- Links ---------------------------------------------------------------------------- */

/* Which directions a link is set up for (kvr_link_init): a receiving link allocates a
 * buffer for the plan's largest frame, a sending one only the small record scratch. */
enum kvr_link_dir {
    KVR_LINK_SEND = 1u << 0,
    KVR_LINK_RECV = 1u << 1,
};

struct kvr_link {
    int fd; /* the socket, owned (closed by kvr_link_fini) */
    bool owns_fd;
    bool broken;                   /* a protocol or socket error happened: only fini */
    bool authenticated;            /* the handshake succeeded */
    struct kvr_auth_id peer_id;    /* who the peer proved to be (after the handshake) */
    char peer[KVR_NET_PEER_BYTES]; /* "stage 2 at 10.0.0.3:7002", for messages */

    struct kvr_wire_limits limits; /* what this side accepts (receiving side) */

    /* Sealing (seal.h): set up by the handshake when the plan says "encrypt". */
    bool sealed;
    struct kvr_seal seal_tx, seal_rx; /* each used by its direction's thread only */
    uint8_t *sealed_out;              /* the sealed frame being sent, owned (sending side) */
    size_t sealed_cap;

    /* Receive state (one frame at a time). */
    uint8_t hdr_buf[KVR_SEAL_SEALED_HEADER_BYTES]; /* the header (+ its tag when sealed) */
    size_t hdr_have;                               /* header bytes read so far */
    bool hdr_ok;                                   /* header decoded and validated into hdr */
    struct kvr_wire_header hdr;
    uint8_t *body; /* limits.max_frame_bytes, 64-byte aligned, owned */
    size_t body_cap;
    size_t body_have;
    struct kvr_wire_frame frame; /* the last frame received; valid until the next recv */

    /* Send state. A frame being sent without blocking (kvr_link_send_begin) keeps its
     * iovecs here until kvr_link_send_resume has written the last byte. */
    uint8_t *scratch; /* kvr_wire_scratch_bytes(&limits), owned */
    size_t scratch_cap;
    struct iovec tx_iov[KVR_WIRE_MAX_IOV];
    int tx_n_iov, tx_first;
    size_t tx_total;
    uint32_t tx_type;
    bool tx_pending; /* a frame is partly written */

    /* Counters (each written by its own direction's thread only). */
    uint64_t frames_in, bytes_in;
    uint64_t frames_out, bytes_out;
};

/* Take ownership of a connected socket `fd` (closed by kvr_link_fini, also when this
 * fails) and allocate the buffers for `dirs` (enum kvr_link_dir bits) from `limits`: the
 * limits of the RECEIVING end, on both ends (the sender builds them from the same plan with
 * kvr_wire_limits_init for its downstream, so its scratch fits every frame the receiver
 * accepts). `peer` describes the other side in messages ("127.0.0.1:7002"). */
int kvr_link_init(struct kvr_link *link, int fd, const char *peer,
                  const struct kvr_wire_limits *limits, uint32_t dirs, struct kvr_err *err);
/* Close the socket and free the buffers. Safe on a zeroed or failed link. */
void kvr_link_fini(struct kvr_link *link);

/* Run the handshake of auth.h on a freshly initialised link, for the process playing
 * `role` (and `index`, for a stage) in `plan`. The client is the side that connected (the
 * upstream); the server is the side that accepted (the downstream). The expected peer
 * follows from the topology above. Each waits at most timeout_ms for each message. On any
 * rejection both sides log the reason, the link is broken, and `err` says why, e.g. "peer
 * failed authentication: wrong cluster secret?". */
int kvr_link_handshake_client(struct kvr_link *link, const struct kvr_plan *plan,
                              enum kvr_auth_role role, uint32_t index, int timeout_ms,
                              struct kvr_err *err);
int kvr_link_handshake_server(struct kvr_link *link, const struct kvr_plan *plan,
                              enum kvr_auth_role role, uint32_t index, int timeout_ms,
                              struct kvr_err *err);
/* The bridge opening a control link to stage `index` (re-planning, DESIGN.md 8,
 * docs/PROTOCOL.md 6a): over it the bridge probes the stage or sends it a REPLAN frame. */
int kvr_link_handshake_control(struct kvr_link *link, const struct kvr_plan *plan, uint32_t index,
                               int timeout_ms, struct kvr_err *err);

/* The same handshake in steps, for an event loop that must not wait on one peer (a stage or
 * the bridge accepting its upstream): kvr_link_hs_begin on a freshly initialised link, then
 * kvr_link_hs_step whenever the socket is ready (readable, or writable when hs->want_write)
 * until it returns KVR_OK (the link is authenticated, as after kvr_link_handshake_*) or a
 * negative status (the link is broken and `err` says why, as above). KVR_EAGAIN: waiting
 * for the peer. Nothing in it waits; the caller keeps the deadline (hs->progress counts the
 * messages read and written, so a deadline per message can be reset on progress) and calls
 * kvr_link_hs_abort when it gives up, which wipes the secrets (kvr_link_fini follows). */
struct kvr_link_hs {
    struct kvr_auth a;
    uint8_t in[KVR_AUTH_MSG_BYTES], out[KVR_AUTH_MSG_BYTES];
    size_t n_in;            /* bytes of the next message read so far */
    size_t n_out, out_sent; /* the message to write (0: none), and how much of it went */
    int verdict;            /* != 0: the reply rejects the peer; the handshake fails after */
    struct kvr_err verdict_err;
    uint32_t progress; /* messages read or written */
    bool want_write;   /* KVR_EAGAIN: waiting to write, not to read */
    bool encrypt, active;
    bool control;  /* done: the peer was the bridge's control link (kvr_link_hs_begin_accept) */
    char want[48]; /* the expected peer, for the link's name */
};

int kvr_link_hs_begin(struct kvr_link *link, struct kvr_link_hs *hs, const struct kvr_plan *plan,
                      enum kvr_auth_role role, uint32_t index, bool is_client, struct kvr_err *err);
/* Stage `index` accepting a connection: its upstream, or the bridge's control link (then
 * hs->control is set once the handshake is done). */
int kvr_link_hs_begin_accept(struct kvr_link *link, struct kvr_link_hs *hs,
                             const struct kvr_plan *plan, uint32_t index, struct kvr_err *err);
int kvr_link_hs_step(struct kvr_link *link, struct kvr_link_hs *hs, struct kvr_err *err);
void kvr_link_hs_abort(struct kvr_link_hs *hs);

/* Both kinds of handshake with both identities given (an expert link, whose ends the
 * ring's topology does not name: a stage dials an agent, an agent accepts any stage with
 * KVR_AUTH_INDEX_ANY). link->peer_id is then the identity the peer proved. */
int kvr_link_hs_begin_ids(struct kvr_link *link, struct kvr_link_hs *hs,
                          const struct kvr_plan *plan, struct kvr_auth_id self,
                          struct kvr_auth_id peer, bool is_client, struct kvr_err *err);
int kvr_link_handshake_ids(struct kvr_link *link, const struct kvr_plan *plan,
                           struct kvr_auth_id self, struct kvr_auth_id peer, bool is_client,
                           int timeout_ms, struct kvr_err *err);

/* Receive the next frame into link->frame (*out points at it) before the deadline (0 =
 * wait forever). KVR_ETIMEDOUT leaves a partial frame buffered for the next call (the link
 * stays usable). KVR_ECLOSED: the peer closed the connection between frames. KVR_EPROTO:
 * the peer broke the protocol (bad header, limits, body, or closed mid-frame): the link is
 * broken and the reason logged. The frame's payload points into link->body and the records
 * into link->frame's arrays: both stay valid until the next kvr_link_recv. */
int kvr_link_recv(struct kvr_link *link, uint64_t deadline_ns, const struct kvr_wire_frame **out,
                  struct kvr_err *err);

/* A caller-owned place to receive one frame into (an input slot): a body buffer of the
 * plan's largest frame and the decoded records. kvr_link_recv_into decodes straight into
 * it, so a stage reads a batch into the slot it will compute from, with no copy. */
struct kvr_link_rx {
    uint8_t *body; /* 64-byte aligned, owned */
    size_t body_cap;
    struct kvr_wire_frame frame; /* the frame received; its payload points into body */
};

int kvr_link_rx_init(struct kvr_link_rx *rx, const struct kvr_wire_limits *limits,
                     struct kvr_err *err);
void kvr_link_rx_fini(struct kvr_link_rx *rx);

/* kvr_link_recv, but a frame with a body goes into *rx (and *out points at rx->frame).
 * rx may be NULL while the caller has no free slot: a frame without a body (HEARTBEAT,
 * GOODBYE, RESET) is still received, into the link's own frame; one with a body returns
 * KVR_EAGAIN with its header kept, to be continued by a later call with an rx. Once a body
 * has begun, later calls must pass the same rx until the frame is complete. */
int kvr_link_recv_into(struct kvr_link *link, struct kvr_link_rx *rx, uint64_t deadline_ns,
                       const struct kvr_wire_frame **out, struct kvr_err *err);

/* Sending without blocking (an event loop's, or a compute thread's hand-off):
 * kvr_link_send_begin encodes `msg` and writes what the socket takes now. 0: all sent;
 * KVR_EAGAIN: the rest is pending (link->tx_pending), msg's payload must stay valid, and
 * kvr_link_send_resume continues when the socket is writable (KVR_EAGAIN again while it
 * is not done). KVR_EBUSY if a frame is still pending. Any other failure breaks the link.
 * The caller enforces the deadline (a frame pending too long means a dead peer). */
int kvr_link_send_begin(struct kvr_link *link, const struct kvr_wire_msg *msg, struct kvr_err *err);
int kvr_link_send_resume(struct kvr_link *link, struct kvr_err *err);

/* Encode `msg` (wire.h) into the scratch buffer and send it with the payload straight
 * from msg->payload. Blocks until sent or the deadline. Any failure breaks the link. */
int kvr_link_send(struct kvr_link *link, const struct kvr_wire_msg *msg, uint64_t deadline_ns,
                  struct kvr_err *err);
int kvr_link_send_heartbeat(struct kvr_link *link, uint64_t seq, uint64_t deadline_ns,
                            struct kvr_err *err);
int kvr_link_send_goodbye(struct kvr_link *link, enum kvr_wire_goodbye reason, uint64_t deadline_ns,
                          struct kvr_err *err);

#endif
