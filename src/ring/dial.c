/* dial.c - the dialer thread (see dial.h). */
#include "ring/dial.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* A refused connection means the peer's host answers but nothing listens on the port yet:
 * its process is (re)starting, and will listen within moments. It is dialled again every
 * REFUSED_RETRY_MS, so the link is back as soon as the peer listens, not on the next tick
 * of a backoff; after REFUSED_FAST_MS of refusals in a row the peer is taken for down and
 * the backoff applies. Any other failure (a timeout, a failed handshake) backs off from
 * BACKOFF_MIN_MS. A link lost within YOUNG_MS of being made is redialled after
 * BACKOFF_MIN_MS, so a peer that drops every link at once is not dialled in a loop; an
 * older one at once. */
enum {
    BACKOFF_MIN_MS = 50,
    REFUSED_RETRY_MS = 5,
    REFUSED_FAST_MS = 10000,
    YOUNG_MS = 1000,
    CONNECT_MS = 1000
};

struct kvr_dialer {
    struct kvr_dialer_config cfg;
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool stop;
    bool want;      /* a link is wanted */
    bool redialled; /* ... again, after one was lost */
    bool have;      /* `ready` holds a link not taken yet */
    struct kvr_link ready;
    uint32_t backoff_ms;
    uint64_t refused_since_ns; /* first refusal of the current run of them; 0: none */
    uint64_t linked_ns;        /* when the last link was made */
    char error[KVR_ERR_MSG_BYTES];
    bool error_new;
};

/* Wait up to ms (or until stop). Lock held. */
static void pause_ms(struct kvr_dialer *d, uint32_t ms)
{
    struct timespec ts = kvr_deadline_after_ms(ms);
    while (!d->stop)
        if (pthread_cond_timedwait(&d->cond, &d->lock, &ts) == ETIMEDOUT)
            break;
}

/* Whether msg is news. */
static bool set_error(struct kvr_dialer *d, const char *msg)
{
    if (strcmp(d->error, msg) == 0)
        return false;
    snprintf(d->error, sizeof d->error, "%s", msg);
    d->error_new = true;
    return true;
}

static void *dial_main(void *arg)
{
    struct kvr_dialer *d = arg;
    const struct kvr_dialer_config *c = &d->cfg;
    pthread_mutex_lock(&d->lock);
    for (;;) {
        while (!d->stop && (!d->want || d->have))
            pthread_cond_wait(&d->cond, &d->lock);
        if (d->stop)
            break;
        if (d->redialled) {
            d->redialled = false;
            if (kvr_now_ns() - d->linked_ns < (uint64_t)YOUNG_MS * 1000000u) {
                pause_ms(d, BACKOFF_MIN_MS);
                if (d->stop)
                    break;
            }
        }
        pthread_mutex_unlock(&d->lock);
        struct kvr_err err = {0};
        struct kvr_link link = {.fd = -1};
        int fd;
        bool ok = false, refused = false;
        int rc = kvr_net_connect(c->addr, kvr_net_deadline(CONNECT_MS), &fd, &err);
        if (rc == 0) {
            uint32_t dirs = c->dirs ? c->dirs : KVR_LINK_SEND;
            ok = kvr_link_init(&link, fd, c->addr, c->limits, dirs, &err) == 0 &&
                 (c->peer ? kvr_link_handshake_ids(&link, c->plan,
                                                   (struct kvr_auth_id){c->role, c->index},
                                                   *c->peer, true, c->handshake_ms, &err)
                          : kvr_link_handshake_client(&link, c->plan, c->role, c->index,
                                                      c->handshake_ms, &err)) == 0;
            if (!ok) {
                KVR_WARN("%s: downstream %s: %s", c->name, c->addr, err.msg);
                kvr_link_fini(&link);
            }
        } else {
            refused = rc == KVR_ECLOSED;
            if (!refused && d->backoff_ms >= c->backoff_max_ms)
                KVR_DEBUG("%s: cannot reach downstream %s: %s", c->name, c->addr, err.msg);
        }
        pthread_mutex_lock(&d->lock);
        if (ok) {
            KVR_INFO("%s: downstream %s connected", c->name, c->addr);
            d->ready = link;
            d->have = true;
            d->want = false;
            d->backoff_ms = BACKOFF_MIN_MS;
            d->refused_since_ns = 0;
            d->linked_ns = kvr_now_ns();
            if (c->wake)
                kvr_ev_wake(c->wake);
            continue;
        }
        if (set_error(d, err.msg) && c->wake)
            kvr_ev_wake(c->wake); /* the loop may show the error (/health) */
        uint64_t now = kvr_now_ns();
        if (!refused)
            d->refused_since_ns = 0;
        else if (!d->refused_since_ns)
            d->refused_since_ns = now;
        if (refused && now - d->refused_since_ns < (uint64_t)REFUSED_FAST_MS * 1000000u) {
            pause_ms(d, REFUSED_RETRY_MS);
            continue;
        }
        pause_ms(d, d->backoff_ms);
        d->backoff_ms =
            d->backoff_ms * 2 > c->backoff_max_ms ? c->backoff_max_ms : d->backoff_ms * 2;
    }
    pthread_mutex_unlock(&d->lock);
    return NULL;
}

int kvr_dialer_start(struct kvr_dialer **out, const struct kvr_dialer_config *cfg,
                     struct kvr_err *err)
{
    *out = NULL;
    struct kvr_dialer *d = kvr_calloc(1, sizeof *d);
    if (!d)
        return kvr_err_set(err, KVR_ENOMEM, "%s: out of memory", cfg->name);
    d->cfg = *cfg;
    d->want = true;
    d->backoff_ms = BACKOFF_MIN_MS;
    d->ready.fd = -1;
    pthread_mutex_init(&d->lock, NULL);
    pthread_cond_init(&d->cond, NULL);
    if (pthread_create(&d->thread, NULL, dial_main, d) != 0) {
        pthread_mutex_destroy(&d->lock);
        pthread_cond_destroy(&d->cond);
        kvr_free(d);
        return kvr_err_set(err, KVR_ENOMEM, "%s: cannot start the dialler thread", cfg->name);
    }
    *out = d;
    return KVR_OK;
}

void kvr_dialer_stop(struct kvr_dialer *d)
{
    if (!d)
        return;
    pthread_mutex_lock(&d->lock);
    d->stop = true;
    pthread_cond_broadcast(&d->cond);
    pthread_mutex_unlock(&d->lock);
    pthread_join(d->thread, NULL);
    if (d->have)
        kvr_link_fini(&d->ready);
    pthread_mutex_destroy(&d->lock);
    pthread_cond_destroy(&d->cond);
    kvr_free(d);
}

bool kvr_dialer_take(struct kvr_dialer *d, struct kvr_link *link)
{
    pthread_mutex_lock(&d->lock);
    bool have = d->have;
    if (have) {
        *link = d->ready;
        memset(&d->ready, 0, sizeof d->ready);
        d->ready.fd = -1;
        d->have = false;
        d->error[0] = 0;
    }
    pthread_mutex_unlock(&d->lock);
    return have;
}

void kvr_dialer_redial(struct kvr_dialer *d)
{
    pthread_mutex_lock(&d->lock);
    d->want = true;
    d->redialled = true;
    pthread_cond_broadcast(&d->cond);
    pthread_mutex_unlock(&d->lock);
}

bool kvr_dialer_last_error(struct kvr_dialer *d, char *buf, size_t cap)
{
    pthread_mutex_lock(&d->lock);
    snprintf(buf, cap, "%s", d->error);
    bool changed = d->error_new;
    d->error_new = false;
    pthread_mutex_unlock(&d->lock);
    return changed;
}
