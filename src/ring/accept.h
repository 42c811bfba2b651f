/* accept.h - the accepting side of links, inside an event loop (core/ev.h): a stage taking
 * its upstream or the bridge's control link, an expert agent taking its stages. Each
 * connection's handshake runs in steps (net.h kvr_link_hs_*) whenever its socket is ready,
 * so a peer that connects and says nothing delays nobody: up to KVR_ACCEPT_SLOTS at once,
 * each handshake message due within cfg.handshake_ms of the last (a timer refuses a late
 * peer), the oldest giving way when another connects while all are busy, and a peer that
 * fails the handshake refused with the reason logged ("NAME: refused connection from PEER:
 * WHY").
 *
 * Once a handshake succeeds, cfg.done is called with the slot. It either takes the link
 * (kvr_accept_take, which stops watching its fd and frees the slot), or leaves it: the
 * slot is then held (a control link whose one frame is awaited), its deadline runs on, and
 * each readiness of its socket calls cfg.more until the owner calls kvr_accept_release.
 *
 * Ownership: the owner's struct (no allocation); the listening fd stays the owner's.
 * Threads: the loop's thread only. */
#ifndef KVR_RING_ACCEPT_H
#define KVR_RING_ACCEPT_H

#include "core/err.h"
#include "core/ev.h"
#include "ring/net.h"

#include <stdbool.h>
#include <stdint.h>

#define KVR_ACCEPT_SLOTS 4

struct kvr_accept;

struct kvr_accept_slot {
    struct kvr_accept *acc;
    bool used;
    bool held; /* authenticated, left to the owner (cfg.more) */
    struct kvr_link link;
    struct kvr_link_hs hs;
    uint32_t seen;        /* hs.progress when the deadline was last set */
    uint64_t deadline_ns; /* the next handshake message (or a held slot's frame) is due */
    uint64_t since_ns;    /* accepted then (the oldest gives way) */
    char peer[KVR_NET_PEER_BYTES];
};

struct kvr_accept_config {
    const char *name;                     /* log prefix ("stage 1"); kept */
    const struct kvr_wire_limits *limits; /* of the accepted links; kept */
    uint32_t dirs;                        /* KVR_LINK_SEND / KVR_LINK_RECV */
    int handshake_ms;
    /* Begin the handshake on a fresh link (kvr_link_hs_begin_accept or _ids). */
    int (*begin)(void *ctx, struct kvr_link *link, struct kvr_link_hs *hs, struct kvr_err *err);
    void (*done)(void *ctx, struct kvr_accept_slot *s);
    void (*more)(void *ctx, struct kvr_accept_slot *s); /* NULL if done always takes */
    void *ctx;
};

struct kvr_accept {
    struct kvr_accept_config cfg;
    struct kvr_ev *ev;
    int timer; /* the earliest deadline of the slots */
    struct kvr_accept_slot slot[KVR_ACCEPT_SLOTS];
};

/* Start accepting on listen_fd (watched by ev from now on). */
int kvr_accept_start(struct kvr_accept *a, struct kvr_ev *ev, int listen_fd,
                     const struct kvr_accept_config *cfg, struct kvr_err *err);
/* Move an authenticated slot's link to *out (from cfg.done). */
void kvr_accept_take(struct kvr_accept *a, struct kvr_accept_slot *s, struct kvr_link *out);
/* Close a held slot's link (quietly) and free the slot. */
void kvr_accept_release(struct kvr_accept *a, struct kvr_accept_slot *s);
/* Abort every handshake under way and close every slot's link (before the loop goes). */
void kvr_accept_fini(struct kvr_accept *a);

#endif
