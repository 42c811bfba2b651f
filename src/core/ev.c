/* ev.c - the event loop (see ev.h). */
#include "core/ev.h"

#include "core/alloc.h"
#include "core/clock.h"

#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

struct watch {
    int fd; /* -1: free slot */
    uint32_t events;
    kvr_ev_fd_fn fn;
    void *arg;
};

struct timer {
    bool used;
    uint64_t deadline_ns; /* 0: disarmed */
    kvr_ev_fn fn;
    void *arg;
};

struct kvr_ev {
    int epfd, wakefd, timerfd;
    struct watch watches[KVR_EV_MAX_FDS];
    struct timer timers[KVR_EV_MAX_TIMERS];
    uint64_t armed_ns; /* what timerfd is set to (0: disarmed) */
    kvr_ev_fn wake_fn;
    void *wake_arg;
    atomic_bool stop;
};

/* epoll_event.data.u32 tags the two internal fds apart from the watches' slot indexes. */
enum { TAG_WAKE = KVR_EV_MAX_FDS, TAG_TIMER = KVR_EV_MAX_FDS + 1 };

static uint32_t to_epoll(uint32_t events)
{
    return (events & KVR_EV_READ ? EPOLLIN : 0u) | (events & KVR_EV_WRITE ? EPOLLOUT : 0u);
}

void kvr_ev_destroy(struct kvr_ev *ev)
{
    if (!ev)
        return;
    if (ev->epfd >= 0)
        close(ev->epfd);
    if (ev->wakefd >= 0)
        close(ev->wakefd);
    if (ev->timerfd >= 0)
        close(ev->timerfd);
    kvr_free(ev);
}

int kvr_ev_create(struct kvr_ev **out, struct kvr_err *err)
{
    *out = NULL;
    struct kvr_ev *ev = kvr_calloc(1, sizeof *ev);
    if (!ev)
        return kvr_err_set(err, KVR_ENOMEM, "event loop: out of memory");
    for (int i = 0; i < KVR_EV_MAX_FDS; i++)
        ev->watches[i].fd = -1;
    ev->epfd = epoll_create1(EPOLL_CLOEXEC);
    ev->wakefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    ev->timerfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
    if (ev->epfd < 0 || ev->wakefd < 0 || ev->timerfd < 0)
        goto fail;
    struct epoll_event we = {.events = EPOLLIN, .data.u32 = TAG_WAKE};
    struct epoll_event te = {.events = EPOLLIN, .data.u32 = TAG_TIMER};
    if (epoll_ctl(ev->epfd, EPOLL_CTL_ADD, ev->wakefd, &we) ||
        epoll_ctl(ev->epfd, EPOLL_CTL_ADD, ev->timerfd, &te))
        goto fail;
    *out = ev;
    return KVR_OK;
fail:;
    int e = errno;
    kvr_ev_destroy(ev);
    return kvr_err_set(err, KVR_EIO, "event loop: %s", strerror(e));
}

static struct watch *find(struct kvr_ev *ev, int fd)
{
    for (int i = 0; i < KVR_EV_MAX_FDS; i++)
        if (ev->watches[i].fd == fd)
            return &ev->watches[i];
    return NULL;
}

int kvr_ev_watch(struct kvr_ev *ev, int fd, uint32_t events, kvr_ev_fd_fn fn, void *arg)
{
    struct watch *w = find(ev, fd);
    bool add = w == NULL;
    if (add && !(w = find(ev, -1)))
        return KVR_ENOMEM;
    struct epoll_event e = {.events = to_epoll(events), .data.u32 = (uint32_t)(w - ev->watches)};
    if (epoll_ctl(ev->epfd, add ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, fd, &e))
        return KVR_EIO;
    *w = (struct watch){fd, events, fn, arg};
    return KVR_OK;
}

int kvr_ev_events(struct kvr_ev *ev, int fd, uint32_t events)
{
    struct watch *w = find(ev, fd);
    if (!w)
        return KVR_EINVAL;
    if (w->events == events)
        return KVR_OK;
    struct epoll_event e = {.events = to_epoll(events), .data.u32 = (uint32_t)(w - ev->watches)};
    if (epoll_ctl(ev->epfd, EPOLL_CTL_MOD, fd, &e))
        return KVR_EIO;
    w->events = events;
    return KVR_OK;
}

void kvr_ev_unwatch(struct kvr_ev *ev, int fd)
{
    struct watch *w = fd >= 0 ? find(ev, fd) : NULL;
    if (!w)
        return;
    epoll_ctl(ev->epfd, EPOLL_CTL_DEL, fd, NULL);
    w->fd = -1;
    w->fn = NULL;
}

int kvr_ev_timer(struct kvr_ev *ev, kvr_ev_fn fn, void *arg)
{
    for (int i = 0; i < KVR_EV_MAX_TIMERS; i++)
        if (!ev->timers[i].used) {
            ev->timers[i] = (struct timer){true, 0, fn, arg};
            return i;
        }
    return -1;
}

/* Point the timerfd at the earliest armed deadline (or disarm it). */
static void rearm(struct kvr_ev *ev)
{
    uint64_t first = 0;
    for (int i = 0; i < KVR_EV_MAX_TIMERS; i++) {
        uint64_t d = ev->timers[i].deadline_ns;
        if (d && (!first || d < first))
            first = d;
    }
    if (first == ev->armed_ns)
        return;
    ev->armed_ns = first;
    struct itimerspec its = {0};
    if (first) {
        its.it_value.tv_sec = (time_t)(first / 1000000000ull);
        its.it_value.tv_nsec = (long)(first % 1000000000ull);
    }
    timerfd_settime(ev->timerfd, TFD_TIMER_ABSTIME, &its, NULL);
}

void kvr_ev_timer_at(struct kvr_ev *ev, int id, uint64_t deadline_ns)
{
    if (id < 0 || id >= KVR_EV_MAX_TIMERS)
        return;
    ev->timers[id].deadline_ns = deadline_ns == UINT64_MAX ? 0 : deadline_ns; /* 0: disarmed */
    rearm(ev);
}

void kvr_ev_on_wake(struct kvr_ev *ev, kvr_ev_fn fn, void *arg)
{
    ev->wake_fn = fn;
    ev->wake_arg = arg;
}

void kvr_ev_wake(struct kvr_ev *ev)
{
    uint64_t one = 1;
    ssize_t n = write(ev->wakefd, &one, sizeof one);
    (void)n; /* EAGAIN: the counter is already non-zero, a wake-up is pending */
}

void kvr_ev_stop(struct kvr_ev *ev)
{
    atomic_store(&ev->stop, true);
    kvr_ev_wake(ev);
}

static void run_timers(struct kvr_ev *ev)
{
    uint64_t buf;
    ssize_t n = read(ev->timerfd, &buf, sizeof buf);
    (void)n;
    uint64_t now = kvr_now_ns();
    /* Expired timers fire in deadline order, however late the turn: a callback that re-arms
     * a timer for a deadline that has passed too sees it fire in its place in this pass.
     * At most 4 x KVR_EV_MAX_TIMERS callbacks a pass; the rest wait for the next turn (the
     * timerfd then points into the past and fires at once), so a callback re-arming in the
     * past cannot hold the loop. */
    for (int fired = 0; fired < 4 * KVR_EV_MAX_TIMERS; fired++) {
        struct timer *next = NULL;
        for (int i = 0; i < KVR_EV_MAX_TIMERS; i++) {
            struct timer *t = &ev->timers[i];
            if (t->deadline_ns && t->deadline_ns <= now &&
                (!next || t->deadline_ns < next->deadline_ns))
                next = t;
        }
        if (!next)
            break;
        next->deadline_ns = 0; /* one-shot: the callback may arm it again */
        next->fn(ev, next->arg);
    }
    ev->armed_ns = UINT64_MAX; /* the timerfd fired: force rearm() to set it again */
    rearm(ev);
}

int kvr_ev_run(struct kvr_ev *ev)
{
    struct epoll_event evs[KVR_EV_MAX_FDS + 2];
    while (!atomic_load(&ev->stop)) {
        int n = epoll_wait(ev->epfd, evs, KVR_EV_MAX_FDS + 2, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return KVR_EIO;
        }
        for (int i = 0; i < n && !atomic_load(&ev->stop); i++) {
            uint32_t tag = evs[i].data.u32;
            if (tag == TAG_WAKE) {
                uint64_t buf;
                ssize_t r = read(ev->wakefd, &buf, sizeof buf);
                (void)r;
                if (ev->wake_fn)
                    ev->wake_fn(ev, ev->wake_arg);
            } else if (tag == TAG_TIMER) {
                run_timers(ev);
            } else if (tag < KVR_EV_MAX_FDS) {
                struct watch *w = &ev->watches[tag];
                if (w->fd < 0 || !w->fn)
                    continue; /* unwatched by an earlier callback of this turn */
                uint32_t e = evs[i].events, got = 0;
                got |= e & EPOLLIN ? KVR_EV_READ : 0u;
                got |= e & EPOLLOUT ? KVR_EV_WRITE : 0u;
                got |= e & (EPOLLERR | EPOLLHUP) ? KVR_EV_ERROR : 0u;
                w->fn(ev, w->fd, got, w->arg);
            }
        }
    }
    return KVR_OK;
}
