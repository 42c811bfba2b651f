/* accept.c - handshakes of accepted links in steps inside an event loop (see accept.h). */
#include "ring/accept.h"

#include "core/clock.h"
#include "core/log.h"

#include <stdio.h>
#include <string.h>

#define MS_NS 1000000ull

static void arm_timer(struct kvr_accept *a)
{
    uint64_t next = 0;
    for (uint32_t i = 0; i < KVR_ACCEPT_SLOTS; i++)
        if (a->slot[i].used && (!next || a->slot[i].deadline_ns < next))
            next = a->slot[i].deadline_ns;
    kvr_ev_timer_at(a->ev, a->timer, next);
}

static void free_slot(struct kvr_accept *a, struct kvr_accept_slot *s)
{
    kvr_ev_unwatch(a->ev, s->link.fd);
    kvr_link_hs_abort(&s->hs);
    kvr_link_fini(&s->link);
    s->used = s->held = false;
}

static void refuse(struct kvr_accept *a, struct kvr_accept_slot *s, const char *why)
{
    KVR_WARN("%s: refused connection from %s: %s", a->cfg.name, s->peer, why);
    free_slot(a, s);
}

void kvr_accept_take(struct kvr_accept *a, struct kvr_accept_slot *s, struct kvr_link *out)
{
    kvr_ev_unwatch(a->ev, s->link.fd);
    *out = s->link;
    s->link = (struct kvr_link){.fd = -1};
    s->used = s->held = false;
}

void kvr_accept_release(struct kvr_accept *a, struct kvr_accept_slot *s)
{
    free_slot(a, s);
    arm_timer(a);
}

/* The peer's socket is ready: take its handshake a step further (or, held, the owner's). */
static void on_slot(struct kvr_ev *ev, int fd, uint32_t events, void *arg)
{
    (void)events;
    struct kvr_accept_slot *s = arg;
    struct kvr_accept *a = s->acc;
    if (s->held) {
        a->cfg.more(a->cfg.ctx, s);
        arm_timer(a);
        return;
    }
    struct kvr_err err = {0};
    int rc = kvr_link_hs_step(&s->link, &s->hs, &err);
    if (rc == KVR_EAGAIN) {
        if (s->hs.progress != s->seen) {
            s->seen = s->hs.progress;
            s->deadline_ns = kvr_now_ns() + (uint64_t)a->cfg.handshake_ms * MS_NS;
            arm_timer(a);
        }
        kvr_ev_events(ev, fd, s->hs.want_write ? KVR_EV_WRITE : KVR_EV_READ);
        return;
    }
    if (rc) {
        refuse(a, s, err.msg);
    } else {
        a->cfg.done(a->cfg.ctx, s);
        if (s->used && !s->held) { /* left to the owner: its frame is awaited */
            s->held = true;
            s->deadline_ns = kvr_now_ns() + (uint64_t)a->cfg.handshake_ms * MS_NS;
            kvr_ev_events(ev, fd, KVR_EV_READ);
            a->cfg.more(a->cfg.ctx, s);
        }
    }
    arm_timer(a);
}

/* A handshake message (or a held slot's frame) that did not come in time: refused. */
static void on_timer(struct kvr_ev *ev, void *arg)
{
    (void)ev;
    struct kvr_accept *a = arg;
    uint64_t now = kvr_now_ns();
    char why[64];
    snprintf(why, sizeof why, "no handshake message from the peer within %d ms",
             a->cfg.handshake_ms);
    for (uint32_t i = 0; i < KVR_ACCEPT_SLOTS; i++)
        if (a->slot[i].used && a->slot[i].deadline_ns <= now)
            refuse(a, &a->slot[i], why);
    arm_timer(a);
}

/* A peer connects: a slot (a free one, else the oldest's) and the first step. */
static void on_listen(struct kvr_ev *ev, int fd, uint32_t events, void *arg)
{
    (void)events;
    struct kvr_accept *a = arg;
    struct kvr_err err = {0};
    int cfd;
    char peer[KVR_NET_PEER_BYTES];
    if (kvr_net_accept(fd, KVR_NET_NOW, &cfd, peer, sizeof peer, &err))
        return;
    struct kvr_accept_slot *s = NULL;
    for (uint32_t i = 0; i < KVR_ACCEPT_SLOTS; i++)
        if (!a->slot[i].used)
            s = &a->slot[i];
        else if (!s || (s->used && a->slot[i].since_ns < s->since_ns))
            s = &a->slot[i];
    if (s->used)
        refuse(a, s, "more connections are being authenticated; this is the oldest");
    s->link = (struct kvr_link){.fd = -1};
    snprintf(s->peer, sizeof s->peer, "%s", peer);
    if (kvr_link_init(&s->link, cfd, peer, a->cfg.limits, a->cfg.dirs, &err)) {
        KVR_WARN("%s: cannot set up link from %s: %s", a->cfg.name, peer, err.msg);
        arm_timer(a);
        return;
    }
    if (a->cfg.begin(a->cfg.ctx, &s->link, &s->hs, &err)) {
        KVR_WARN("%s: refused connection from %s: %s", a->cfg.name, peer, err.msg);
        kvr_link_fini(&s->link);
        arm_timer(a);
        return;
    }
    s->used = true;
    s->held = false;
    s->seen = s->hs.progress;
    s->since_ns = kvr_now_ns();
    s->deadline_ns = s->since_ns + (uint64_t)a->cfg.handshake_ms * MS_NS;
    if (kvr_ev_watch(ev, s->link.fd, KVR_EV_READ, on_slot, s)) {
        refuse(a, s, "cannot watch its socket");
        arm_timer(a);
        return;
    }
    arm_timer(a);
    on_slot(ev, s->link.fd, KVR_EV_READ, s); /* its hello may be there already */
}

int kvr_accept_start(struct kvr_accept *a, struct kvr_ev *ev, int listen_fd,
                     const struct kvr_accept_config *cfg, struct kvr_err *err)
{
    memset(a, 0, sizeof *a);
    a->cfg = *cfg;
    a->ev = ev;
    for (uint32_t i = 0; i < KVR_ACCEPT_SLOTS; i++) {
        a->slot[i].acc = a;
        a->slot[i].link.fd = -1;
    }
    if ((a->timer = kvr_ev_timer(ev, on_timer, a)) < 0)
        return kvr_err_set(err, KVR_ENOMEM, "%s: no timer left in the event loop", cfg->name);
    int rc = kvr_ev_watch(ev, listen_fd, KVR_EV_READ, on_listen, a);
    return rc ? kvr_err_set(err, rc, "%s: cannot watch the listening socket", cfg->name) : KVR_OK;
}

void kvr_accept_fini(struct kvr_accept *a)
{
    for (uint32_t i = 0; i < KVR_ACCEPT_SLOTS; i++)
        if (a->slot[i].used)
            free_slot(a, &a->slot[i]);
}
