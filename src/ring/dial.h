/* dial.h - a thread that dials a process's downstream and authenticates it, so the
 * process's event loop never blocks in a connect or a handshake.
 *
 * Every process of a ring both accepts (its upstream) and dials (its downstream), and all
 * of them start at once: if each event loop did its own blocking handshake, a ring of
 * loops each waiting for the next to answer would stall until the handshake timeouts.
 * The dialer thread does the connect (with a deadline) and the handshake (auth.h, each
 * message within handshake_ms), then hands the link over and wakes the loop; it sleeps on a
 * condition variable while it has nothing to do. A refused connection (the peer is
 * restarting) is dialled again every 5 ms for up to 10 s, so a restarted peer is linked
 * within moments of listening; other failures back off from 50 ms doubling to
 * backoff_max_ms.
 *
 *   kvr_dialer_start(&d, &cfg)       the thread starts dialling at once
 *   kvr_dialer_take(d, &link)        in the loop's wake-up: a dialled link, if one is ready
 *   kvr_dialer_redial(d)             the link was lost: dial again (at once, or after
 *                                    50 ms if it was lost within 1 s of being made)
 *   kvr_dialer_stop(d)               joins the thread, closes a link not taken
 *
 * Threads: take, redial and last_error from any thread (one mutex); the config's pointers
 * are borrowed and must outlive the dialer. */
#ifndef KVR_RING_DIAL_H
#define KVR_RING_DIAL_H

#include "core/err.h"
#include "core/ev.h"
#include "ring/auth.h"
#include "ring/net.h"
#include "ring/plan.h"
#include "ring/wire.h"

#include <stdbool.h>
#include <stddef.h>

struct kvr_dialer_config {
    const struct kvr_plan *plan;
    const char *addr;                     /* the downstream's "host:port" */
    const struct kvr_wire_limits *limits; /* what the downstream accepts */
    enum kvr_auth_role role;              /* who we are: the bridge, or stage `index` */
    uint32_t index;
    const char *name; /* for log lines: "bridge", "stage 1" */
    int handshake_ms;
    uint32_t backoff_max_ms;
    struct kvr_ev *wake; /* woken when a link is ready; NULL: the owner polls take */
    /* Expert links (experts.h): the peer's identity when the topology does not give it
     * (NULL: the downstream of role/index), and the link's directions (0: KVR_LINK_SEND). */
    const struct kvr_auth_id *peer;
    uint32_t dirs;
};

struct kvr_dialer;

int kvr_dialer_start(struct kvr_dialer **out, const struct kvr_dialer_config *cfg,
                     struct kvr_err *err);
void kvr_dialer_stop(struct kvr_dialer *d);
/* A dialled, authenticated link (moved into *link; the caller owns it now), or false. */
bool kvr_dialer_take(struct kvr_dialer *d, struct kvr_link *link);
/* Dial again: at once, or after 50 ms when the last link lived less than a second. */
void kvr_dialer_redial(struct kvr_dialer *d);
/* The last failure ("" if none) into buf. Returns whether it changed since the last call. */
bool kvr_dialer_last_error(struct kvr_dialer *d, char *buf, size_t cap);

#endif
