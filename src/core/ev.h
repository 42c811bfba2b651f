/* ev.h - a small event loop (in the manner of Redis's ae.c) on epoll, one eventfd and one
 * timerfd: every socket of a process is watched by the one loop that owns it, timers are
 * deadlines on kvr_now_ns()'s clock, and other threads wake the loop through the eventfd.
 * Nothing in it sleeps or polls: an idle loop blocks in epoll_wait until a socket, a timer
 * or a wake-up has something for it.
 *
 *   kvr_ev_create(&ev)                        one per I/O thread
 *   kvr_ev_watch(ev, fd, KVR_EV_READ, fn, arg)  fn(ev, fd, events, arg) when ready
 *   kvr_ev_timer(ev, fn, arg) -> id; kvr_ev_timer_at(ev, id, deadline_ns)  one-shot, re-armable
 *   kvr_ev_on_wake(ev, fn, arg); kvr_ev_wake(ev)   from any thread
 *   kvr_ev_run(ev) until kvr_ev_stop(ev)        (stop: from any thread)
 *
 * Limits: KVR_EV_MAX_FDS watched fds and KVR_EV_MAX_TIMERS timers, fixed at create (no
 * allocation afterwards). Callbacks may watch, unwatch and re-arm anything, including the
 * fd or timer they were called for.
 *
 * Threads: everything but kvr_ev_wake and kvr_ev_stop is called from the loop's own thread
 * (or before it runs). */
#ifndef KVR_CORE_EV_H
#define KVR_CORE_EV_H

#include "core/err.h"

#include <stdbool.h>
#include <stdint.h>

#define KVR_EV_MAX_FDS 16
#define KVR_EV_MAX_TIMERS 16

enum kvr_ev_flag {
    KVR_EV_READ = 1u << 0,
    KVR_EV_WRITE = 1u << 1,
    KVR_EV_ERROR = 1u << 2, /* reported only: hang-up or socket error */
};

struct kvr_ev;

typedef void (*kvr_ev_fd_fn)(struct kvr_ev *ev, int fd, uint32_t events, void *arg);
typedef void (*kvr_ev_fn)(struct kvr_ev *ev, void *arg);

int kvr_ev_create(struct kvr_ev **out, struct kvr_err *err);
void kvr_ev_destroy(struct kvr_ev *ev);

/* Watch fd for `events` (KVR_EV_READ / KVR_EV_WRITE bits; 0 keeps it registered but
 * quiet), calling fn; watching an fd already watched changes its events and callback. */
int kvr_ev_watch(struct kvr_ev *ev, int fd, uint32_t events, kvr_ev_fd_fn fn, void *arg);
/* Change the events of a watched fd. */
int kvr_ev_events(struct kvr_ev *ev, int fd, uint32_t events);
/* Stop watching fd (before closing it). No-op if it is not watched. */
void kvr_ev_unwatch(struct kvr_ev *ev, int fd);

/* A timer slot calling fn when its deadline passes; -1 if all are taken. Disarmed. */
int kvr_ev_timer(struct kvr_ev *ev, kvr_ev_fn fn, void *arg);
/* Arm timer `id` for deadline_ns (kvr_now_ns() clock; a past deadline fires at the next
 * turn of the loop), or disarm it with 0 or UINT64_MAX. One-shot: it fires once per arming. */
void kvr_ev_timer_at(struct kvr_ev *ev, int id, uint64_t deadline_ns);

/* What to call when another thread calls kvr_ev_wake (several wakes may merge into one
 * call). */
void kvr_ev_on_wake(struct kvr_ev *ev, kvr_ev_fn fn, void *arg);
void kvr_ev_wake(struct kvr_ev *ev);

/* Run until kvr_ev_stop. Returns 0, or KVR_EIO if epoll itself fails. */
int kvr_ev_run(struct kvr_ev *ev);
void kvr_ev_stop(struct kvr_ev *ev);

#endif
