/* bridge.c - the bridge's shell around its scheduler (see bridge.h and sched.h).
 *
 * Reading order: streams (what a consumer sees, fed by the scheduler's events), the links,
 * the ring thread, then the public API.
 *
 * One mutex (b->lock) guards the scheduler and every stream's queue. The ring thread holds
 * it while the scheduler builds a batch or applies a result, never while it does I/O.
 *
 * The ring thread is one event loop (core/ev.h) owning every socket. They are the
 * listening socket (the tail dials in), the head link (batches out, credits and acks back)
 * and the tail link (results, RESETs and heartbeats in). Sends never block: a batch the socket does
 * not take at once goes on when it is writable. The head is dialled and authenticated by a dialler
 * thread (ring/dial.h), so the loop never waits in a handshake. Timers replace every poll:
 * the head's heartbeat and liveness (credit.h: dead when it answers nothing for
 * KVR_CREDIT_DEAD_MS), and the scheduler's own deadlines (kvr_sched_tick). An idle ring
 * wakes the thread only for heartbeats.
 *
 * Re-planning (docs/PROTOCOL.md 6a). A timer at the end of the grace period starts an
 * attempt on a thread of its own. That thread reads only a copy of the plan and the head's
 * limits, and writes only the next plan and its verdict before it says it is done. The
 * ring thread joins it. If stages took the new plan, the ring thread follows it: it drops
 * its links, replaces the plan under the lock with the dialler stopped, and dials the new
 * head. */
#include "bridge/bridge.h"
#include "bridge/telemetry.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/ev.h"
#include "core/log.h"
#include "ring/credit.h"
#include "ring/dial.h"
#include "ring/net.h"
#include "ring/propose.h"
#include "ring/wire.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum {
    TAIL_CREDITS = 4, /* result frames the tail may send ahead of our reading */
    HANDSHAKE_MS = 3000,
    BACKOFF_MAX_MS = 1000,     /* dialling the head again while it cannot be reached */
    CONTROL_CONNECT_MS = 1000, /* a control link's connect (re-planning) */
    REPLAN_SETTLE_MS = 60000,  /* after a re-plan, the stages restart and load their layers:
                                  a stage still loading must not be taken for lost */
    DIAL_GRACE_MS = 30000,     /* a head that does not listen this long after start is news:
                                  stages of a large model take seconds to load */
};

#define MS_NS 1000000ull

/* ---- streams ---------------------------------------------------------------------------- */

/* A queued TOKEN event: the token fields of its struct kvr_gen_event, which next() copies
 * back into one. Not the whole event: a stream queues up to max_tokens of them, and each
 * kvr_gen_event carries a KVR_GEN_MSG_BYTES error string that only the end uses. */
struct token_event {
    int32_t token;
    float logprob;
    uint8_t eog;
    uint8_t n_top; /* alternatives at tops[its index x req.top_logprobs] */
    uint64_t t_ns;
};

struct kvr_gen_stream {
    struct kvr_sched_req r; /* r.req.prompt points at `prompt` */
    struct kvr_bridge *b;
    int32_t *prompt;     /* [n_prompt], owned */
    char *grammar;       /* [grammar_bytes], owned; r.req.grammar points at it */
    int32_t *prediction; /* [n_prediction], owned (r.req.prediction), or NULL */
    /* Produced by the scheduler's events, consumed by next(): a FIFO of tokens. */
    struct token_event *events;     /* [max_tokens] */
    struct kvr_token_logprob *tops; /* [max_tokens x req.top_logprobs], or NULL */
    uint32_t ev_head, ev_count;
    enum kvr_gen_finish finish; /* set once the stream has ended */
    bool finish_delivered;
    bool released; /* the consumer is done with it */
    bool detached; /* the scheduler is done with it */
    char message[KVR_GEN_MSG_BYTES];
    pthread_cond_t cond;
};

struct kvr_bridge {
    struct kvr_plan plan;
    struct kvr_bridge_config cfg;
    struct kvr_wire_limits head_limits; /* what stage 0 accepts */
    struct kvr_wire_limits tail_limits; /* what we accept from the tail */

    pthread_mutex_t lock;
    struct kvr_sched *sched;
    pthread_cond_t up_cond;
    /* kvr_bridge_wait_any: a count of stream events, and its waiters. */
    uint64_t n_events;
    uint32_t any_waiters;
    pthread_cond_t any_cond;
    atomic_bool ring_up; /* the scheduler's ring_up, readable without the lock */
    struct kvr_bridge_stage_state stages[KVR_PLAN_MAX_STAGES]; /* for /health */

    /* The event loop and the links, owned by the ring thread. */
    struct kvr_ev *ev;
    int t_tick, t_heartbeat;   /* timers */
    struct kvr_dialer *dialer; /* dials and authenticates the head (ring/dial.h) */
    int listen_fd;
    struct kvr_link head, tail;
    bool have_head, have_tail;
    uint32_t head_credits;  /* frames stage 0 has room for (credit.h) */
    uint64_t head_await_ns; /* something sent to the head it has not answered */
    uint64_t head_last_send_ns;
    uint64_t n_heartbeats;
    atomic_bool stop;
    pthread_t thread;
    bool thread_started;

    /* Re-planning (ring thread; the attempt's thread reads only replan_old and writes only
     * replan_new and replan_ok before it sets replan_done). */
    int t_replan;
    bool ever_up;                  /* the ring has been whole once: a lost stage is lost */
    uint64_t created_ns;           /* a failed dial before the ring forms is no news for a
                                      while (DIAL_GRACE_MS) */
    bool said_waiting;             /* "waiting for the head" logged */
    uint64_t down_since_ns;        /* when it last broke */
    uint64_t replan_not_before_ns; /* a grace period after the last attempt */
    bool replan_running;
    atomic_bool replan_done;
    bool replan_ok; /* replan_new is the plan the acknowledging stages now follow */
    pthread_t replan_thread;
    struct kvr_plan *replan_old, *replan_new;

    struct kvr_telemetry *telemetry; /* fed by the scheduler, read by kvr_bridge_telemetry */
};

static void wake(struct kvr_bridge *b)
{
    kvr_ev_wake(b->ev);
}

static void stream_free(struct kvr_gen_stream *s)
{
    pthread_cond_destroy(&s->cond);
    kvr_free(s->events);
    kvr_free(s->tops);
    kvr_free(s->r.generated);
    kvr_free(s->prompt);
    kvr_free(s->grammar);
    kvr_free(s->prediction);
    kvr_free(s);
}

/* The scheduler's stream events (caller holds b->lock). */
static void on_event(void *ctx, struct kvr_sched_req *r, const struct kvr_sched_event *ev)
{
    struct kvr_bridge *b = ctx;
    struct kvr_gen_stream *s = r->user;
    switch (ev->type) {
    case KVR_SCHED_EV_TOKEN: {
        uint32_t cap = s->r.req.max_tokens;
        if (s->ev_count < cap) {
            uint32_t at = (s->ev_head + s->ev_count) % cap, k = s->r.req.top_logprobs;
            uint32_t n_top = !s->tops ? 0 : ev->gen.n_top < k ? ev->gen.n_top : k;
            s->events[at] = (struct token_event){ev->gen.token, ev->gen.logprob, ev->gen.eog,
                                                 (uint8_t)n_top, ev->gen.t_ns};
            if (n_top)
                memcpy(s->tops + (size_t)at * k, ev->gen.top, n_top * sizeof *s->tops);
            s->ev_count++;
        }
        break;
    }
    case KVR_SCHED_EV_END:
        s->finish = ev->gen.finish;
        snprintf(s->message, sizeof s->message, "%s", ev->gen.error);
        break;
    case KVR_SCHED_EV_DETACH:
        s->detached = true;
        if (s->released)
            stream_free(s);
        return;
    default:
        return;
    }
    pthread_cond_signal(&s->cond);
    b->n_events++;
    if (b->any_waiters)
        pthread_cond_broadcast(&b->any_cond);
}

/* A stage's state for /health (caller holds b->lock); why (may be NULL) becomes its last
 * error. */
static void stage_set(struct kvr_bridge *b, uint32_t i, enum kvr_stage_state state, const char *why)
{
    struct kvr_bridge_stage_state *st = &b->stages[i];
    if (st->state != state) {
        st->state = state;
        st->since_ns = kvr_now_ns();
    }
    if (why) { /* cut to fit: the start of a message says the most */
        size_t n = 0;
        for (; n + 1 < sizeof st->last_error && why[n]; n++)
            st->last_error[n] = why[n];
        st->last_error[n] = 0;
    }
}

static void stage_set_locked(struct kvr_bridge *b, uint32_t i, enum kvr_stage_state state,
                             const char *why)
{
    pthread_mutex_lock(&b->lock);
    stage_set(b, i, state, why);
    pthread_mutex_unlock(&b->lock);
}

/* Mirror the scheduler's ring state for lock-free readers (caller holds b->lock). */
static void sync_up(struct kvr_bridge *b)
{
    bool up = kvr_sched_ring_up(b->sched);
    if (up != atomic_load(&b->ring_up)) {
        atomic_store(&b->ring_up, up);
        if (up && !b->ever_up) /* what the start-up waited for was no failure */
            for (uint32_t i = 0; i < b->plan.n_stages; i++)
                b->stages[i].last_error[0] = 0;
        if (up)
            b->ever_up = true;
        else
            b->down_since_ns = kvr_now_ns();
        for (uint32_t i = 0; i < b->plan.n_stages; i++)
            if (up || b->stages[i].state == KVR_STAGE_UP)
                stage_set(b, i, up ? KVR_STAGE_UP : KVR_STAGE_UNKNOWN, NULL);
        if (up)
            pthread_cond_broadcast(&b->up_cond);
    }
}

/* ---- links ---------------------------------------------------------------------------------- */

static void arm_tick(struct kvr_bridge *b);
static void fill(struct kvr_bridge *b);

/* Close both links and tell the scheduler; dialling starts again. */
static void ring_down(struct kvr_bridge *b, const char *why)
{
    if (b->have_head) {
        kvr_ev_unwatch(b->ev, b->head.fd);
        kvr_link_fini(&b->head);
    }
    if (b->have_tail) {
        kvr_ev_unwatch(b->ev, b->tail.fd);
        kvr_link_fini(&b->tail);
    }
    b->have_head = b->have_tail = false;
    b->head_await_ns = 0;
    kvr_ev_events(b->ev, b->listen_fd, KVR_EV_READ);
    pthread_mutex_lock(&b->lock);
    kvr_sched_link_down(b->sched, why, kvr_now_ns());
    sync_up(b);
    stage_set(b, 0, KVR_STAGE_DOWN, why);
    stage_set(b, b->plan.n_stages - 1, KVR_STAGE_DOWN, why);
    pthread_mutex_unlock(&b->lock);
    kvr_ev_timer_at(b->ev, b->t_heartbeat, 0);
    if (b->dialer)
        kvr_dialer_redial(b->dialer);
    arm_tick(b);
}

/* Something went to the head: from now on it owes us a byte (credit or ack). */
static void sent_to_head(struct kvr_bridge *b, uint64_t now)
{
    b->head_last_send_ns = now;
    if (!b->head_await_ns)
        b->head_await_ns = now;
}

/* The head's credits and acks (credit.h), or its close. */
static void on_head(struct kvr_ev *ev, int fd, uint32_t events, void *arg)
{
    struct kvr_bridge *b = arg;
    struct kvr_err err = {0};
    if (events & KVR_EV_WRITE) {
        int rc = kvr_link_send_resume(&b->head, &err);
        if (rc && rc != KVR_EAGAIN) {
            ring_down(b, err.msg);
            return;
        }
        if (rc == 0)
            kvr_ev_events(ev, fd, KVR_EV_READ);
    }
    if (events & (KVR_EV_READ | KVR_EV_ERROR)) {
        bool heard = false;
        int rc = kvr_credit_read(fd, &b->head_credits, &heard);
        if (rc) {
            ring_down(b, rc == KVR_ECLOSED ? "the head closed its link"
                                           : "the head sent garbage instead of credits");
            return;
        }
        if (heard)
            b->head_await_ns = 0;
    }
    fill(b);
}

/* Frames from the tail: results, RESETs, heartbeats (answered with an ack). */
static void on_tail(struct kvr_ev *ev, int fd, uint32_t events, void *arg)
{
    (void)ev;
    (void)fd;
    (void)events;
    struct kvr_bridge *b = arg;
    for (;;) {
        struct kvr_err err = {0};
        const struct kvr_wire_frame *f;
        int rc = kvr_link_recv(&b->tail, KVR_NET_NOW, &f, &err);
        if (rc == KVR_ETIMEDOUT)
            break;
        if (rc) {
            ring_down(b, rc == KVR_ECLOSED ? "the tail closed its link" : err.msg);
            return;
        }
        uint32_t type = f->hdr.type;
        if (type == KVR_WIRE_HEARTBEAT) {
            if (kvr_credit_ack(b->tail.fd)) {
                ring_down(b, "the tail went away");
                return;
            }
            continue;
        }
        if (type == KVR_WIRE_GOODBYE) {
            ring_down(b, "the tail said goodbye");
            return;
        }
        pthread_mutex_lock(&b->lock);
        uint64_t now = kvr_now_ns();
        if (type == KVR_WIRE_RESET) {
            /* Every stage resets when its upstream link comes up, the first time too: with
             * no sequence held that drops nothing, and /health shows no error for it. */
            struct kvr_sched_stats held;
            kvr_sched_stats(b->sched, &held);
            const char *why = NULL;
            if (f->hdr.batch_id != KVR_WIRE_RESET_LINK)
                why = "dropped its sequences: it could not run a batch";
            else if (held.running + held.waiting > 0)
                why = "dropped its sequences: its upstream link changed";
            kvr_sched_reset(b->sched, f->hdr.arg, f->hdr.batch_id, now);
            if (f->hdr.arg < b->plan.n_stages)
                stage_set(b, f->hdr.arg, KVR_STAGE_DOWN, why);
        } else if (type == KVR_WIRE_RESULT)
            rc = kvr_sched_result(b->sched, f, now, &err);
        sync_up(b);
        pthread_mutex_unlock(&b->lock);
        if (rc) {
            ring_down(b, err.msg);
            return;
        }
        if (type == KVR_WIRE_RESULT && kvr_credit_grant(b->tail.fd, 1)) {
            ring_down(b, "the tail went away");
            return;
        }
    }
    arm_tick(b);
    fill(b);
}

/* Both links are up: credits to the tail, a probe round the ring. */
static void links_up(struct kvr_bridge *b)
{
    b->head_credits = 0;
    b->head_await_ns = 0;
    b->head_last_send_ns = kvr_now_ns();
    if (kvr_credit_grant(b->tail.fd, TAIL_CREDITS) ||
        kvr_ev_watch(b->ev, b->head.fd, KVR_EV_READ, on_head, b)) {
        ring_down(b, "the tail went away");
        return;
    }
    pthread_mutex_lock(&b->lock);
    kvr_sched_link_up(b->sched, kvr_now_ns());
    pthread_mutex_unlock(&b->lock);
    KVR_INFO("bridge: links up; waiting for a batch to go round the ring");
    kvr_ev_timer_at(b->ev, b->t_heartbeat, kvr_now_ns() + KVR_CREDIT_HEARTBEAT_MS * MS_NS);
    fill(b);
}

/* The tail dials us: accept and authenticate it (the handshake waits at most
 * HANDSHAKE_MS per message). Only one tail at a time: the listening socket is not watched
 * while we have one. */
static void on_listen(struct kvr_ev *ev, int fd, uint32_t events, void *arg)
{
    (void)events;
    struct kvr_bridge *b = arg;
    struct kvr_err err = {0};
    int cfd;
    char peer[KVR_NET_PEER_BYTES];
    if (b->have_tail || kvr_net_accept(fd, KVR_NET_NOW, &cfd, peer, sizeof peer, &err))
        return;
    if (kvr_link_init(&b->tail, cfd, peer, &b->tail_limits, KVR_LINK_RECV, &err) == 0 &&
        kvr_link_handshake_server(&b->tail, &b->plan, KVR_AUTH_ROLE_BRIDGE, 0, HANDSHAKE_MS,
                                  &err) == 0) {
        b->have_tail = true;
        kvr_ev_events(ev, fd, 0);
        KVR_INFO("bridge: tail connected from %s", peer);
        stage_set_locked(b, b->plan.n_stages - 1, KVR_STAGE_CONNECTED, NULL);
        /* Read it at once, so its heartbeats are answered while the head is not up yet. */
        if (kvr_ev_watch(ev, b->tail.fd, KVR_EV_READ, on_tail, b)) {
            kvr_link_fini(&b->tail);
            b->have_tail = false;
            kvr_ev_events(ev, fd, KVR_EV_READ);
            return;
        }
        if (b->have_head)
            links_up(b);
    } else {
        KVR_WARN("bridge: refused connection from %s: %s", peer, err.msg);
        kvr_link_fini(&b->tail);
        stage_set_locked(b, b->plan.n_stages - 1, b->stages[b->plan.n_stages - 1].state, err.msg);
    }
}

/* The dialler (ring/dial.h) connects and authenticates the head off this thread; here
 * its link is taken, or its last failure shown (/health, and the log once per failure). */
static void check_dialer(struct kvr_bridge *b)
{
    if (b->have_head || !b->dialer)
        return;
    if (kvr_dialer_take(b->dialer, &b->head)) {
        b->have_head = true;
        stage_set_locked(b, 0, KVR_STAGE_CONNECTED, NULL);
        if (b->have_tail)
            links_up(b);
        else
            KVR_INFO("bridge: waiting for the tail (stage %u) to connect to %s",
                     b->plan.n_stages - 1, b->plan.bridge_addr);
        return;
    }
    char why[KVR_ERR_MSG_BYTES];
    if (kvr_dialer_last_error(b->dialer, why, sizeof why) && why[0]) {
        /* While the ring first forms, the head is expected not to listen yet (serve starts
         * it with the bridge): one line says what the bridge waits for, the failures are
         * debug; once the ring has been up, or after the grace, each one is a warning. */
        bool news = b->ever_up || kvr_now_ns() - b->created_ns > DIAL_GRACE_MS * MS_NS;
        if (news)
            KVR_WARN("bridge: cannot reach the head (stage 0) at %s: %s", b->plan.stages[0].addr,
                     why);
        else if (!b->said_waiting)
            KVR_INFO("bridge: waiting for the head (stage 0) at %s", b->plan.stages[0].addr);
        if (!news)
            KVR_DEBUG("bridge: head (stage 0) at %s: %s", b->plan.stages[0].addr, why);
        b->said_waiting = true;
        stage_set_locked(b, 0, b->stages[0].state, why);
    }
}

/* Liveness of the head (credit.h). A heartbeat goes out after a second without a frame.
 * The head is dead when it has answered nothing for KVR_CREDIT_DEAD_MS since something was
 * sent to it. That is also the deadline of a frame it does not take off the socket. */
static void on_heartbeat_timer(struct kvr_ev *ev, void *arg)
{
    struct kvr_bridge *b = arg;
    if (!b->have_head || !b->have_tail)
        return;
    uint64_t now = kvr_now_ns();
    if (b->head_await_ns && now - b->head_await_ns >= KVR_CREDIT_DEAD_MS * MS_NS) {
        char why[160];
        snprintf(why, sizeof why, "the head stopped reading: nothing back for %d ms%s",
                 KVR_CREDIT_DEAD_MS, b->head.tx_pending ? ", a frame half sent" : "");
        ring_down(b, why);
        return;
    }
    if (now - b->head_last_send_ns >= KVR_CREDIT_HEARTBEAT_MS * MS_NS && !b->head.tx_pending) {
        struct kvr_wire_msg m = {.type = KVR_WIRE_HEARTBEAT, .batch_id = ++b->n_heartbeats};
        struct kvr_err err = {0};
        int rc = kvr_link_send_begin(&b->head, &m, &err);
        if (rc && rc != KVR_EAGAIN) {
            ring_down(b, err.msg);
            return;
        }
        if (rc == KVR_EAGAIN)
            kvr_ev_events(ev, b->head.fd, KVR_EV_READ | KVR_EV_WRITE);
        sent_to_head(b, now);
    }
    uint64_t next = b->head_last_send_ns + KVR_CREDIT_HEARTBEAT_MS * MS_NS;
    if (b->head_await_ns && b->head_await_ns + KVR_CREDIT_DEAD_MS * MS_NS < next)
        next = b->head_await_ns + KVR_CREDIT_DEAD_MS * MS_NS;
    kvr_ev_timer_at(ev, b->t_heartbeat, next > now ? next : now + MS_NS);
}

/* ---- re-planning (DESIGN.md 8, docs/PLAN.md "Re-planning") ------------------------------ */

/* The address of stage i of p, or of spare i - n_stages. */
static const char *member_addr(const struct kvr_plan *p, uint32_t i)
{
    return i < p->n_stages ? p->stages[i].addr : p->spares[i - p->n_stages].addr;
}

/* A control link to stage i of p, or spare i - n_stages, connected and authenticated (0),
 * or a negative status with *why set. */
static int control_link(struct kvr_bridge *b, const struct kvr_plan *p, uint32_t i,
                        struct kvr_link *l, struct kvr_err *why)
{
    int fd;
    int rc = kvr_net_connect(member_addr(p, i), kvr_net_deadline(CONTROL_CONNECT_MS), &fd, why);
    if (rc)
        return rc;
    *l = (struct kvr_link){.fd = -1};
    if ((rc = kvr_link_init(l, fd, member_addr(p, i), &b->head_limits, KVR_LINK_SEND, why)))
        return rc;
    if ((rc = kvr_link_handshake_control(l, p, i, HANDSHAKE_MS, why)))
        kvr_link_fini(l);
    return rc;
}

/* Probe member i of p (stage, or spare i - n_stages): a control link, then GOODBYE. */
static bool probe(struct kvr_bridge *b, const struct kvr_plan *p, uint32_t i)
{
    struct kvr_link l;
    struct kvr_err why = {0};
    if (control_link(b, p, i, &l, &why)) {
        if (i < p->n_stages)
            KVR_WARN("bridge: re-plan: stage %u (%s) does not answer: %s", i, member_addr(p, i),
                     why.msg);
        else
            KVR_WARN("bridge: re-plan: spare %u (%s) does not answer: %s", i - p->n_stages,
                     member_addr(p, i), why.msg);
        return false;
    }
    kvr_link_send_goodbye(&l, KVR_WIRE_GOODBYE_SHUTDOWN, kvr_net_deadline(HANDSHAKE_MS), &why);
    kvr_link_fini(&l);
    return true;
}

/* The attempt, on a thread of its own, since connects and handshakes block.
 *   1. Probe every stage of the plan (a control link, then GOODBYE).
 *   2. If some do not answer, probe the plan's spares (docs/PLAN.md "Spare stages"): the
 *      first that answer, one for each stage lost, take the lost stages' places.
 *   3. If at least two stages would be left, send each survivor and each spare that
 *      answered a REPLAN, and wait for its ack. The REPLAN holds the next epoch and the mask
 *      of stages kept and spares taken; a spare not taken follows it as a spare.
 * The stages that acknowledge now follow replan_new, so the bridge must too, even if one
 * did not. The others refuse that one from now on, and a later attempt finds it gone. */
static void *replan_main(void *arg)
{
    struct kvr_bridge *b = arg;
    const struct kvr_plan *p = b->replan_old;
    uint64_t keep = 0;
    uint32_t n_alive = 0, n_spares = 0;
    for (uint32_t i = 0; i < p->n_stages; i++) {
        if (!probe(b, p, i))
            continue;
        keep |= 1ull << i;
        n_alive++;
    }
    /* Spares that answer but are not needed get the REPLAN too and follow it as spares. */
    uint64_t spares_alive = 0;
    for (uint32_t j = 0; j < p->n_spares && n_alive < p->n_stages; j++) {
        if (!probe(b, p, p->n_stages + j))
            continue;
        spares_alive |= 1ull << (p->n_stages + j);
        if (n_alive + n_spares < p->n_stages) {
            keep |= 1ull << (p->n_stages + j);
            n_spares++;
        }
    }
    b->replan_ok = false;
    struct kvr_err err = {0};
    if (n_alive == p->n_stages) {
        KVR_INFO("bridge: re-plan: all %u stages answer; the ring stays as it is", n_alive);
    } else if (kvr_plan_replan(p, b->cfg.gguf, keep, b->replan_new, &err)) {
        KVR_ERROR("bridge: cannot re-plan the ring over the %u stages that answer: %s", n_alive,
                  err.msg);
    } else {
        uint32_t n_ack = 0;
        for (uint32_t i = 0; i < p->n_stages + p->n_spares; i++) {
            if (!(((keep | spares_alive) >> i) & 1))
                continue;
            struct kvr_link l;
            struct kvr_err why = {0};
            uint8_t ack = 0;
            struct kvr_wire_msg m = {
                .type = KVR_WIRE_REPLAN, .arg = b->replan_new->epoch, .batch_id = keep};
            int rc = control_link(b, p, i, &l, &why);
            if (rc == 0) {
                rc = kvr_link_send(&l, &m, kvr_net_deadline(HANDSHAKE_MS), &why);
                if (rc == 0)
                    rc = kvr_net_read_full(l.fd, &ack, 1, kvr_net_deadline(HANDSHAKE_MS), NULL,
                                           &why);
                if (rc == 0 && ack != KVR_CREDIT_ACK)
                    rc = kvr_err_set(&why, KVR_EPROTO, "it answered byte 0x%02x, not an ack", ack);
                kvr_link_fini(&l);
            }
            if (rc)
                KVR_WARN("bridge: re-plan: %s %u (%s) did not take the new plan: %s",
                         i < p->n_stages ? "stage" : "spare", i < p->n_stages ? i : i - p->n_stages,
                         member_addr(p, i), why.msg);
            else
                n_ack++;
        }
        b->replan_ok = n_ack > 0;
        KVR_INFO("bridge: re-plan: epoch %u, %u of %u stages kept, %u spare%s taken, %u "
                 "acknowledged",
                 b->replan_new->epoch, n_alive, p->n_stages, n_spares, n_spares == 1 ? "" : "s",
                 n_ack);
    }
    atomic_store(&b->replan_done, true);
    kvr_ev_wake(b->ev);
    return NULL;
}

static void on_replan_timer(struct kvr_ev *ev, void *arg)
{
    (void)ev;
    struct kvr_bridge *b = arg;
    if (b->replan_running || atomic_load(&b->ring_up) || atomic_load(&b->stop))
        return;
    KVR_WARN("bridge: the ring has been broken for %u ms; probing every stage to re-plan it",
             b->cfg.replan_after_ms);
    pthread_mutex_lock(&b->lock);
    *b->replan_old = b->plan;
    pthread_mutex_unlock(&b->lock);
    atomic_store(&b->replan_done, false);
    if (pthread_create(&b->replan_thread, NULL, replan_main, b) != 0) {
        KVR_ERROR("bridge: cannot start a thread to re-plan the ring");
        return;
    }
    b->replan_running = true;
}

/* The attempt ended (on_wake): follow its plan, or wait another grace period. */
static void replan_finish(struct kvr_bridge *b)
{
    if (!b->replan_running || !atomic_load(&b->replan_done))
        return;
    pthread_join(b->replan_thread, NULL);
    b->replan_running = false;
    uint32_t wait_ms = b->cfg.replan_after_ms;
    if (b->replan_ok && wait_ms < REPLAN_SETTLE_MS)
        wait_ms = REPLAN_SETTLE_MS;
    b->replan_not_before_ns = kvr_now_ns() + wait_ms * MS_NS;
    if (b->replan_ok) {
        ring_down(b, "the ring was re-planned");
        kvr_dialer_stop(b->dialer); /* it dials the old head with the old plan */
        b->dialer = NULL;
        pthread_mutex_lock(&b->lock);
        b->plan = *b->replan_new;
        const struct kvr_plan *p = &b->plan;
        struct kvr_err err = {0};
        int rc = kvr_wire_limits_init(&b->head_limits, p, b->cfg.n_embd, b->cfg.n_vocab, 0, &err);
        if (rc == 0)
            rc = kvr_wire_limits_init(&b->tail_limits, p, b->cfg.n_embd, b->cfg.n_vocab,
                                      KVR_WIRE_RECV_BRIDGE, &err);
        kvr_sched_plan_changed(b->sched);
        uint64_t t0 = kvr_now_ns();
        for (uint32_t i = 0; i < KVR_PLAN_MAX_STAGES; i++)
            b->stages[i] =
                (struct kvr_bridge_stage_state){.state = KVR_STAGE_UNKNOWN, .since_ns = t0};
        b->stages[0].state = b->stages[p->n_stages - 1].state = KVR_STAGE_CONNECTING;
        pthread_mutex_unlock(&b->lock);
        struct kvr_dialer_config dc = {.plan = p,
                                       .addr = p->stages[0].addr,
                                       .limits = &b->head_limits,
                                       .role = KVR_AUTH_ROLE_BRIDGE,
                                       .index = 0,
                                       .name = "bridge",
                                       .handshake_ms = HANDSHAKE_MS,
                                       .backoff_max_ms = BACKOFF_MAX_MS,
                                       .wake = b->ev};
        if (rc == 0)
            rc = kvr_dialer_start(&b->dialer, &dc, &err);
        if (rc)
            KVR_ERROR("bridge: cannot follow the new plan: %s", err.msg);
        else
            KVR_WARN("bridge: re-planned the ring: epoch %u, %u stages, head %s", p->epoch,
                     p->n_stages, p->stages[0].addr);
    }
    arm_tick(b); /* another attempt after another grace period if it stays broken */
}

/* ---- the ring thread ------------------------------------------------------------------------ */

/* Send batches while the head has credits and the window has room. */
static void fill(struct kvr_bridge *b)
{
    if (!b->have_head || !b->have_tail || atomic_load(&b->stop))
        return;
    while (b->head_credits > 0 && !b->head.tx_pending) {
        uint64_t now = kvr_now_ns();
        pthread_mutex_lock(&b->lock);
        const struct kvr_wire_msg *m = kvr_sched_next_batch(b->sched, now);
        pthread_mutex_unlock(&b->lock);
        if (!m)
            break;
        b->head_credits--;
        struct kvr_err err = {0};
        int rc = kvr_link_send_begin(&b->head, m, &err);
        if (rc && rc != KVR_EAGAIN) {
            ring_down(b, err.msg);
            return;
        }
        sent_to_head(b, now);
        if (rc == KVR_EAGAIN) /* the rest goes when the socket has room (on_head) */
            kvr_ev_events(b->ev, b->head.fd, KVR_EV_READ | KVR_EV_WRITE);
    }
    arm_tick(b);
}

/* The scheduler's own clock: a timer at the next moment it has something to do. */
static void arm_tick(struct kvr_bridge *b)
{
    pthread_mutex_lock(&b->lock);
    uint64_t next = kvr_sched_tick(b->sched, kvr_now_ns());
    sync_up(b);
    bool broken = b->ever_up && !atomic_load(&b->ring_up);
    uint64_t since = b->down_since_ns;
    pthread_mutex_unlock(&b->lock);
    kvr_ev_timer_at(b->ev, b->t_tick, next);
    if (b->cfg.replan_after_ms && !b->replan_running) {
        uint64_t at = since + b->cfg.replan_after_ms * MS_NS;
        if (at < b->replan_not_before_ns)
            at = b->replan_not_before_ns;
        /* UINT64_MAX disarms it (0 would fire it at once) */
        kvr_ev_timer_at(b->ev, b->t_replan, broken ? at : UINT64_MAX);
    }
}

static void on_tick_timer(struct kvr_ev *ev, void *arg)
{
    (void)ev;
    fill(arg); /* fill ticks the scheduler, and sends a probe it may ask for */
    arm_tick(arg);
}

/* A consumer submitted or cancelled, or the dialler has news. */
static void on_wake(struct kvr_ev *ev, void *arg)
{
    (void)ev;
    replan_finish(arg);
    check_dialer(arg);
    fill(arg);
}

static void *ring_main(void *arg)
{
    struct kvr_bridge *b = arg;
    kvr_ev_run(b->ev);
    return NULL;
}

/* ---- public API ------------------------------------------------------------------------------ */

void kvr_bridge_stop(struct kvr_bridge *b)
{
    if (!b)
        return;
    atomic_store(&b->stop, true);
    if (b->thread_started) {
        kvr_ev_stop(b->ev);
        pthread_join(b->thread, NULL);
        b->thread_started = false;
    }
    kvr_dialer_stop(b->dialer); /* a head dialled now is closed with it: no reconnecting */
    b->dialer = NULL;
    if (b->replan_running) { /* its connects and reads are bounded */
        pthread_join(b->replan_thread, NULL);
        b->replan_running = false;
    }
}

void kvr_bridge_destroy(struct kvr_bridge *b)
{
    if (!b)
        return;
    kvr_bridge_stop(b);
    if (b->have_head)
        kvr_link_fini(&b->head);
    if (b->have_tail)
        kvr_link_fini(&b->tail);
    if (b->sched) {
        pthread_mutex_lock(&b->lock);
        kvr_sched_shutdown(b->sched, "the bridge is shutting down", kvr_now_ns());
        pthread_mutex_unlock(&b->lock);
    }
    if (b->listen_fd >= 0)
        close(b->listen_fd);
    kvr_ev_destroy(b->ev);
    kvr_sched_destroy(b->sched);
    kvr_telemetry_destroy(b->telemetry);
    pthread_mutex_destroy(&b->lock);
    pthread_cond_destroy(&b->up_cond);
    pthread_cond_destroy(&b->any_cond);
    kvr_plan_wipe(&b->plan);
    if (b->replan_old)
        kvr_plan_wipe(b->replan_old);
    if (b->replan_new)
        kvr_plan_wipe(b->replan_new);
    kvr_free(b->replan_old);
    kvr_free(b->replan_new);
    kvr_free(b);
}

int kvr_bridge_create(struct kvr_bridge **out, const struct kvr_bridge_config *cfg,
                      struct kvr_err *err)
{
    *out = NULL;
    struct kvr_bridge *b = kvr_calloc(1, sizeof *b);
    if (!b)
        return kvr_err_set(err, KVR_ENOMEM, "bridge: out of memory");
    b->plan = *cfg->plan;
    b->created_ns = kvr_now_ns();
    b->cfg = *cfg;
    b->cfg.plan = &b->plan;
    b->listen_fd = -1;
    b->replan_old = kvr_calloc(1, sizeof *b->replan_old);
    b->replan_new = kvr_calloc(1, sizeof *b->replan_new);
    pthread_mutex_init(&b->lock, NULL);
    pthread_cond_init(&b->up_cond, NULL);
    pthread_cond_init(&b->any_cond, NULL);
    const struct kvr_plan *p = &b->plan;
    int rc;
    if (!b->replan_old || !b->replan_new) {
        rc = kvr_err_set(err, KVR_ENOMEM, "bridge: out of memory");
        goto fail;
    }
    if (cfg->replan_after_ms && !cfg->gguf) {
        rc = kvr_err_set(err, KVR_EINVAL, "bridge: re-planning needs the model file");
        goto fail;
    }
    if ((rc = kvr_wire_limits_init(&b->head_limits, p, cfg->n_embd, cfg->n_vocab, 0, err)) ||
        (rc = kvr_wire_limits_init(&b->tail_limits, p, cfg->n_embd, cfg->n_vocab,
                                   KVR_WIRE_RECV_BRIDGE, err)))
        goto fail;
    struct kvr_sched_config sc = {.plan = p,
                                  .max_ctrl = b->head_limits.max_ctrl,
                                  .max_waiting = cfg->max_waiting,
                                  .admission = cfg->admission,
                                  .spec = cfg->spec,
                                  .prefix_cache = !cfg->no_prefix_cache,
                                  .event = on_event,
                                  .event_ctx = b};
    if ((rc = kvr_telemetry_create(&b->telemetry, err)))
        goto fail;
    sc.telemetry = b->telemetry;
    if ((rc = kvr_sched_create(&b->sched, &sc, err)))
        goto fail;
    if ((rc = kvr_ev_create(&b->ev, err)))
        goto fail;
    b->t_tick = kvr_ev_timer(b->ev, on_tick_timer, b);
    b->t_heartbeat = kvr_ev_timer(b->ev, on_heartbeat_timer, b);
    b->t_replan = kvr_ev_timer(b->ev, on_replan_timer, b);
    kvr_ev_on_wake(b->ev, on_wake, b);
    uint64_t t0 = kvr_now_ns();
    for (uint32_t i = 0; i < p->n_stages; i++)
        b->stages[i] = (struct kvr_bridge_stage_state){.state = KVR_STAGE_UNKNOWN, .since_ns = t0};
    b->stages[0].state = b->stages[p->n_stages - 1].state = KVR_STAGE_CONNECTING;
    if ((rc = kvr_net_listen(p->bridge_addr, 16, &b->listen_fd, NULL, err)) ||
        (rc = kvr_ev_watch(b->ev, b->listen_fd, KVR_EV_READ, on_listen, b)))
        goto fail;
    struct kvr_dialer_config dc = {.plan = p,
                                   .addr = p->stages[0].addr,
                                   .limits = &b->head_limits,
                                   .role = KVR_AUTH_ROLE_BRIDGE,
                                   .index = 0,
                                   .name = "bridge",
                                   .handshake_ms = HANDSHAKE_MS,
                                   .backoff_max_ms = BACKOFF_MAX_MS,
                                   .wake = b->ev};
    if ((rc = kvr_dialer_start(&b->dialer, &dc, err)))
        goto fail;
    if (pthread_create(&b->thread, NULL, ring_main, b) != 0) {
        rc = kvr_err_set(err, KVR_ENOMEM, "bridge: cannot start the ring thread");
        goto fail;
    }
    b->thread_started = true;
    *out = b;
    return KVR_OK;

fail:
    kvr_bridge_destroy(b);
    return rc;
}

bool kvr_bridge_ring_up(const struct kvr_bridge *b)
{
    return atomic_load(&b->ring_up);
}

const char *kvr_stage_state_name(enum kvr_stage_state state)
{
    static const char *const names[KVR_STAGE_STATE_COUNT] = {"unknown", "connecting", "connected",
                                                             "up", "down"};
    return (unsigned)state < KVR_STAGE_STATE_COUNT ? names[state] : "unknown";
}

uint32_t kvr_bridge_stage_states(struct kvr_bridge *b, struct kvr_bridge_stage_state *out)
{
    pthread_mutex_lock(&b->lock);
    uint32_t n = b->plan.n_stages;
    memcpy(out, b->stages, n * sizeof *out);
    for (uint32_t i = 0; i < n; i++) {
        snprintf(out[i].addr, sizeof out[i].addr, "%s", b->plan.stages[i].addr);
        out[i].first_layer = b->plan.stages[i].first_layer;
        out[i].last_layer = b->plan.stages[i].last_layer;
    }
    pthread_mutex_unlock(&b->lock);
    return n;
}

bool kvr_bridge_wait_up(struct kvr_bridge *b, int timeout_ms)
{
    struct timespec ts = kvr_deadline_after_ms(timeout_ms > 0 ? (uint32_t)timeout_ms : 0);
    pthread_mutex_lock(&b->lock);
    while (!atomic_load(&b->ring_up))
        if (pthread_cond_timedwait(&b->up_cond, &b->lock, &ts) == ETIMEDOUT)
            break;
    pthread_mutex_unlock(&b->lock);
    return atomic_load(&b->ring_up);
}

int kvr_bridge_submit(struct kvr_bridge *b, const struct kvr_gen_request *req,
                      struct kvr_gen_stream **stream, struct kvr_refusal *why)
{
    *stream = NULL;
    memset(why, 0, sizeof *why);
    if (req->n_prompt == 0 || req->max_tokens == 0) {
        why->reason = KVR_REFUSE_TOO_LONG;
        snprintf(why->message, sizeof why->message, "empty prompt or max_tokens of 0");
        return KVR_EINVAL;
    }
    struct kvr_gen_stream *s = kvr_calloc(1, sizeof *s);
    if (!s)
        goto nomem;
    s->prompt = kvr_malloc((size_t)req->n_prompt * sizeof(int32_t));
    s->events = kvr_calloc(req->max_tokens, sizeof *s->events);
    s->r.generated = kvr_calloc(req->max_tokens, sizeof *s->r.generated);
    s->grammar = req->grammar_bytes ? kvr_malloc(req->grammar_bytes) : NULL;
    uint32_t k = req->logprobs ? req->top_logprobs : 0;
    if (k > KVR_LOGPROBS_MAX_TOP)
        k = KVR_LOGPROBS_MAX_TOP;
    s->tops = k ? kvr_calloc((size_t)req->max_tokens * k, sizeof *s->tops) : NULL;
    if (!s->prompt || !s->events || !s->r.generated || (req->grammar_bytes && !s->grammar) ||
        (k && !s->tops)) {
        kvr_free(s->grammar);
        kvr_free(s->prompt);
        kvr_free(s->events);
        kvr_free(s->tops);
        kvr_free(s->r.generated);
        kvr_free(s);
        goto nomem;
    }
    memcpy(s->prompt, req->prompt, (size_t)req->n_prompt * sizeof(int32_t));
    s->b = b;
    s->r.req = *req;
    s->r.req.prompt = s->prompt;
    if (req->grammar_bytes)
        memcpy(s->grammar, req->grammar, req->grammar_bytes);
    s->r.req.grammar = s->grammar;
    s->r.req.top_logprobs = k;
    s->r.req.same_prompt_as = NULL;
    s->r.req.prediction = NULL;
    s->r.req.n_prediction = 0;
    /* A drafted id outside the vocabulary would make stage 0 drop the link: such a
     * prediction is not drafted from. */
    bool pred_ok = b->cfg.n_vocab > 0;
    for (uint32_t j = 0; pred_ok && j < req->n_prediction; j++)
        pred_ok = req->prediction[j] >= 0 && (uint32_t)req->prediction[j] < b->cfg.n_vocab;
    if (pred_ok && req->n_prediction &&
        (s->prediction = kvr_malloc(req->n_prediction * sizeof(int32_t)))) {
        memcpy(s->prediction, req->prediction, req->n_prediction * sizeof(int32_t));
        s->r.req.prediction = s->prediction; /* without memory, no drafts from it */
        s->r.req.n_prediction = req->n_prediction;
    }
    s->r.user = s;
    pthread_cond_init(&s->cond, NULL);

    pthread_mutex_lock(&b->lock);
    s->r.prompt_of = req->same_prompt_as ? req->same_prompt_as->r.id : 0;
    int rc = kvr_sched_submit(b->sched, &s->r, kvr_now_ns(), why);
    why->est_first_ms = s->r.est.first_ms;
    why->est_period_ms = s->r.est.period_ms;
    pthread_mutex_unlock(&b->lock);
    if (rc) {
        stream_free(s);
        return rc;
    }
    wake(b);
    *stream = s;
    return KVR_OK;
nomem:
    why->reason = KVR_REFUSE_INTERNAL;
    snprintf(why->message, sizeof why->message, "out of memory");
    return KVR_ENOMEM;
}

void kvr_bridge_wait_any(struct kvr_bridge *b, uint64_t *seen, int timeout_ms)
{
    struct timespec ts = kvr_deadline_after_ms(timeout_ms > 0 ? (uint32_t)timeout_ms : 0);
    pthread_mutex_lock(&b->lock);
    b->any_waiters++;
    while (b->n_events == *seen)
        if (pthread_cond_timedwait(&b->any_cond, &b->lock, &ts) == ETIMEDOUT)
            break;
    b->any_waiters--;
    *seen = b->n_events;
    pthread_mutex_unlock(&b->lock);
}

int kvr_bridge_next(struct kvr_gen_stream *s, struct kvr_gen_event *ev, uint32_t timeout_ms)
{
    struct kvr_bridge *b = s->b;
    struct timespec ts = kvr_deadline_after_ms(timeout_ms);
    memset(ev, 0, sizeof *ev);
    ev->token = -1;
    pthread_mutex_lock(&b->lock);
    if (s->finish_delivered) {
        pthread_mutex_unlock(&b->lock);
        return KVR_ECLOSED;
    }
    while (timeout_ms > 0 && s->ev_count == 0 && s->finish == KVR_GEN_FINISH_NONE)
        if (pthread_cond_timedwait(&s->cond, &b->lock, &ts) == ETIMEDOUT)
            break;
    int rc = KVR_OK;
    /* LENGTH and EOS come with the last token; ERROR as an event of its own, after the
     * tokens that came before it; CANCELLED as KVR_ECLOSED, after them too. */
    bool with_token = s->finish == KVR_GEN_FINISH_LENGTH || s->finish == KVR_GEN_FINISH_EOS;
    if (s->ev_count > 0) {
        const struct token_event *e = &s->events[s->ev_head];
        ev->token = e->token;
        ev->logprob = e->logprob;
        ev->eog = e->eog;
        ev->t_ns = e->t_ns;
        ev->n_top = e->n_top;
        if (e->n_top)
            memcpy(ev->top, s->tops + (size_t)s->ev_head * s->r.req.top_logprobs,
                   e->n_top * sizeof *ev->top);
        s->ev_head = (s->ev_head + 1) % s->r.req.max_tokens;
        s->ev_count--;
        if (s->ev_count == 0 && with_token) {
            ev->finish = s->finish;
            s->finish_delivered = true;
        }
    } else if (s->finish == KVR_GEN_FINISH_CANCELLED) {
        s->finish_delivered = true;
        rc = KVR_ECLOSED;
    } else if (s->finish != KVR_GEN_FINISH_NONE) {
        ev->finish = s->finish;
        ev->t_ns = kvr_now_ns();
        if (s->finish == KVR_GEN_FINISH_ERROR) {
            ev->error_status = 503;
            snprintf(ev->error, sizeof ev->error, "%s", s->message[0] ? s->message : "ring error");
        }
        s->finish_delivered = true;
    } else {
        rc = KVR_ETIMEDOUT;
    }
    pthread_mutex_unlock(&b->lock);
    return rc;
}

void kvr_bridge_cancel(struct kvr_gen_stream *s)
{
    struct kvr_bridge *b = s->b;
    pthread_mutex_lock(&b->lock);
    if (!s->detached)
        kvr_sched_cancel(b->sched, &s->r, kvr_now_ns());
    pthread_mutex_unlock(&b->lock);
    wake(b);
}

void kvr_bridge_release(struct kvr_gen_stream *s)
{
    if (!s)
        return;
    struct kvr_bridge *b = s->b;
    kvr_bridge_cancel(s);
    pthread_mutex_lock(&b->lock);
    s->released = true;
    bool free_now = s->detached; /* otherwise freed at its DETACH, once its FREE is sent */
    pthread_mutex_unlock(&b->lock);
    if (free_now)
        stream_free(s);
}

void kvr_bridge_stats(struct kvr_bridge *b, struct kvr_sched_stats *out)
{
    pthread_mutex_lock(&b->lock);
    kvr_sched_stats(b->sched, out);
    pthread_mutex_unlock(&b->lock);
}

uint32_t kvr_bridge_flush_cache(struct kvr_bridge *b)
{
    pthread_mutex_lock(&b->lock);
    uint32_t n = kvr_sched_flush_cache(b->sched);
    pthread_mutex_unlock(&b->lock);
    return n;
}

bool kvr_bridge_estimate(struct kvr_gen_stream *s, double *first_ms, double *total_ms, uint64_t *id)
{
    pthread_mutex_lock(&s->b->lock);
    const struct kvr_sched_req *r = &s->r;
    *first_ms = r->est.first_ms;
    *total_ms = r->est.first_ms + (r->req.max_tokens - 1) * r->est.period_ms;
    *id = r->id;
    pthread_mutex_unlock(&s->b->lock);
    return *first_ms > 0;
}

void kvr_bridge_spec(struct kvr_gen_stream *s, uint32_t *drafted, uint32_t *accepted,
                     uint32_t *steps)
{
    pthread_mutex_lock(&s->b->lock);
    *drafted = s->r.spec_drafted;
    *accepted = s->r.spec_accepted;
    *steps = s->r.spec_steps;
    pthread_mutex_unlock(&s->b->lock);
}

void kvr_bridge_telemetry(struct kvr_bridge *b, struct kvr_telemetry_reader *reader,
                          struct kvr_telemetry_snapshot *snap)
{
    /* Only what the snapshot reads is written (the stats in place, the stages in use):
     * a page asks four times a second, and this holds the lock. */
    struct kvr_telemetry_stage_state states[KVR_PLAN_MAX_STAGES];
    pthread_mutex_lock(&b->lock);
    kvr_sched_stats(b->sched, &snap->stats);
    for (uint32_t i = 0; i < b->plan.n_stages; i++) {
        struct kvr_telemetry_stage_state *st = &states[i];
        snprintf(st->state, sizeof st->state, "%s", kvr_stage_state_name(b->stages[i].state));
        st->since_ns = b->stages[i].since_ns;
        snprintf(st->last_error, sizeof st->last_error, "%s", b->stages[i].last_error);
    }
    kvr_telemetry_take(b->telemetry, reader, &b->plan, &snap->stats, states, b->plan.n_stages,
                       kvr_now_ns(), snap);
    pthread_mutex_unlock(&b->lock);
}
