/* http_door.c - the HTTP connection guard (see http_door.h).
 *
 * Each state with a deadline keeps its connections in a list ordered by the time they
 * entered it; all of a list share one timeout, so the head is always the first to expire
 * and the oldest to evict. Closing a connection only shuts its socket down and takes it off
 * the lists; the record stays until libmicrohttpd reports the close, so the socket is never
 * touched after libmicrohttpd has closed it (its close notification comes first). */
#include "bridge/http_door.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/err.h"
#include "core/log.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define NS_PER_S 1000000000ull
/* Refusals and closings are summed over windows this long: one log line per window. */
#define WINDOW_NS (10 * NS_PER_S)
/* libmicrohttpd messages logged per burst before the rest are only counted. */
#define MESSAGES_PER_WINDOW 3

enum list {
    LIST_FRESH,
    LIST_IDLE,
    LIST_BODY,
    LIST_COUNT,
    LIST_NONE = LIST_COUNT /* working, closing, or free */
};

struct kvr_http_door_conn {
    int fd;
    enum list list;
    bool closing;      /* shut down by the door, not yet reported closed */
    uint64_t since_ns; /* when it entered its list */
    struct kvr_http_door_conn *prev, *next;
};

struct queue {
    struct kvr_http_door_conn *head, *tail;
    uint32_t n;
    uint64_t timeout_ns;
    enum kvr_http_door_reason reason; /* why its expired connections are closed */
};

struct kvr_http_door {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_t thread;
    bool has_thread, stop;
    struct kvr_http_door_config cfg;
    uint32_t waiting_cap; /* fresh + idle may hold this many slots */
    uint32_t capacity;    /* records: max_connections and room for those being closed */
    struct kvr_http_door_conn *conns, *free_list;
    struct queue q[LIST_COUNT];
    uint32_t n_live;    /* records in use */
    uint32_t n_closing; /* ... of them shut down by the door */
    uint64_t count[KVR_HTTP_DOOR_REASON_COUNT];
    /* The log window: counts since window_ns (0: no window open). */
    uint64_t window_ns;
    uint64_t win[KVR_HTTP_DOOR_REASON_COUNT];
    uint32_t win_messages, win_suppressed;
};

static const char *const reason_names[KVR_HTTP_DOOR_REASON_COUNT] = {
    [KVR_HTTP_DOOR_HEADER_TIMEOUT] = "header_timeout",
    [KVR_HTTP_DOOR_BODY_TIMEOUT] = "body_timeout",
    [KVR_HTTP_DOOR_IDLE_TIMEOUT] = "idle_timeout",
    [KVR_HTTP_DOOR_EVICTED] = "evicted",
    [KVR_HTTP_DOOR_REFUSED_FULL] = "refused_full",
    [KVR_HTTP_DOOR_REFUSED_CLIENT] = "refused_per_client",
};

/* ---- lists ---------------------------------------------------------------------------- */

static void unlink_conn(struct kvr_http_door *d, struct kvr_http_door_conn *c)
{
    if (c->list == LIST_NONE)
        return;
    struct queue *q = &d->q[c->list];
    if (c->prev)
        c->prev->next = c->next;
    else
        q->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        q->tail = c->prev;
    q->n--;
    c->prev = c->next = NULL;
    c->list = LIST_NONE;
}

/* Append to a list; wake the thread if the list was empty (its head sets the next wake). */
static void enter(struct kvr_http_door *d, struct kvr_http_door_conn *c, enum list l,
                  uint64_t now_ns)
{
    unlink_conn(d, c);
    struct queue *q = &d->q[l];
    c->list = l;
    c->since_ns = now_ns;
    c->prev = q->tail;
    c->next = NULL;
    if (q->tail)
        q->tail->next = c;
    else
        q->head = c;
    q->tail = c;
    if (q->n++ == 0)
        pthread_cond_signal(&d->wake);
}

/* ---- events and the log window ---------------------------------------------------------- */

static void note(struct kvr_http_door *d, enum kvr_http_door_reason why, uint64_t now_ns)
{
    d->count[why]++;
    d->win[why]++;
    if (!d->window_ns) {
        d->window_ns = now_ns ? now_ns : 1;
        pthread_cond_signal(&d->wake);
    }
}

/* Shut the connection's socket down (its thread sees the end and libmicrohttpd closes it). */
static void close_conn(struct kvr_http_door *d, struct kvr_http_door_conn *c,
                       enum kvr_http_door_reason why, uint64_t now_ns)
{
    unlink_conn(d, c);
    if (c->closing)
        return;
    c->closing = true;
    d->n_closing++;
    if (c->fd >= 0)
        shutdown(c->fd, SHUT_RDWR);
    note(d, why, now_ns);
}

/* One line for the window that ended: what was closed and refused, and why (only the
 * kinds that happened). */
static void write_summary(struct kvr_http_door *d, uint64_t now_ns)
{
    const struct kvr_http_door_config *c = &d->cfg;
    char line[512];
    size_t n = 0;
#define PART(cond, ...)                                                                            \
    if ((cond) && n < sizeof line)                                                                 \
    n += (size_t)snprintf(line + n, sizeof line - n, __VA_ARGS__)
    uint64_t *w = d->win;
    PART(w[KVR_HTTP_DOOR_REFUSED_CLIENT], ", %llu refused (%u per client)",
         (unsigned long long)w[KVR_HTTP_DOOR_REFUSED_CLIENT], c->max_per_client);
    PART(w[KVR_HTTP_DOOR_REFUSED_FULL], ", %llu refused (all %u busy with requests)",
         (unsigned long long)w[KVR_HTTP_DOOR_REFUSED_FULL], c->max_connections);
    PART(w[KVR_HTTP_DOOR_EVICTED], ", %llu waiting ones closed to make room",
         (unsigned long long)w[KVR_HTTP_DOOR_EVICTED]);
    PART(w[KVR_HTTP_DOOR_HEADER_TIMEOUT], ", %llu closed without request headers after %u s",
         (unsigned long long)w[KVR_HTTP_DOOR_HEADER_TIMEOUT], c->header_timeout_s);
    PART(w[KVR_HTTP_DOOR_BODY_TIMEOUT], ", %llu closed without the whole body after %u s",
         (unsigned long long)w[KVR_HTTP_DOOR_BODY_TIMEOUT], c->body_timeout_s);
    PART(d->win_suppressed, ", %u more libmicrohttpd messages", d->win_suppressed);
#undef PART
    if (n)
        KVR_WARN("http: connections in the last %.0f s%s; %u open of %u",
                 (double)(now_ns - d->window_ns) / 1e9, line, d->n_live - d->n_closing,
                 c->max_connections);
    memset(d->win, 0, sizeof d->win);
    d->win_suppressed = 0;
    /* A quiet window ends the burst: the next event opens a new one, which may show a few
     * libmicrohttpd messages again; a burst that goes on shows none but its summaries. */
    if (!n)
        d->win_messages = 0;
    d->window_ns = n ? now_ns : 0;
}

/* ---- the deadline thread ---------------------------------------------------------------- */

static uint64_t tick_locked(struct kvr_http_door *d, uint64_t now_ns)
{
    uint64_t next = UINT64_MAX;
    for (int l = 0; l < LIST_COUNT; l++) {
        struct queue *q = &d->q[l];
        while (q->head && q->head->since_ns + q->timeout_ns <= now_ns) {
            /* Idle keep-alive connections run out as a matter of course: counted, and only
             * logged when other trouble opened a window. */
            struct kvr_http_door_conn *c = q->head;
            if (q->reason == KVR_HTTP_DOOR_IDLE_TIMEOUT) {
                unlink_conn(d, c);
                c->closing = true;
                d->n_closing++;
                shutdown(c->fd, SHUT_RDWR);
                d->count[q->reason]++;
            } else {
                close_conn(d, c, q->reason, now_ns);
            }
        }
        if (q->head && q->head->since_ns + q->timeout_ns < next)
            next = q->head->since_ns + q->timeout_ns;
    }
    if (d->window_ns && now_ns >= d->window_ns + WINDOW_NS)
        write_summary(d, now_ns);
    if (d->window_ns && d->window_ns + WINDOW_NS < next)
        next = d->window_ns + WINDOW_NS;
    return next;
}

uint64_t kvr_http_door_tick(struct kvr_http_door *d, uint64_t now_ns)
{
    pthread_mutex_lock(&d->mu);
    uint64_t next = tick_locked(d, now_ns);
    pthread_mutex_unlock(&d->mu);
    return next;
}

/* Sleep until the next deadline (or a signal that a list got its first connection). The
 * condition variable waits on CLOCK_REALTIME; the deadline is converted per wait. */
static void *door_main(void *arg)
{
    struct kvr_http_door *d = arg;
    pthread_mutex_lock(&d->mu);
    while (!d->stop) {
        uint64_t now = kvr_now_ns();
        uint64_t next = tick_locked(d, now);
        if (next == UINT64_MAX) {
            pthread_cond_wait(&d->wake, &d->mu);
            continue;
        }
        uint64_t wait_ns = next > now ? next - now : 0;
        if (wait_ns > NS_PER_S)
            wait_ns = NS_PER_S;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t at = (uint64_t)ts.tv_sec * NS_PER_S + (uint64_t)ts.tv_nsec + wait_ns + 1000000;
        ts.tv_sec = (time_t)(at / NS_PER_S);
        ts.tv_nsec = (long)(at % NS_PER_S);
        pthread_cond_timedwait(&d->wake, &d->mu, &ts);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* ---- create / destroy ------------------------------------------------------------------- */

/* Connections the door has shut down stay open until their threads notice (milliseconds):
 * records (and libmicrohttpd's own limit) leave room for an eighth more of them. */
static uint32_t capacity_of(uint32_t max_connections)
{
    return max_connections + max_connections / 8 + 8;
}

uint32_t kvr_http_door_capacity(const struct kvr_http_door *d)
{
    return d->capacity;
}

int kvr_http_door_create(struct kvr_http_door **out, const struct kvr_http_door_config *cfg)
{
    *out = NULL;
    if (!cfg->max_connections || !cfg->header_timeout_s || !cfg->body_timeout_s ||
        !cfg->idle_timeout_s)
        return KVR_EINVAL;
    struct kvr_http_door *d = kvr_calloc(1, sizeof *d);
    if (!d)
        return KVR_ENOMEM;
    d->capacity = capacity_of(cfg->max_connections);
    d->conns = kvr_calloc(d->capacity, sizeof *d->conns);
    if (!d->conns) {
        kvr_free(d);
        return KVR_ENOMEM;
    }
    d->cfg = *cfg;
    uint32_t reserve = cfg->max_connections / 8;
    d->waiting_cap = cfg->max_connections - reserve;
    for (uint32_t i = d->capacity; i-- > 0;) {
        d->conns[i].list = LIST_NONE;
        d->conns[i].next = d->free_list;
        d->free_list = &d->conns[i];
    }
    const uint32_t timeouts[LIST_COUNT] = {cfg->header_timeout_s, cfg->idle_timeout_s,
                                           cfg->body_timeout_s};
    const enum kvr_http_door_reason reasons[LIST_COUNT] = {
        KVR_HTTP_DOOR_HEADER_TIMEOUT, KVR_HTTP_DOOR_IDLE_TIMEOUT, KVR_HTTP_DOOR_BODY_TIMEOUT};
    for (int l = 0; l < LIST_COUNT; l++) {
        d->q[l].timeout_ns = timeouts[l] * NS_PER_S;
        d->q[l].reason = reasons[l];
    }
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->wake, NULL);
    if (cfg->thread) {
        if (pthread_create(&d->thread, NULL, door_main, d) != 0) {
            kvr_http_door_destroy(d);
            return KVR_EIO;
        }
        d->has_thread = true;
    }
    *out = d;
    return KVR_OK;
}

void kvr_http_door_destroy(struct kvr_http_door *d)
{
    if (!d)
        return;
    if (d->has_thread) {
        pthread_mutex_lock(&d->mu);
        d->stop = true;
        pthread_cond_signal(&d->wake);
        pthread_mutex_unlock(&d->mu);
        pthread_join(d->thread, NULL);
    }
    pthread_cond_destroy(&d->wake);
    pthread_mutex_destroy(&d->mu);
    kvr_free(d->conns);
    kvr_free(d);
}

/* ---- connections ------------------------------------------------------------------------ */

bool kvr_http_door_admit(struct kvr_http_door *d, uint64_t now_ns)
{
    pthread_mutex_lock(&d->mu);
    /* The newcomer is not counted until it is opened: libmicrohttpd may still refuse it
     * after this (its per-client limit), and opens it at once, on this thread, if not. */
    uint32_t used = d->n_live - d->n_closing;
    uint32_t waiting = d->q[LIST_FRESH].n + d->q[LIST_IDLE].n;
    while (waiting >= d->waiting_cap || used >= d->cfg.max_connections) {
        struct kvr_http_door_conn *victim =
            d->q[LIST_IDLE].head ? d->q[LIST_IDLE].head : d->q[LIST_FRESH].head;
        if (!victim)
            break;
        close_conn(d, victim, KVR_HTTP_DOOR_EVICTED, now_ns);
        used--;
        waiting--;
    }
    bool ok = used < d->cfg.max_connections;
    if (!ok)
        note(d, KVR_HTTP_DOOR_REFUSED_FULL, now_ns);
    pthread_mutex_unlock(&d->mu);
    return ok;
}

struct kvr_http_door_conn *kvr_http_door_opened(struct kvr_http_door *d, int fd, uint64_t now_ns)
{
    pthread_mutex_lock(&d->mu);
    struct kvr_http_door_conn *c = d->free_list;
    if (c) {
        d->free_list = c->next;
        memset(c, 0, sizeof *c);
        c->fd = fd;
        c->list = LIST_NONE;
        d->n_live++;
        enter(d, c, LIST_FRESH, now_ns);
    }
    pthread_mutex_unlock(&d->mu);
    return c;
}

void kvr_http_door_headers(struct kvr_http_door *d, struct kvr_http_door_conn *c, uint64_t now_ns)
{
    if (!c)
        return;
    pthread_mutex_lock(&d->mu);
    if (!c->closing)
        enter(d, c, LIST_BODY, now_ns);
    pthread_mutex_unlock(&d->mu);
}

void kvr_http_door_working(struct kvr_http_door *d, struct kvr_http_door_conn *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&d->mu);
    unlink_conn(d, c);
    pthread_mutex_unlock(&d->mu);
}

void kvr_http_door_idle(struct kvr_http_door *d, struct kvr_http_door_conn *c, uint64_t now_ns)
{
    if (!c)
        return;
    pthread_mutex_lock(&d->mu);
    if (!c->closing)
        enter(d, c, LIST_IDLE, now_ns);
    pthread_mutex_unlock(&d->mu);
}

void kvr_http_door_closed(struct kvr_http_door *d, struct kvr_http_door_conn *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&d->mu);
    unlink_conn(d, c);
    if (c->closing)
        d->n_closing--;
    d->n_live--;
    c->fd = -1;
    c->next = d->free_list;
    d->free_list = c;
    pthread_mutex_unlock(&d->mu);
}

void kvr_http_door_refused(struct kvr_http_door *d, enum kvr_http_door_reason why, uint64_t now_ns)
{
    if ((unsigned)why >= KVR_HTTP_DOOR_REASON_COUNT)
        return;
    pthread_mutex_lock(&d->mu);
    note(d, why, now_ns);
    pthread_mutex_unlock(&d->mu);
}

void kvr_http_door_message(struct kvr_http_door *d, const char *msg, uint64_t now_ns)
{
    pthread_mutex_lock(&d->mu);
    bool show = d->win_messages < MESSAGES_PER_WINDOW;
    if (show)
        d->win_messages++;
    else
        d->win_suppressed++;
    if (!d->window_ns) {
        d->window_ns = now_ns ? now_ns : 1;
        pthread_cond_signal(&d->wake);
    }
    pthread_mutex_unlock(&d->mu);
    if (show)
        KVR_INFO("http: %s", msg);
}

/* ---- reading ---------------------------------------------------------------------------- */

uint32_t kvr_http_door_open(struct kvr_http_door *d)
{
    pthread_mutex_lock(&d->mu);
    uint32_t n = d->n_live - d->n_closing;
    pthread_mutex_unlock(&d->mu);
    return n;
}

uint64_t kvr_http_door_count(struct kvr_http_door *d, enum kvr_http_door_reason why)
{
    if ((unsigned)why >= KVR_HTTP_DOOR_REASON_COUNT)
        return 0;
    pthread_mutex_lock(&d->mu);
    uint64_t n = d->count[why];
    pthread_mutex_unlock(&d->mu);
    return n;
}

void kvr_http_door_print(struct kvr_http_door *d, struct kvr_sbuf *out)
{
    pthread_mutex_lock(&d->mu);
    kvr_sbuf_printf(out,
                    "# HELP kvasir:http_connections_open HTTP connections open.\n"
                    "# TYPE kvasir:http_connections_open gauge\n"
                    "kvasir:http_connections_open %u\n"
                    "# HELP kvasir:http_connections_closed_total HTTP connections the server "
                    "closed or refused to protect itself, by reason.\n"
                    "# TYPE kvasir:http_connections_closed_total counter\n",
                    d->n_live - d->n_closing);
    for (int r = 0; r < KVR_HTTP_DOOR_REASON_COUNT; r++)
        kvr_sbuf_printf(out, "kvasir:http_connections_closed_total{reason=\"%s\"} %llu\n",
                        reason_names[r], (unsigned long long)d->count[r]);
    pthread_mutex_unlock(&d->mu);
}
