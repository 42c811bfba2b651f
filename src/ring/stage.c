/* stage.c - the stage agent's shell (see stage.h): its sockets on one event loop, its
 * input and output slots, and the compute thread that runs the batch step (step.h).
 *
 * Reading order: the slots and the shared state, the downstream link (sending, credits,
 * heartbeats), the upstream link (receiving into slots), the compute loop, start-up and
 * shutdown.
 *
 * Two threads. The I/O thread runs the event loop (core/ev.h): it accepts and authenticates
 * the upstream (the handshake in steps, accept.h, so a peer that is slow to answer never
 * stalls the loop), reads frames straight into free input slots, takes the downstream link
 * from the dialler thread (dial.h), sends queued frames without blocking, reads credits and
 * acks, answers heartbeats and sends its own. The compute thread (the caller's) takes the
 * next input slot (the wait is "starved"), a free output slot ("blocked"), runs the step
 * ("held") and hands the frame off: it sends it itself, without blocking, when nothing is
 * queued ahead of it and the downstream has a credit (try-write-first), else queues it for
 * the I/O thread. Sending inline saves a thread wake-up per batch, which on a stage with a
 * fraction of a core (a CFS quota) could wait out the rest of a quota period.
 *
 * One mutex (s->lock) guards everything both threads touch: the slot queues, the notice,
 * the upstream's fd and generation, and the downstream link (both threads send on it;
 * every send is non-blocking, so the lock is never held across a wait). The compute thread
 * never calls the event loop: it sets a flag and wakes it. Nothing sleeps or polls: the
 * compute thread waits on condition variables, the I/O thread in epoll. */
#include "ring/stage.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/ev.h"
#include "core/log.h"
#include "core/procfs.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "ring/accept.h"
#include "ring/credit.h"
#include "ring/dial.h"
#include "ring/experts.h"
#include "ring/net.h"
#include "ring/propose.h"
#include "ring/step.h"
#include "ring/wire.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum {
    HANDSHAKE_MS = 3000,            /* each handshake message must arrive within this */
    BACKOFF_MAX_MS = 2000,          /* dialling the downstream again (dial.h) */
    STANDBY_POLL_MS = 5,            /* a standby trying to listen (standby_listen) */
    N_OUT_SLOTS = 2,                /* one being sent, one being filled */
    N_IN_SLOTS = 2,                 /* one being computed, one received: the credits we grant */
    READY_CAP = 2 * N_IN_SLOTS + 2, /* input slots and RESET marks between them */
};

#define MS_NS 1000000ull

/* What the downstream link is writing: nothing, a heartbeat, a RESET, or an output slot
 * (which goes back to the free list once written or dropped). */
enum tx_kind { TX_NONE, TX_HEARTBEAT, TX_NOTICE, TX_OUT_SLOT, TX_COUNT };
struct tx {
    enum tx_kind kind;
    uint32_t slot; /* TX_OUT_SLOT: its index in out[] */
};
static const struct tx tx_none = {TX_NONE, 0};

/* An entry of the ready FIFO: an input slot to run, or a mark that the upstream changed
 * there (every sequence before it is stale). */
enum ready_kind { READY_INPUT, READY_RESET, READY_COUNT };
struct ready {
    enum ready_kind kind;
    uint32_t slot; /* READY_INPUT: its index in in[] */
};

struct in_slot {
    struct kvr_link_rx rx; /* the frame, decoded where it was received */
    uint64_t gen;          /* upstream link generation it came from */
};

struct stage {
    const struct kvr_plan *plan;
    uint32_t index;
    bool is_head, is_tail;
    bool standby;     /* first life of a warm standby: listens once the stage there died */
    atomic_int *stop; /* set by a signal handler (kvr_stage_signal_stop) */
    char name[32];    /* "stage 1" */

    struct kvr_gguf *gguf; /* borrowed: kept open across re-plans */
    struct kvr_engine *engine;
    struct kvr_experts_client *experts; /* NULL: no agent holds experts of this stage */
    struct kvr_hparams hp;
    struct kvr_engine_config cfg; /* the engine's, for log_resident */
    struct kvr_tok *tok;          /* tail: end-of-generation ids */
    struct kvr_step step;         /* compute thread only */

    struct kvr_wire_limits up_limits;   /* what this stage accepts from upstream */
    struct kvr_wire_limits down_limits; /* what the downstream accepts from us */

    /* I/O thread only. */
    struct kvr_ev *ev;
    struct kvr_dialer *dialer; /* dials and authenticates the downstream (dial.h) */
    int t_heartbeat;
    int listen_fd;
    struct kvr_accept acc; /* would-be upstreams and control links in their handshakes */
    struct kvr_link up;
    bool have_up;
    struct kvr_plan *next_plan; /* a REPLAN's plan (preallocated) */
    uint32_t next_index;        /* this stage's index in it */
    bool replanned;             /* the stage stops, to start again as next_plan says */
    pthread_t io_thread;
    bool io_started;

    pthread_mutex_t lock;    /* guards everything below */
    pthread_cond_t in_cond;  /* compute: an input (or a RESET mark) is ready */
    pthread_cond_t out_cond; /* compute: an output slot is free */
    bool stopping;

    /* Input slots. A slot is free, being received into (rx_into), or ready. */
    struct in_slot in[N_IN_SLOTS];
    uint32_t in_free[N_IN_SLOTS], n_in_free;
    struct in_slot *rx_into;       /* the slot a frame body is being read into, or NULL */
    struct ready ready[READY_CAP]; /* FIFO of ready slots and RESET marks */
    uint32_t ready_head, n_ready;
    int up_fd;          /* for the compute thread's credits; -1: none */
    uint64_t up_gen;    /* bumped whenever the upstream changes */
    bool grant_pending; /* a new upstream waits for its initial credits */
    bool up_paused;     /* a frame waits for a free input slot: READ is off */

    /* Output slots: free, queued for the I/O thread (in order), or being written. */
    struct kvr_step_out out[N_OUT_SLOTS];
    uint32_t out_free[N_OUT_SLOTS], n_out_free;
    uint32_t out_q[N_OUT_SLOTS], out_q_head, n_out_q;

    /* A RESET (wire.h) to send downstream ahead of the next frame: raised by compute when
     * this stage drops its sequences, by the I/O thread when one comes from upstream. */
    bool notice_pending;
    uint32_t notice_stage;
    uint64_t notice_batch;  /* KVR_WIRE_RESET_LINK, or the batch that failed */
    bool dropped_pending;   /* a batch was dropped for want of a downstream (drop_out) ... */
    uint64_t dropped_batch; /* ... the last such: the next downstream is told */

    /* The downstream link. */
    struct kvr_link down;
    bool have_down;
    bool down_dead;    /* the compute thread found it broken: I/O closes it */
    bool want_write;   /* the compute thread left a frame half-written */
    uint64_t down_gen; /* bumped whenever the link is dropped */
    uint32_t down_credits;
    struct tx tx;          /* what is being written */
    uint64_t last_send_ns; /* when a frame or heartbeat last went out */
    uint64_t await_ns;     /* something sent that the downstream has not answered */
    uint64_t n_heartbeats;
};

/* The event loop of the running stage, for kvr_stage_signal_stop. */
static _Atomic(struct kvr_ev *) running_ev;

void kvr_stage_signal_stop(void)
{
    struct kvr_ev *ev = atomic_load(&running_ev);
    if (ev)
        kvr_ev_wake(ev);
}

/* ---- notices ----------------------------------------------------------------------------- */

/* Two pending resets merge into one: a lost link outweighs failed batches (the bridge
 * ignores a failure of a batch it has already given up on, never a lost link). Caller
 * holds s->lock. */
static void raise_notice(struct stage *s, uint32_t stage, uint64_t batch_id)
{
    bool replace =
        !s->notice_pending || (s->notice_batch != KVR_WIRE_RESET_LINK &&
                               (batch_id == KVR_WIRE_RESET_LINK || batch_id > s->notice_batch));
    if (replace) {
        s->notice_stage = stage;
        s->notice_batch = batch_id;
    }
    s->notice_pending = true;
}

/* ---- the downstream link (I/O thread, s->lock held) ---------------------------------- */

static void give_out(struct stage *s, uint32_t id)
{
    s->out_free[s->n_out_free++] = id;
    pthread_cond_signal(&s->out_cond);
}

static void drop_out(struct stage *s, uint32_t id)
{
    const struct kvr_wire_msg *m = &s->out[id].msg;
    if (s->have_down || s->down_gen > 0) /* it was up: a link went down */
        KVR_WARN("%s: no downstream, batch %llu dropped", s->name, (unsigned long long)m->batch_id);
    else /* never connected yet: the ring is still forming, the bridge's probe goes again */
        KVR_INFO("%s: downstream not connected yet, batch %llu dropped", s->name,
                 (unsigned long long)m->batch_id);
    /* The next downstream's first frame says so (a RESET naming the batch): the bridge then
     * probes again at once instead of waiting for the lost batch's deadline. This matters
     * when the upstream links before the downstream, as a restarted stage's may. */
    s->dropped_batch = m->batch_id;
    s->dropped_pending = true;
    give_out(s, id);
}

/* Close the downstream link; dialling starts again. */
static void drop_down(struct stage *s)
{
    if (!s->have_down)
        return;
    kvr_ev_unwatch(s->ev, s->down.fd);
    kvr_link_fini(&s->down);
    s->have_down = false;
    s->down_dead = false;
    s->want_write = false;
    s->down_gen++;
    s->down_credits = 0;
    s->await_ns = 0;
    if (s->tx.kind == TX_OUT_SLOT) {
        KVR_WARN("%s: downstream lost, batch %llu dropped", s->name,
                 (unsigned long long)s->out[s->tx.slot].msg.batch_id);
        give_out(s, s->tx.slot);
    }
    s->tx = tx_none;
    kvr_ev_timer_at(s->ev, s->t_heartbeat, 0);
    kvr_dialer_redial(s->dialer);
}

static void sent(struct stage *s)
{
    s->last_send_ns = kvr_now_ns();
    if (!s->await_ns)
        s->await_ns = s->last_send_ns;
}

/* Start writing a frame; returns false if the link broke (dropped). */
static bool begin_send(struct stage *s, const struct kvr_wire_msg *m, struct tx what)
{
    struct kvr_err err = {0};
    int rc = kvr_link_send_begin(&s->down, m, &err);
    if (rc && rc != KVR_EAGAIN) {
        KVR_WARN("%s: downstream lost: %s", s->name, err.msg);
        if (what.kind == TX_OUT_SLOT)
            s->tx = what; /* drop_down reports and frees it */
        drop_down(s);
        return false;
    }
    sent(s);
    if (rc == KVR_EAGAIN) {
        s->tx = what;
        kvr_ev_events(s->ev, s->down.fd, KVR_EV_READ | KVR_EV_WRITE);
    } else if (what.kind == TX_OUT_SLOT) {
        give_out(s, what.slot);
    }
    return true;
}

/* Send what is due: the pending RESET first, then queued frames while credits last. */
static void kick_send(struct stage *s)
{
    if (s->down_dead)
        drop_down(s);
    if (!s->have_down) {
        s->notice_pending = false; /* the next downstream starts with a reset of its own */
        while (s->n_out_q > 0) {
            uint32_t id = s->out_q[s->out_q_head];
            s->out_q_head = (s->out_q_head + 1) % N_OUT_SLOTS;
            s->n_out_q--;
            drop_out(s, id);
        }
        return;
    }
    if (s->want_write && s->tx.kind != TX_NONE)
        kvr_ev_events(s->ev, s->down.fd, KVR_EV_READ | KVR_EV_WRITE);
    s->want_write = false;
    if (s->tx.kind != TX_NONE)
        return;
    if (s->notice_pending) {
        s->notice_pending = false;
        struct kvr_wire_msg m = {
            .type = KVR_WIRE_RESET, .arg = s->notice_stage, .batch_id = s->notice_batch};
        if (!begin_send(s, &m, (struct tx){TX_NOTICE, 0}) || s->tx.kind != TX_NONE)
            return;
    }
    while (s->n_out_q > 0) {
        if (s->down_credits == 0) {
            bool heard = false;
            int rc = kvr_credit_read(s->down.fd, &s->down_credits, &heard);
            if (rc) {
                KVR_WARN("%s: downstream lost: %s", s->name, kvr_strerror(rc));
                drop_down(s);
                kick_send(s);
                return;
            }
            if (heard)
                s->await_ns = 0;
            if (s->down_credits == 0)
                return; /* on_down sends when a credit comes */
        }
        uint32_t id = s->out_q[s->out_q_head];
        s->out_q_head = (s->out_q_head + 1) % N_OUT_SLOTS;
        s->n_out_q--;
        s->down_credits--;
        if (!begin_send(s, &s->out[id].msg, (struct tx){TX_OUT_SLOT, id})) {
            kick_send(s);
            return;
        }
        if (s->tx.kind != TX_NONE)
            return;
    }
}

static void on_down(struct kvr_ev *ev, int fd, uint32_t events, void *arg)
{
    struct stage *s = arg;
    pthread_mutex_lock(&s->lock);
    struct kvr_err err = {0};
    if (s->have_down && (events & KVR_EV_WRITE) && s->tx.kind != TX_NONE) {
        int rc = kvr_link_send_resume(&s->down, &err);
        if (rc == 0) {
            if (s->tx.kind == TX_OUT_SLOT)
                give_out(s, s->tx.slot);
            s->tx = tx_none;
            kvr_ev_events(ev, fd, KVR_EV_READ);
        } else if (rc != KVR_EAGAIN) {
            KVR_WARN("%s: downstream lost: %s", s->name, err.msg);
            drop_down(s);
        }
    }
    if (s->have_down && (events & (KVR_EV_READ | KVR_EV_ERROR))) {
        bool heard = false;
        int rc = kvr_credit_read(fd, &s->down_credits, &heard);
        if (rc) {
            KVR_WARN("%s: downstream lost: %s", s->name,
                     rc == KVR_ECLOSED ? "it closed the link" : kvr_strerror(rc));
            drop_down(s);
        } else if (heard) {
            s->await_ns = 0;
        }
    }
    kick_send(s);
    pthread_mutex_unlock(&s->lock);
}

static const char *downstream_addr(const struct stage *s)
{
    return s->is_tail ? s->plan->bridge_addr : s->plan->stages[s->index + 1].addr;
}

/* The dialler (dial.h) has connected and authenticated the downstream. */
static void install_down(struct stage *s, struct kvr_link *fresh)
{
    pthread_mutex_lock(&s->lock);
    s->down = *fresh;
    s->have_down = true;
    s->down_credits = 0;
    s->tx = tx_none;
    s->last_send_ns = kvr_now_ns();
    s->await_ns = 0;
    if (s->dropped_pending) /* drop_out */
        raise_notice(s, s->index, s->dropped_batch);
    s->dropped_pending = false;
    if (kvr_ev_watch(s->ev, s->down.fd, KVR_EV_READ, on_down, s))
        drop_down(s);
    else
        kvr_ev_timer_at(s->ev, s->t_heartbeat, s->last_send_ns + KVR_CREDIT_HEARTBEAT_MS * MS_NS);
    kick_send(s);
    pthread_mutex_unlock(&s->lock);
}

/* Liveness (credit.h): a heartbeat after a second without a frame; the downstream is dead
 * when it has answered nothing, neither credit nor ack, for KVR_CREDIT_DEAD_MS since
 * something was sent to it. That is also the deadline of a frame it leaves half written:
 * a downstream that stops reading but keeps its socket open is dropped, not waited for. */
static void on_heartbeat_timer(struct kvr_ev *ev, void *arg)
{
    struct stage *s = arg;
    pthread_mutex_lock(&s->lock);
    uint64_t now = kvr_now_ns();
    if (s->have_down && !s->down_dead && s->await_ns &&
        now - s->await_ns >= KVR_CREDIT_DEAD_MS * MS_NS) {
        KVR_WARN("%s: downstream %s stopped reading: nothing back for %d ms%s; closing the "
                 "link",
                 s->name, s->down.peer, KVR_CREDIT_DEAD_MS,
                 s->tx.kind != TX_NONE ? " (a frame half written)" : "");
        drop_down(s);
        kick_send(s);
    } else if (s->have_down && !s->down_dead) {
        if (now - s->last_send_ns >= KVR_CREDIT_HEARTBEAT_MS * MS_NS && s->tx.kind == TX_NONE) {
            struct kvr_wire_msg m = {.type = KVR_WIRE_HEARTBEAT, .batch_id = ++s->n_heartbeats};
            begin_send(s, &m, (struct tx){TX_HEARTBEAT, 0});
        }
        if (s->have_down) {
            uint64_t next = s->last_send_ns + KVR_CREDIT_HEARTBEAT_MS * MS_NS;
            if (s->await_ns && s->await_ns + KVR_CREDIT_DEAD_MS * MS_NS < next)
                next = s->await_ns + KVR_CREDIT_DEAD_MS * MS_NS;
            kvr_ev_timer_at(ev, s->t_heartbeat, next > now ? next : now + MS_NS);
        }
    }
    pthread_mutex_unlock(&s->lock);
}

/* ---- the upstream link (I/O thread) --------------------------------------------------- */

/* Queue a RESET mark for the compute thread, unless one is last already. Lock held. */
static void push_reset(struct stage *s)
{
    if (s->n_ready > 0 &&
        s->ready[(s->ready_head + s->n_ready - 1) % READY_CAP].kind == READY_RESET)
        return;
    s->ready[(s->ready_head + s->n_ready++) % READY_CAP] = (struct ready){READY_RESET, 0};
    pthread_cond_signal(&s->in_cond);
}

/* A new upstream gets a credit per input slot once compute has finished every frame of
 * the previous one (so it never finds the slots taken). Lock held. */
static void try_grant(struct stage *s)
{
    if (!s->grant_pending || s->n_in_free != N_IN_SLOTS || s->up_fd < 0)
        return;
    s->grant_pending = false;
    if (kvr_credit_grant(s->up_fd, N_IN_SLOTS))
        KVR_WARN("%s: cannot grant credits upstream", s->name);
}

/* The upstream changed (a new link, or none): every sequence is stale. Lock held. */
static void set_upstream(struct stage *s, int fd)
{
    if (s->rx_into) { /* a frame half read from the old link */
        s->in_free[s->n_in_free++] = (uint32_t)(s->rx_into - s->in);
        s->rx_into = NULL;
    }
    s->up_fd = fd;
    s->up_gen++;
    s->grant_pending = fd >= 0;
    push_reset(s);
    try_grant(s);
}

static void lose_upstream(struct stage *s)
{
    /* The compute thread stops granting credits on the fd before it is closed. */
    pthread_mutex_lock(&s->lock);
    set_upstream(s, -1);
    s->up_paused = false;
    pthread_mutex_unlock(&s->lock);
    kvr_ev_unwatch(s->ev, s->up.fd);
    kvr_link_fini(&s->up);
    s->have_up = false;
}

/* Read every frame the upstream has sent: batches straight into free input slots. */
static void on_up(struct kvr_ev *ev, int fd, uint32_t events, void *arg)
{
    (void)fd;
    (void)events;
    struct stage *s = arg;
    while (s->have_up) {
        pthread_mutex_lock(&s->lock);
        struct in_slot *slot = s->rx_into;
        pthread_mutex_unlock(&s->lock);
        const struct kvr_wire_frame *f;
        struct kvr_err err = {0};
        int rc = kvr_link_recv_into(&s->up, slot ? &slot->rx : NULL, KVR_NET_NOW, &f, &err);
        if (rc == KVR_ETIMEDOUT)
            return;
        if (rc == KVR_EAGAIN) { /* a batch: it needs a slot */
            pthread_mutex_lock(&s->lock);
            bool got = s->n_in_free > 0;
            if (got)
                s->rx_into = &s->in[s->in_free[--s->n_in_free]];
            else /* the upstream sent beyond its credits: compute wakes us for a free slot */
                s->up_paused = true;
            pthread_mutex_unlock(&s->lock);
            if (!got) {
                kvr_ev_events(ev, s->up.fd, 0);
                return;
            }
            continue;
        }
        if (rc) {
            if (rc == KVR_ECLOSED)
                KVR_INFO("%s: upstream %s closed the link", s->name, s->up.peer);
            else
                KVR_WARN("%s: upstream link dropped: %s", s->name, err.msg);
            lose_upstream(s);
            return;
        }
        switch (f->hdr.type) {
        case KVR_WIRE_BATCH:
            pthread_mutex_lock(&s->lock);
            s->rx_into->gen = s->up_gen;
            s->ready[(s->ready_head + s->n_ready++) % READY_CAP] =
                (struct ready){READY_INPUT, (uint32_t)(s->rx_into - s->in)};
            s->rx_into = NULL;
            pthread_cond_signal(&s->in_cond);
            pthread_mutex_unlock(&s->lock);
            break;
        case KVR_WIRE_HEARTBEAT:
            kvr_credit_ack(s->up.fd); /* credit.h: the upstream knows we still read */
            break;
        case KVR_WIRE_RESET:
            KVR_DEBUG("%s: stage %u dropped its sequences; passing it on", s->name, f->hdr.arg);
            pthread_mutex_lock(&s->lock);
            raise_notice(s, f->hdr.arg, f->hdr.batch_id);
            kick_send(s);
            pthread_mutex_unlock(&s->lock);
            break;
        case KVR_WIRE_GOODBYE:
            KVR_INFO("%s: upstream said goodbye", s->name);
            lose_upstream(s);
            return;
        case KVR_WIRE_REPLAN: /* only the bridge's control link may carry one */
            KVR_WARN("%s: upstream %s sent a REPLAN frame, which only the bridge's control "
                     "link may send; dropping the link",
                     s->name, s->up.peer);
            lose_upstream(s);
            return;
        default:
            break;
        }
    }
}

/* Stop both threads (compute finishes the batch it runs); kvr_stage_run looks at why. */
static void stop_stage(struct stage *s)
{
    pthread_mutex_lock(&s->lock);
    s->stopping = true;
    pthread_cond_broadcast(&s->in_cond);
    pthread_cond_broadcast(&s->out_cond);
    pthread_mutex_unlock(&s->lock);
    kvr_ev_stop(s->ev);
}

/* The frame the bridge sent on its control link (DESIGN.md 8, docs/PROTOCOL.md 6a): GOODBYE
 * (a probe: the bridge only wanted to see this stage alive) or REPLAN (the next epoch and
 * the stages kept). A REPLAN this stage can follow is acknowledged with one ack byte, then
 * the stage stops and starts again under the new plan (kvr_stage_run); one it cannot
 * follow is refused by closing the link unanswered. */
static void on_control_frame(struct stage *s, struct kvr_link *ctl, const struct kvr_wire_frame *f)
{
    if (f->hdr.type != KVR_WIRE_REPLAN) {
        KVR_DEBUG("%s: the bridge probed this stage (%s)", s->name,
                  kvr_wire_type_name(f->hdr.type));
        return;
    }
    uint64_t keep = f->hdr.batch_id;
    uint32_t epoch = f->hdr.arg;
    const struct kvr_plan *p = s->plan;
    struct kvr_err err = {0};
    uint32_t index = 0;
    bool kept = kvr_plan_replan_index(p, keep, s->index, &index);
    if (epoch != p->epoch + 1 || !kept) {
        KVR_WARN("%s: refused a re-plan to epoch %u keeping stages 0x%llx: this stage is at "
                 "epoch %u%s",
                 s->name, epoch, (unsigned long long)keep, p->epoch,
                 kept ? "" : " and is not kept");
        return;
    }
    if (kvr_plan_replan(p, s->gguf, keep, s->next_plan, &err)) {
        KVR_WARN("%s: refused a re-plan to epoch %u: %s", s->name, epoch, err.msg);
        return;
    }
    if (kvr_credit_ack(ctl->fd)) {
        KVR_WARN("%s: the bridge went away before the re-plan was acknowledged", s->name);
        return;
    }
    const struct kvr_plan_stage *st = &s->next_plan->stages[index];
    KVR_INFO("%s: re-planned by the bridge: epoch %u, %u stages, this one is stage %u with "
             "layers %u-%u; restarting",
             s->name, epoch, s->next_plan->n_stages, index, st->first_layer, st->last_layer);
    s->next_index = index;
    s->replanned = true;
    stop_stage(s);
}

/* A control link is authenticated (held by the acceptor): its one frame, when it has come
 * (never waited for: the acceptor's deadline covers it too). */
static void control_step(void *ctx, struct kvr_accept_slot *a)
{
    struct stage *s = ctx;
    const struct kvr_wire_frame *f;
    struct kvr_err err = {0};
    int rc = kvr_link_recv(&a->link, KVR_NET_NOW, &f, &err);
    if (rc == KVR_ETIMEDOUT)
        return;
    if (rc)
        KVR_WARN("%s: control link from %s: %s", s->name, a->peer,
                 rc == KVR_ECLOSED ? "closed before a frame" : err.msg);
    else
        on_control_frame(s, &a->link, f);
    kvr_accept_release(&s->acc, a);
}

/* A new upstream replaces the old one (a restarted upstream reconnects). */
static void adopt_upstream(struct stage *s, struct kvr_link *fresh, const char *peer)
{
    struct kvr_ev *ev = s->ev;
    KVR_INFO("%s: upstream connected from %s", s->name, peer);
    if (s->have_up) /* what the old link has sent is read (and judged) before it goes */
        on_up(ev, s->up.fd, KVR_EV_READ, s);
    pthread_mutex_lock(&s->lock);
    set_upstream(s, fresh->fd); /* before the old fd closes: no credit goes to it after */
    pthread_mutex_unlock(&s->lock);
    if (s->have_up) {
        KVR_WARN("%s: new upstream replaces the previous link", s->name);
        kvr_ev_unwatch(ev, s->up.fd);
        kvr_link_fini(&s->up);
    }
    s->up = *fresh;
    s->have_up = true;
    pthread_mutex_lock(&s->lock);
    s->up_paused = false;
    pthread_mutex_unlock(&s->lock);
    if (kvr_ev_watch(ev, s->up.fd, KVR_EV_READ, on_up, s)) {
        lose_upstream(s);
        return;
    }
    on_up(ev, s->up.fd, KVR_EV_READ, s);
}

static int begin_accept(void *ctx, struct kvr_link *link, struct kvr_link_hs *hs,
                        struct kvr_err *err)
{
    struct stage *s = ctx;
    return kvr_link_hs_begin_accept(link, hs, s->plan, s->index, err);
}

/* A would-be upstream passed its handshake (accept.h): it replaces the current link; a
 * control link stays with the acceptor until its frame has come (control_step). */
static void accepted(void *ctx, struct kvr_accept_slot *a)
{
    struct stage *s = ctx;
    if (a->hs.control)
        return;
    struct kvr_link fresh;
    char peer[KVR_NET_PEER_BYTES];
    snprintf(peer, sizeof peer, "%s", a->peer);
    kvr_accept_take(&s->acc, a, &fresh);
    adopt_upstream(s, &fresh, peer);
}

/* The compute thread asked for something (a frame queued, a slot freed, a link found
 * broken), or a signal asked the stage to stop. */
static void on_wake(struct kvr_ev *ev, void *arg)
{
    struct stage *s = arg;
    if (*s->stop) {
        stop_stage(s);
        return;
    }
    struct kvr_link fresh;
    if (!s->have_down && kvr_dialer_take(s->dialer, &fresh))
        install_down(s, &fresh);
    pthread_mutex_lock(&s->lock);
    kick_send(s);
    bool resume = s->up_paused && s->n_in_free > 0 && s->have_up;
    if (resume)
        s->up_paused = false;
    pthread_mutex_unlock(&s->lock);
    if (resume) {
        kvr_ev_events(ev, s->up.fd, KVR_EV_READ);
        on_up(ev, s->up.fd, KVR_EV_READ, s);
    }
}

static void *io_main(void *arg)
{
    struct stage *s = arg;
    kvr_ev_run(s->ev);
    return NULL;
}

/* ---- compute ------------------------------------------------------------------------- */

/* Free an input slot and, if its frame came over the current upstream link, give that link
 * the credit back. Lock held. */
static void release_input(struct stage *s, uint32_t id)
{
    s->in_free[s->n_in_free++] = id;
    if (s->up_fd >= 0 && s->in[id].gen == s->up_gen && kvr_credit_grant(s->up_fd, 1))
        KVR_DEBUG("%s: credit not delivered (upstream gone)", s->name);
    try_grant(s);
    if (s->up_paused)
        kvr_ev_wake(s->ev);
}

/* A finished frame goes downstream: straight from this thread when nothing is queued ahead
 * of it and the downstream has room (no thread to wake), else through the I/O thread, in
 * order. Lock held. */
static void hand_off(struct stage *s, uint32_t id)
{
    if (s->have_down && !s->down_dead && s->n_out_q == 0 && s->tx.kind == TX_NONE &&
        !s->notice_pending) {
        if (s->down_credits == 0) {
            bool heard = false;
            if (kvr_credit_read(s->down.fd, &s->down_credits, &heard))
                s->down_dead = true;
            else if (heard)
                s->await_ns = 0;
        }
        if (!s->down_dead && s->down_credits > 0) {
            s->down_credits--;
            struct kvr_err err = {0};
            int rc = kvr_link_send_begin(&s->down, &s->out[id].msg, &err);
            if (rc == 0 || rc == KVR_EAGAIN) {
                sent(s);
                if (rc == 0) {
                    give_out(s, id);
                    return;
                }
                s->tx = (struct tx){TX_OUT_SLOT, id}; /* the I/O thread writes the rest */
                s->want_write = true;
                kvr_ev_wake(s->ev);
                return;
            }
            KVR_WARN("%s: downstream lost, batch %llu dropped: %s", s->name,
                     (unsigned long long)s->out[id].msg.batch_id, err.msg);
            s->down_dead = true;
            give_out(s, id);
            kvr_ev_wake(s->ev);
            return;
        }
    }
    s->out_q[(s->out_q_head + s->n_out_q++) % N_OUT_SLOTS] = id;
    kvr_ev_wake(s->ev);
}

static void compute_loop(struct stage *s)
{
    uint64_t idle_since = kvr_now_ns();
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (!s->stopping && s->n_ready == 0)
            pthread_cond_wait(&s->in_cond, &s->lock);
        if (s->stopping)
            break;
        struct ready next = s->ready[s->ready_head];
        s->ready_head = (s->ready_head + 1) % READY_CAP;
        s->n_ready--;
        if (next.kind == READY_RESET) {
            pthread_mutex_unlock(&s->lock);
            if (kvr_step_has_sequences(&s->step))
                KVR_INFO("%s: upstream changed: dropping every sequence", s->name);
            else
                KVR_DEBUG("%s: upstream changed; no sequence to drop", s->name);
            kvr_step_reset(&s->step);
            idle_since = kvr_now_ns();
            pthread_mutex_lock(&s->lock);
            raise_notice(s, s->index, KVR_WIRE_RESET_LINK);
            kvr_ev_wake(s->ev);
            continue;
        }
        uint64_t t_arrived = kvr_now_ns();
        while (!s->stopping && s->n_out_free == 0)
            pthread_cond_wait(&s->out_cond, &s->lock);
        if (s->stopping)
            break;
        uint32_t out_id = s->out_free[--s->n_out_free];
        pthread_mutex_unlock(&s->lock);

        uint64_t t_start = kvr_now_ns();
        uint32_t in_id = next.slot;
        struct kvr_step_out *o = &s->out[out_id];
        const struct kvr_wire_frame *f = &s->in[in_id].rx.frame;
        struct kvr_err err = {0};
        int rc = kvr_step_run(&s->step, f, o, &err);
        uint64_t t_done = kvr_now_ns();
        if (rc) {
            /* The bridge and every stage decide membership from the same plan, so a batch
             * this stage cannot run means the ring's state diverged (typically: this stage
             * lost its sequences with its upstream link, and the bridge did not know yet).
             * The batch is not forwarded; a RESET naming it tells the bridge, which holds
             * and re-prefills its sequences unless it had already given up on the batch. */
            KVR_ERROR("%s: batch %llu dropped: %s", s->name, (unsigned long long)f->hdr.batch_id,
                      err.msg);
            kvr_step_reset(&s->step);
            pthread_mutex_lock(&s->lock);
            raise_notice(s, s->index, f->hdr.batch_id);
            give_out(s, out_id);
            release_input(s, in_id);
            kvr_ev_wake(s->ev);
            idle_since = t_done;
            continue;
        }
        kvr_step_time(&s->step, o, t_arrived > idle_since ? t_arrived - idle_since : 0,
                      t_start - t_arrived, t_done - t_start);
        if (s->experts) { /* the agents this batch used, after this stage's record */
            struct kvr_wire_timing at[KVR_PLAN_MAX_AGENTS];
            kvr_step_time_agents(o, at, kvr_experts_client_take_timings(s->experts, at));
        }
        /* The finished batch goes first: the downstream is waiting for it, while the
         * upstream still has a credit in hand unless this stage's input queue is full. A
         * wake-up or a system call before the send is where a stage whose CPU quota ran out
         * gets throttled, holding the batch. */
        pthread_mutex_lock(&s->lock);
        hand_off(s, out_id);
        release_input(s, in_id);
        idle_since = t_done;
    }
    pthread_mutex_unlock(&s->lock);
}

/* ---- start-up and shutdown ------------------------------------------------------------ */

static void stage_fini(struct stage *s)
{
    if (s->io_started)
        pthread_join(s->io_thread, NULL);
    kvr_dialer_stop(s->dialer);
    atomic_store(&running_ev, NULL);
    if (s->have_down) {
        if (!s->down.tx_pending) {
            struct kvr_err err = {0};
            kvr_link_send_goodbye(&s->down, KVR_WIRE_GOODBYE_SHUTDOWN, kvr_net_deadline(200), &err);
        }
        kvr_link_fini(&s->down);
    }
    if (s->have_up)
        kvr_link_fini(&s->up);
    kvr_accept_fini(&s->acc);
    if (s->listen_fd >= 0)
        close(s->listen_fd);
    kvr_ev_destroy(s->ev);
    for (uint32_t i = 0; i < N_IN_SLOTS; i++)
        kvr_link_rx_fini(&s->in[i].rx);
    for (uint32_t i = 0; i < N_OUT_SLOTS; i++)
        kvr_step_out_fini(&s->out[i]);
    kvr_step_fini(&s->step);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->in_cond);
    pthread_cond_destroy(&s->out_cond);
    kvr_tok_destroy(s->tok);
    kvr_experts_client_destroy(s->experts);
    kvr_engine_destroy(s->engine);
}

/* The process's resident bytes (Rss of /proc/self/smaps_rollup), or 0 if unreadable. */
static size_t resident_bytes(void)
{
    return (size_t)kvr_procfs_bytes("/proc/self/smaps_rollup", "Rss");
}

/* One log line comparing the resident set with what the slice should hold (the numbers
 * `kvasir info --plan` prints). */
static void log_resident(const struct stage *s, const char *when)
{
    struct kvr_engine_bytes b;
    struct kvr_err err = {0};
    if (kvr_engine_expected_bytes(s->gguf, &s->cfg, &b, &err)) {
        KVR_WARN("%s: expected resident bytes: %s", s->name, err.msg);
        return;
    }
    KVR_INFO("%s: resident %zu bytes %s; expected %zu (weights %zu, kv %zu, scratch %zu)", s->name,
             resident_bytes(), when, b.weights + b.kv + b.scratch, b.weights, b.kv, b.scratch);
}

void kvr_stage_engine_config(const struct kvr_plan *p, uint32_t index,
                             struct kvr_engine_config *cfg)
{
    const struct kvr_plan_stage *st = &p->stages[index];
    uint32_t threads = st->n_threads ? st->n_threads : p->n_threads ? p->n_threads : 1;
    *cfg = (struct kvr_engine_config){.first_layer = st->first_layer,
                                      .last_layer = st->last_layer,
                                      .max_rows = p->row_width,
                                      .max_seqs = p->max_seqs,
                                      .n_ctx = p->n_ctx,
                                      .kv_block_tokens = p->kv_block_tokens,
                                      .kv_n_blocks = p->kv_blocks,
                                      .kv_type = p->kv_type,
                                      .n_threads = threads};
}

/* A warm standby (kvr_stage_options.standby) has loaded its slice; it becomes the stage as
 * soon as it can listen on the stage's address, which is once the process serving there has
 * died (SO_REUSEADDR: a dead listener's connections do not hold the port), and only then
 * links to its neighbours, so a live stage is never displaced. It tries every
 * STANDBY_POLL_MS: a few system calls, against the hundreds of milliseconds a fresh
 * process spends loading. */
static int standby_listen(struct stage *s, struct kvr_err *err)
{
    const char *addr = s->plan->stages[s->index].addr;
    KVR_INFO("%s: standby: loaded, takes over %s when the stage there dies", s->name, addr);
    struct kvr_err e = {0};
    while (kvr_net_listen(addr, 16, &s->listen_fd, NULL, &e) != 0) {
        if (*s->stop)
            return kvr_err_set(err, KVR_ECLOSED, "%s: standby stopped before it was needed",
                               s->name);
        struct timespec ts = {0, STANDBY_POLL_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
    KVR_INFO("%s: standby takes over %s", s->name, addr);
    return KVR_OK;
}

static int stage_init(struct stage *s, struct kvr_err *err)
{
    const struct kvr_plan *p = s->plan;
    int rc;
    if ((rc = kvr_hparams_read(&s->hp, s->gguf, err)) ||
        (rc = kvr_plan_validate(p, s->hp.n_layer, err)))
        return rc;
    const struct kvr_plan_stage *st = &p->stages[s->index];
    struct kvr_engine_config cfg;
    kvr_stage_engine_config(p, s->index, &cfg);
    uint32_t threads = cfg.n_threads;
    s->cfg = cfg;
    if ((rc = kvr_engine_create(&s->engine, s->gguf, &cfg, err)) ||
        (s->standby && (rc = standby_listen(s, err))) ||
        (rc = kvr_experts_client_create(&s->experts, p, s->index, &s->hp, s->name, err)))
        return rc;
    if (s->experts) /* this stage's MoE layers send their experts' rows to agents */
        kvr_engine_set_expert_dispatch(s->engine, kvr_experts_dispatch, s->experts);
    if (s->is_tail) {
        struct kvr_err tok_err = {0};
        if (kvr_tok_create(&s->tok, s->gguf, &tok_err))
            KVR_WARN("%s: no usable vocabulary (%s): end-of-generation is not flagged", s->name,
                     tok_err.msg);
    }
    int down = s->is_tail ? KVR_WIRE_RECV_BRIDGE : (int)s->index + 1;
    if ((rc = kvr_wire_limits_init(&s->up_limits, p, s->hp.n_embd, s->hp.n_vocab, (int)s->index,
                                   err)) ||
        (rc = kvr_wire_limits_init(&s->down_limits, p, s->hp.n_embd, s->hp.n_vocab, down, err)) ||
        (rc = kvr_step_init(&s->step, p, s->index, s->engine, &s->hp, s->tok, err)))
        return rc;
    for (uint32_t i = 0; i < N_IN_SLOTS; i++) {
        if ((rc = kvr_link_rx_init(&s->in[i].rx, &s->up_limits, err)))
            return rc;
        s->in_free[s->n_in_free++] = N_IN_SLOTS - 1 - i;
    }
    for (uint32_t i = 0; i < N_OUT_SLOTS; i++) {
        if ((rc = kvr_step_out_init(&s->step, &s->out[i], &s->up_limits, err)))
            return rc;
        s->out_free[s->n_out_free++] = N_OUT_SLOTS - 1 - i;
    }
    if ((rc = kvr_ev_create(&s->ev, err)))
        return rc;
    s->t_heartbeat = kvr_ev_timer(s->ev, on_heartbeat_timer, s);
    kvr_ev_on_wake(s->ev, on_wake, s);
    struct kvr_accept_config ac = {.name = s->name,
                                   .limits = &s->up_limits,
                                   .dirs = KVR_LINK_RECV,
                                   .handshake_ms = HANDSHAKE_MS,
                                   .begin = begin_accept,
                                   .done = accepted,
                                   .more = control_step,
                                   .ctx = s};
    if ((s->listen_fd < 0 &&
         (rc = kvr_net_listen(p->stages[s->index].addr, 16, &s->listen_fd, NULL, err))) ||
        (rc = kvr_accept_start(&s->acc, s->ev, s->listen_fd, &ac, err)))
        return rc;
    struct kvr_dialer_config dc = {.plan = p,
                                   .addr = downstream_addr(s),
                                   .limits = &s->down_limits,
                                   .role = KVR_AUTH_ROLE_STAGE,
                                   .index = s->index,
                                   .name = s->name,
                                   .handshake_ms = HANDSHAKE_MS,
                                   .backoff_max_ms = BACKOFF_MAX_MS,
                                   .wake = s->ev};
    if ((rc = kvr_dialer_start(&s->dialer, &dc, err)))
        return rc;
    KVR_INFO("%s: layers %u-%u of %u, %u threads, listening on %s", s->name, st->first_layer,
             st->last_layer, s->hp.n_layer, threads, p->stages[s->index].addr);
    log_resident(s, "at start");
    return KVR_OK;
}

/* One life of the stage under one plan: until a stop, or a re-plan (*replanned, with the
 * next plan in `next` and this stage's index in it in *next_index). */
static int run_once(const struct kvr_plan *plan, uint32_t index, bool standby,
                    struct kvr_gguf *gguf, struct kvr_plan *next, atomic_int *stop, bool *replanned,
                    uint32_t *next_index, struct kvr_err *err)
{
    *replanned = false;
    struct stage *s = kvr_calloc(1, sizeof *s);
    if (!s)
        return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory");
    s->plan = plan;
    s->gguf = gguf;
    s->next_plan = next;
    s->index = index;
    s->is_head = index == 0;
    s->is_tail = index + 1 == plan->n_stages;
    s->standby = standby;
    s->stop = stop;
    s->listen_fd = -1;
    s->up_fd = -1;
    s->tx = tx_none;
    s->down.fd = -1;
    s->up.fd = -1;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->in_cond, NULL);
    pthread_cond_init(&s->out_cond, NULL);
    snprintf(s->name, sizeof s->name, "stage %u", index);
    int rc = stage_init(s, err);
    if (rc == 0) {
        atomic_store(&running_ev, s->ev);
        s->io_started = pthread_create(&s->io_thread, NULL, io_main, s) == 0;
        if (!s->io_started) {
            rc = kvr_err_set(err, KVR_ENOMEM, "stage: cannot start its I/O thread");
            *stop = 1;
        } else {
            if (*stop) /* a signal before the loop could hear it */
                kvr_ev_wake(s->ev);
            compute_loop(s);
            log_resident(s, "at stop");
        }
    }
    stage_fini(s);
    *replanned = rc == 0 && s->replanned;
    *next_index = s->next_index;
    kvr_free(s);
    return rc;
}

/* A spare (docs/PLAN.md "Spare stages"): listen on its address for the bridge's control
 * links until one brings a REPLAN that takes it into the ring, then acknowledge it (*index
 * = its place in `next`). A REPLAN that leaves it a spare is acknowledged and followed
 * (*plan becomes the new plan, *j its index among the new plan's spares), so a later loss
 * can still take it. Probes (GOODBYE) are answered by closing the link. Blocking, on the
 * caller's thread: nothing else runs yet; *stop is looked at every SPARE_POLL_MS. */
enum { SPARE_POLL_MS = 200, SPARE_HANDSHAKE_MS = 3000 };

static int spare_wait(struct kvr_plan *plan, uint32_t *j, struct kvr_gguf *gguf,
                      struct kvr_plan *next, atomic_int *stop, uint32_t *index, struct kvr_err *err)
{
    char addr[KVR_PLAN_ADDR_BYTES];
    snprintf(addr, sizeof addr, "%s", plan->spares[*j].addr);
    struct kvr_wire_limits limits;
    int listen_fd = -1;
    int rc = kvr_wire_limits_init(&limits, plan, 1, 1, 0, err);
    if (rc == 0)
        rc = kvr_net_listen(addr, 8, &listen_fd, NULL, err);
    if (rc)
        return rc;
    KVR_INFO("spare %u: listening on %s; it takes the layers of a stage lost for good", *j, addr);
    const struct kvr_auth_id bridge = {KVR_AUTH_ROLE_BRIDGE, KVR_AUTH_INDEX_CONTROL};
    rc = KVR_ECLOSED;
    while (!*stop) {
        int fd;
        char peer[KVR_NET_PEER_BYTES];
        struct kvr_err e = {0};
        int r =
            kvr_net_accept(listen_fd, kvr_net_deadline(SPARE_POLL_MS), &fd, peer, sizeof peer, &e);
        if (r == KVR_ETIMEDOUT)
            continue;
        if (r) {
            rc = kvr_err_set(err, r, "spare %u: %s", *j, e.msg);
            break;
        }
        struct kvr_link l;
        if (kvr_link_init(&l, fd, peer, &limits, KVR_LINK_RECV, &e)) {
            close(fd);
            KVR_WARN("spare %u: %s", *j, e.msg);
            continue;
        }
        uint32_t self_index = plan->n_stages + *j;
        const struct kvr_auth_id self = {KVR_AUTH_ROLE_STAGE, self_index};
        const struct kvr_wire_frame *f = NULL;
        r = kvr_link_handshake_ids(&l, plan, self, bridge, false, SPARE_HANDSHAKE_MS, &e);
        if (r == 0)
            r = kvr_link_recv(&l, kvr_net_deadline(SPARE_HANDSHAKE_MS), &f, &e);
        bool taken = false;
        if (r) {
            KVR_WARN("spare %u: control link from %s: %s", *j, peer, e.msg);
        } else if (f->hdr.type != KVR_WIRE_REPLAN) {
            KVR_DEBUG("spare %u: the bridge probed this spare", *j);
        } else {
            uint64_t keep = f->hdr.batch_id;
            uint32_t at = 0;
            bool kept = kvr_plan_replan_index(plan, keep, self_index, &at);
            if (f->hdr.arg != plan->epoch + 1)
                KVR_WARN("spare %u: refused a re-plan to epoch %u: this spare is at epoch %u", *j,
                         f->hdr.arg, plan->epoch);
            else if (kvr_plan_replan(plan, gguf, keep, next, &e))
                KVR_WARN("spare %u: refused a re-plan to epoch %u: %s", *j, f->hdr.arg, e.msg);
            else if (kvr_credit_ack(l.fd))
                KVR_WARN("spare %u: the bridge went away before the re-plan was acknowledged", *j);
            else if (kept) {
                const struct kvr_plan_stage *st = &next->stages[at];
                KVR_INFO("spare %u: taken into the ring by the bridge: epoch %u, %u stages, "
                         "this one is stage %u with layers %u-%u",
                         *j, next->epoch, next->n_stages, at, st->first_layer, st->last_layer);
                *index = at;
                taken = true;
            } else { /* still a spare: the spares not taken keep their order */
                uint32_t nj = 0;
                for (uint32_t k = 0; k < *j; k++)
                    nj += !((keep >> (plan->n_stages + k)) & 1);
                KVR_INFO("spare %u: follows the re-plan to epoch %u (%u stages) as spare %u", *j,
                         next->epoch, next->n_stages, nj);
                kvr_plan_wipe(plan);
                *plan = *next;
                *j = nj;
            }
        }
        kvr_link_fini(&l);
        if (taken) {
            rc = KVR_OK;
            break;
        }
    }
    close(listen_fd);
    if (rc == KVR_ECLOSED && *stop)
        return kvr_err_set(err, KVR_ECLOSED, "spare %u: stopped before it was needed", *j);
    return rc;
}

int kvr_stage_run(const struct kvr_plan *plan, const struct kvr_stage_options *opt,
                  atomic_int *stop, struct kvr_err *err)
{
    if (opt->spare ? opt->index >= plan->n_spares : opt->index >= plan->n_stages)
        return kvr_err_set(err, KVR_EINVAL, "%s index %u: the plan has %u",
                           opt->spare ? "spare" : "stage", opt->index,
                           opt->spare ? plan->n_spares : plan->n_stages);
    struct kvr_plan *local = kvr_malloc(sizeof *local);
    struct kvr_plan *next = kvr_malloc(sizeof *next);
    if (!local || !next) {
        kvr_free(local);
        kvr_free(next);
        return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory");
    }
    *local = *plan;
    if (opt->n_threads && !opt->spare)
        local->stages[opt->index].n_threads = opt->n_threads;
    if (opt->n_threads && opt->spare)
        local->spares[opt->index].n_threads = opt->n_threads;
    /* The model file is opened and checked once: a re-plan loads other layers of it. */
    struct kvr_gguf *gguf = NULL;
    char path[KVR_PLAN_PATH_BYTES];
    int rc;
    if ((rc = kvr_plan_path(local, local->model_path, path, sizeof path, err)) == 0 &&
        (rc = kvr_gguf_open(&gguf, path, err)) == 0 && local->model_fingerprint)
        rc = kvr_plan_check_fingerprint(local, kvr_gguf_fingerprint(gguf), err);
    uint32_t index = opt->index;
    if (rc == 0 && opt->spare) {
        uint32_t j = opt->index;
        if ((rc = spare_wait(local, &j, gguf, next, stop, &index, err)) == 0) {
            kvr_plan_wipe(local);
            *local = *next;
        } else if (*stop) {
            rc = KVR_OK; /* an orderly stop of a spare never needed */
        }
    }
    bool standby = opt->standby && !opt->spare;
    while (rc == 0 && !*stop) {
        bool replanned = false;
        uint32_t next_index = 0;
        rc = run_once(local, index, standby, gguf, next, stop, &replanned, &next_index, err);
        if (rc == KVR_ECLOSED && standby && *stop)
            rc = KVR_OK; /* an orderly stop of a standby never needed */
        standby = false;
        if (rc || !replanned || *stop)
            break;
        kvr_plan_wipe(local);
        *local = *next;
        index = next_index;
    }
    kvr_gguf_close(gguf);
    kvr_plan_wipe(local);
    kvr_plan_wipe(next);
    kvr_free(local);
    kvr_free(next);
    return rc;
}
