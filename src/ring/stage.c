/* stage.c - the stage agent (see stage.h for the threads and their jobs).
 *
 * Reading order: the slot queues shared by the threads, start-up (model, engine, buffers),
 * the rx thread, the tx thread, then the compute loop. */
#include "ring/stage.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "ring/credit.h"
#include "ring/net.h"
#include "ring/wire.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

enum {
    HEARTBEAT_MS = 1000,   /* tx sends a heartbeat after this long without a frame */
    HANDSHAKE_MS = 3000,   /* each handshake message must arrive within this */
    POLL_MS = 100,         /* how often idle threads look at the stop flag */
    BACKOFF_MIN_MS = 50,
    BACKOFF_MAX_MS = 2000,
    N_OUT_SLOTS = 2,       /* one being sent, one being filled */
    N_IN_SLOTS = 2,        /* one being computed, one received: the credits we grant */
};

/* ---- slots and queues ----------------------------------------------------------------- */

enum in_kind {
    IN_BATCH,  /* a batch to compute */
    IN_RESET,  /* the upstream link was lost or replaced: drop every sequence */
};

/* One received batch, copied out of the link's buffer so rx can read the next frame. */
struct in_slot {
    enum in_kind kind;
    uint64_t gen;                     /* upstream link generation it came from */
    uint64_t batch_id;
    uint32_t n_ctrl, n_segs, n_timings, n_rows;
    struct kvr_wire_ctrl *ctrl;       /* [max_ctrl] */
    struct kvr_seg *segs;             /* [max_segs] */
    struct kvr_wire_timing *timings;  /* [n_stages + 1] */
    int32_t *tokens;                  /* head: [row_width] token ids */
    float *rows;                      /* other stages: [row_width x n_embd] boundary rows */
};

/* One frame to send downstream. */
struct out_slot {
    struct kvr_wire_msg msg;
    struct kvr_wire_ctrl *ctrl;       /* [max_ctrl] */
    struct kvr_seg *segs;             /* [max_segs] */
    struct kvr_wire_timing *timings;  /* [n_stages + 1] */
    struct kvr_wire_result *results;  /* tail: [max_segs] */
    float *rows;                      /* non-tail: [row_width x n_embd] engine output */
    void *wire_rows;                  /* non-tail, f16/bf16 wire: converted rows */
};

/* A bounded FIFO of slot indices with a free list, guarded by one mutex. */
struct slot_queue {
    pthread_mutex_t lock;
    pthread_cond_t has_ready, has_free; /* one each: a waiter for one is not woken by the other */
    uint32_t cap;
    uint32_t *fifo;  /* ready slots, in order */
    uint32_t head, n_ready;
    uint32_t *free_ids;
    uint32_t n_free;
    bool kicked;     /* queue_kick: wake the waiter in queue_pop_ready without a slot */
};

static int queue_init(struct slot_queue *q, uint32_t cap)
{
    memset(q, 0, sizeof *q);
    q->cap = cap;
    q->fifo = kvr_calloc(cap, sizeof *q->fifo);
    q->free_ids = kvr_calloc(cap, sizeof *q->free_ids);
    if (!q->fifo || !q->free_ids)
        return KVR_ENOMEM;
    for (uint32_t i = 0; i < cap; i++)
        q->free_ids[i] = cap - 1 - i;
    q->n_free = cap;
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->has_ready, NULL);
    pthread_cond_init(&q->has_free, NULL);
    return KVR_OK;
}

static void queue_fini(struct slot_queue *q)
{
    if (q->fifo) {
        pthread_mutex_destroy(&q->lock);
        pthread_cond_destroy(&q->has_ready);
        pthread_cond_destroy(&q->has_free);
    }
    kvr_free(q->fifo);
    kvr_free(q->free_ids);
}

/* Take a free slot id, waiting at most wait_ms; -1 if none came. */
static int queue_take_free(struct slot_queue *q, int wait_ms)
{
    struct timespec ts = kvr_deadline_after_ms((uint32_t)wait_ms);
    pthread_mutex_lock(&q->lock);
    while (q->n_free == 0)
        if (pthread_cond_timedwait(&q->has_free, &q->lock, &ts) == ETIMEDOUT)
            break;
    int id = q->n_free ? (int)q->free_ids[--q->n_free] : -1;
    pthread_mutex_unlock(&q->lock);
    return id;
}

static void queue_push_ready(struct slot_queue *q, uint32_t id)
{
    pthread_mutex_lock(&q->lock);
    q->fifo[(q->head + q->n_ready++) % q->cap] = id;
    pthread_cond_signal(&q->has_ready);
    pthread_mutex_unlock(&q->lock);
}

/* Take the oldest ready slot id, waiting at most wait_ms; -1 if none came. */
static int queue_pop_ready(struct slot_queue *q, int wait_ms)
{
    struct timespec ts = kvr_deadline_after_ms((uint32_t)wait_ms);
    pthread_mutex_lock(&q->lock);
    while (q->n_ready == 0 && !q->kicked)
        if (pthread_cond_timedwait(&q->has_ready, &q->lock, &ts) == ETIMEDOUT)
            break;
    q->kicked = false;
    int id = -1;
    if (q->n_ready) {
        id = (int)q->fifo[q->head];
        q->head = (q->head + 1) % q->cap;
        q->n_ready--;
    }
    pthread_mutex_unlock(&q->lock);
    return id;
}

/* Make the current or next queue_pop_ready return at once, ready slot or not. */
static void queue_kick(struct slot_queue *q)
{
    pthread_mutex_lock(&q->lock);
    q->kicked = true;
    pthread_cond_signal(&q->has_ready);
    pthread_mutex_unlock(&q->lock);
}

static void queue_give_free(struct slot_queue *q, uint32_t id)
{
    pthread_mutex_lock(&q->lock);
    q->free_ids[q->n_free++] = id;
    pthread_cond_signal(&q->has_free);
    pthread_mutex_unlock(&q->lock);
}

/* ---- the stage ------------------------------------------------------------------------ */

struct stage {
    const struct kvr_plan *plan;
    uint32_t index;
    bool is_head, is_tail;
    atomic_int *stop;                 /* set by a signal handler; read by every thread */
    char name[32];                    /* "stage 1" */

    struct kvr_gguf *gguf;
    struct kvr_engine *engine;
    struct kvr_hparams hp;
    struct kvr_tok *tok;              /* tail: end-of-generation ids */

    struct kvr_wire_limits up_limits;   /* what this stage accepts from upstream */
    struct kvr_wire_limits down_limits; /* what the downstream accepts from us */
    uint32_t rows_payload;            /* the plan's wire dtype as a payload type */

    int listen_fd;
    /* The current upstream socket, for the compute thread's credits (credit.h). A slot
     * freed from an older link earns no credit. */
    pthread_mutex_t up_lock;
    int up_fd;                        /* -1 while there is no upstream */
    uint64_t up_gen;
    struct in_slot *in;               /* [n_in] */
    uint32_t n_in;
    struct slot_queue in_q;
    struct out_slot out[N_OUT_SLOTS];
    struct slot_queue out_q;

    /* Tail: sampling state per sequence slot. */
    struct kvr_sampler *samplers;     /* [max_seqs] */
    bool *open;                       /* [max_seqs] a sequence is open in this slot */
    bool *want_logprobs;              /* [max_seqs] */
    struct kvr_sample_scratch *scratch;
    float *logits;                    /* [row_width x n_vocab] */

    /* A RESET (wire.h) to send downstream ahead of the next frame: raised by compute when
     * this stage drops its sequences, by rx when one comes from upstream; sent by tx. Set
     * before the frames that follow it are queued, so it always goes out ahead of them. */
    pthread_mutex_t notice_lock;
    bool notice_pending;
    uint32_t notice_stage;
    uint64_t notice_batch;            /* KVR_WIRE_RESET_LINK, or the batch that failed */

    /* The downstream link. tx connects it, sends what is queued, collects credits and
     * sends heartbeats; the compute thread sends a finished batch itself when nothing is
     * queued ahead of it and the downstream has room (hand_off), which saves waking tx:
     * on a stage with a fraction of a core that wake-up can wait out a whole quota period.
     * Everything here is guarded by down_lock. */
    pthread_mutex_t down_lock;
    struct kvr_link down;
    bool have_down;
    uint64_t down_gen;                /* bumped whenever the link is dropped */
    uint32_t down_credits;
    uint32_t pending;                 /* frames queued for tx and not yet sent */
    uint64_t last_send;

    pthread_t rx_thread, tx_thread;
    bool rx_started, tx_started;
};

/* Two pending resets merge into one: a lost link outweighs failed batches (the bridge
 * ignores a failure of a batch it has already given up on, never a lost link). */
static void raise_notice(struct stage *s, uint32_t stage, uint64_t batch_id)
{
    pthread_mutex_lock(&s->notice_lock);
    bool replace = !s->notice_pending ||
                   (s->notice_batch != KVR_WIRE_RESET_LINK &&
                    (batch_id == KVR_WIRE_RESET_LINK || batch_id > s->notice_batch));
    if (replace) {
        s->notice_stage = stage;
        s->notice_batch = batch_id;
    }
    s->notice_pending = true;
    pthread_mutex_unlock(&s->notice_lock);
    queue_kick(&s->out_q); /* tx may be idle: it sends the reset now, not at its next poll */
}

static bool take_notice(struct stage *s, uint32_t *stage, uint64_t *batch_id)
{
    pthread_mutex_lock(&s->notice_lock);
    bool pending = s->notice_pending;
    *stage = s->notice_stage;
    *batch_id = s->notice_batch;
    s->notice_pending = false;
    pthread_mutex_unlock(&s->notice_lock);
    return pending;
}

static int alloc_slots(struct stage *s, struct kvr_err *err)
{
    const struct kvr_plan *p = s->plan;
    size_t n_rows_f = (size_t)p->row_width * s->hp.n_embd;
    uint32_t max_ctrl = s->up_limits.max_ctrl, max_segs = s->up_limits.max_segs;
    uint32_t n_tim = p->n_stages + 1;
    s->n_in = N_IN_SLOTS;
    s->in = kvr_calloc(s->n_in, sizeof *s->in);
    if (!s->in)
        return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory");
    for (uint32_t i = 0; i < s->n_in; i++) {
        struct in_slot *in = &s->in[i];
        in->ctrl = kvr_calloc(max_ctrl ? max_ctrl : 1, sizeof *in->ctrl);
        in->segs = kvr_calloc(max_segs, sizeof *in->segs);
        in->timings = kvr_calloc(n_tim, sizeof *in->timings);
        if (s->is_head)
            in->tokens = kvr_calloc(p->row_width, sizeof *in->tokens);
        else
            in->rows = kvr_aligned_alloc(64, n_rows_f * sizeof(float));
        if (!in->ctrl || !in->segs || !in->timings || !(in->tokens || in->rows))
            return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory for input slots");
    }
    for (uint32_t i = 0; i < N_OUT_SLOTS; i++) {
        struct out_slot *o = &s->out[i];
        o->ctrl = kvr_calloc(max_ctrl ? max_ctrl : 1, sizeof *o->ctrl);
        o->segs = kvr_calloc(max_segs, sizeof *o->segs);
        o->timings = kvr_calloc(n_tim, sizeof *o->timings);
        if (!o->ctrl || !o->segs || !o->timings)
            return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory for output slots");
        if (s->is_tail) {
            if (!(o->results = kvr_calloc(max_segs, sizeof *o->results)))
                return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory");
        } else {
            if (!(o->rows = kvr_aligned_alloc(64, n_rows_f * sizeof(float))))
                return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory");
            if (s->rows_payload != KVR_WIRE_PAYLOAD_F32 &&
                !(o->wire_rows = kvr_aligned_alloc(64, n_rows_f * 2)))
                return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory");
        }
    }
    int rc = queue_init(&s->in_q, s->n_in);
    if (!rc)
        rc = queue_init(&s->out_q, N_OUT_SLOTS);
    if (rc)
        return kvr_err_set(err, rc, "stage: out of memory for queues");
    return KVR_OK;
}

static void free_slots(struct stage *s)
{
    for (uint32_t i = 0; s->in && i < s->n_in; i++) {
        kvr_free(s->in[i].ctrl);
        kvr_free(s->in[i].segs);
        kvr_free(s->in[i].timings);
        kvr_free(s->in[i].tokens);
        kvr_free(s->in[i].rows);
    }
    kvr_free(s->in);
    for (uint32_t i = 0; i < N_OUT_SLOTS; i++) {
        kvr_free(s->out[i].ctrl);
        kvr_free(s->out[i].segs);
        kvr_free(s->out[i].timings);
        kvr_free(s->out[i].results);
        kvr_free(s->out[i].rows);
        kvr_free(s->out[i].wire_rows);
    }
    queue_fini(&s->in_q);
    queue_fini(&s->out_q);
}

/* ---- rx: the upstream link ------------------------------------------------------------ */

/* Accept one connection and authenticate it as our upstream. On success *link is ready. */
static int accept_upstream(struct stage *s, struct kvr_link *link)
{
    struct kvr_err err = {0};
    int fd;
    char peer[KVR_NET_PEER_BYTES];
    if (kvr_net_accept(s->listen_fd, kvr_net_deadline(POLL_MS), &fd, peer, sizeof peer, &err))
        return -1;
    if (kvr_link_init(link, fd, peer, &s->up_limits, KVR_LINK_RECV, &err)) {
        KVR_WARN("%s: cannot set up link from %s: %s", s->name, peer, err.msg);
        return -1;
    }
    if (kvr_link_handshake_server(link, s->plan, KVR_AUTH_ROLE_STAGE, s->index, HANDSHAKE_MS,
                                  &err)) {
        KVR_WARN("%s: refused connection from %s: %s", s->name, peer, err.msg);
        kvr_link_fini(link);
        return -1;
    }
    KVR_INFO("%s: upstream connected from %s", s->name, peer);
    return 0;
}

/* The upstream changed (new link, or none): later frames come from generation up_gen. */
static void set_upstream(struct stage *s, int fd)
{
    pthread_mutex_lock(&s->up_lock);
    s->up_fd = fd;
    s->up_gen++;
    pthread_mutex_unlock(&s->up_lock);
}

/* Wait until compute has finished every frame of the old upstream, then give the new one
 * a credit per input slot. */
static void grant_initial_credits(struct stage *s)
{
    for (;;) {
        pthread_mutex_lock(&s->in_q.lock);
        bool idle = s->in_q.n_free == s->in_q.cap;
        pthread_mutex_unlock(&s->in_q.lock);
        if (idle || *s->stop)
            break;
        kvr_sleep_ns(1000000);
    }
    pthread_mutex_lock(&s->up_lock);
    if (s->up_fd >= 0 && kvr_credit_grant(s->up_fd, s->n_in))
        KVR_WARN("%s: cannot grant credits upstream", s->name);
    pthread_mutex_unlock(&s->up_lock);
}

static void push_reset(struct stage *s)
{
    int id;
    while ((id = queue_take_free(&s->in_q, POLL_MS)) < 0)
        if (*s->stop)
            return;
    s->in[id].kind = IN_RESET;
    queue_push_ready(&s->in_q, (uint32_t)id);
}

/* Copy a received BATCH into a free input slot (waiting for one: that is backpressure on
 * the upstream, which then waits on its own send). */
static bool enqueue_batch(struct stage *s, const struct kvr_wire_frame *f)
{
    int id;
    while ((id = queue_take_free(&s->in_q, POLL_MS)) < 0)
        if (*s->stop)
            return false;
    struct in_slot *in = &s->in[id];
    const struct kvr_wire_header *h = &f->hdr;
    in->kind = IN_BATCH;
    pthread_mutex_lock(&s->up_lock);
    in->gen = s->up_gen;
    pthread_mutex_unlock(&s->up_lock);
    in->batch_id = h->batch_id;
    in->n_ctrl = h->n_ctrl;
    in->n_segs = h->n_segs;
    in->n_timings = h->n_timings;
    in->n_rows = h->n_rows;
    memcpy(in->ctrl, f->ctrl, h->n_ctrl * sizeof *f->ctrl);
    memcpy(in->segs, f->segs, h->n_segs * sizeof *f->segs);
    memcpy(in->timings, f->timings, h->n_timings * sizeof *f->timings);
    /* A control-only batch has no payload at all (and its payload pointer is NULL). */
    if (h->n_rows > 0 && s->is_head)
        memcpy(in->tokens, f->payload, h->n_rows * sizeof(int32_t));
    else if (h->n_rows > 0)
        kvr_wire_rows_to_f32(h->payload, f->payload, (size_t)h->n_rows * s->hp.n_embd,
                             in->rows);
    queue_push_ready(&s->in_q, (uint32_t)id);
    return true;
}

static void *rx_main(void *arg)
{
    struct stage *s = arg;
    struct kvr_link up = {.fd = -1};
    bool have_up = false;
    while (!*s->stop) {
        struct pollfd pfd[2] = {{s->listen_fd, POLLIN, 0}, {up.fd, POLLIN, 0}};
        int n = poll(pfd, have_up ? 2 : 1, POLL_MS);
        if (n < 0 && errno != EINTR)
            break;
        if (n <= 0)
            continue;
        if (pfd[0].revents & POLLIN) {
            /* A new upstream replaces the old one (a restarted upstream reconnects); a peer
             * that fails the handshake is refused and the current link is untouched. */
            struct kvr_link fresh;
            if (accept_upstream(s, &fresh) == 0) {
                if (have_up) {
                    KVR_WARN("%s: new upstream replaces the previous link", s->name);
                    kvr_link_fini(&up);
                }
                up = fresh;
                have_up = true;
                set_upstream(s, up.fd);
                push_reset(s);
                grant_initial_credits(s);
            }
            continue;
        }
        if (!have_up || !(pfd[1].revents & (POLLIN | POLLHUP | POLLERR)))
            continue;
        const struct kvr_wire_frame *f;
        struct kvr_err err = {0};
        int rc = kvr_link_recv(&up, kvr_net_deadline(POLL_MS), &f, &err);
        if (rc == KVR_ETIMEDOUT)
            continue;
        if (rc) {
            if (rc == KVR_ECLOSED)
                KVR_INFO("%s: upstream %s closed the link", s->name, up.peer);
            else
                KVR_WARN("%s: upstream link dropped: %s", s->name, err.msg);
            set_upstream(s, -1);
            kvr_link_fini(&up);
            have_up = false;
            push_reset(s);
            continue;
        }
        if (f->hdr.type == KVR_WIRE_GOODBYE) {
            KVR_INFO("%s: upstream said goodbye", s->name);
            set_upstream(s, -1);
            kvr_link_fini(&up);
            have_up = false;
            push_reset(s);
        } else if (f->hdr.type == KVR_WIRE_HEARTBEAT) {
            kvr_credit_ack(up.fd); /* credit.h: the upstream knows we still read */
        } else if (f->hdr.type == KVR_WIRE_RESET) {
            KVR_DEBUG("%s: stage %u dropped its sequences; passing it on", s->name, f->hdr.arg);
            raise_notice(s, f->hdr.arg, f->hdr.batch_id);
        } else if (f->hdr.type == KVR_WIRE_BATCH) {
            if (!enqueue_batch(s, f))
                break;
        }
    }
    if (have_up) {
        set_upstream(s, -1);
        kvr_link_fini(&up);
    }
    return NULL;
}

/* ---- tx: the downstream link ---------------------------------------------------------- */

static const char *downstream_addr(const struct stage *s)
{
    return s->is_tail ? s->plan->bridge_addr : s->plan->stages[s->index + 1].addr;
}

static bool connect_downstream(struct stage *s, struct kvr_link *link, int *backoff_ms)
{
    struct kvr_err err = {0};
    int fd;
    const char *addr = downstream_addr(s);
    if (kvr_net_connect(addr, kvr_net_deadline(1000), &fd, &err) == 0) {
        if (kvr_link_init(link, fd, addr, &s->down_limits, KVR_LINK_SEND, &err) == 0 &&
            kvr_link_handshake_client(link, s->plan, KVR_AUTH_ROLE_STAGE, s->index,
                                      HANDSHAKE_MS, &err) == 0) {
            KVR_INFO("%s: downstream %s connected", s->name, addr);
            *backoff_ms = BACKOFF_MIN_MS;
            return true;
        }
        KVR_WARN("%s: downstream %s: %s", s->name, addr, err.msg);
        kvr_link_fini(link);
    } else if (*backoff_ms >= BACKOFF_MAX_MS) {
        KVR_DEBUG("%s: cannot reach downstream %s: %s", s->name, addr, err.msg);
    }
    kvr_sleep_ns((uint64_t)*backoff_ms * 1000000ull);
    *backoff_ms = *backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : *backoff_ms * 2;
    return false;
}

/* Send a pending RESET (see raise_notice). Without a downstream it is dropped: the next
 * downstream link starts with a reset of its own. Returns false if the link broke. */
static bool send_notice(struct stage *s, struct kvr_link *down, bool have_down)
{
    uint32_t stage;
    uint64_t batch_id;
    if (!take_notice(s, &stage, &batch_id) || !have_down)
        return true;
    struct kvr_err err = {0};
    if (kvr_link_send_reset(down, stage, batch_id, kvr_net_deadline(1000), &err)) {
        KVR_WARN("%s: downstream lost: %s", s->name, err.msg);
        return false;
    }
    return true;
}

/* Close the downstream link (caller holds down_lock); tx reconnects. */
static void drop_down(struct stage *s)
{
    kvr_link_fini(&s->down);
    s->have_down = false;
    s->down_gen++;
}

/* Send one frame downstream (caller holds down_lock and has taken a credit). */
static void send_frame(struct stage *s, const struct out_slot *o)
{
    struct kvr_err err = {0};
    if (kvr_link_send(&s->down, &o->msg, 0, &err)) {
        KVR_WARN("%s: downstream lost, batch %llu dropped: %s", s->name,
                 (unsigned long long)o->msg.batch_id, err.msg);
        drop_down(s);
    }
    s->last_send = kvr_now_ns();
}

/* Idle tx: collect credits early and notice at once a downstream that closed the link (it
 * restarted, or took another upstream), instead of at the second heartbeat that fails to
 * send; keep the link alive with heartbeats. Caller holds down_lock. */
static void tx_idle(struct stage *s, uint64_t *n_heartbeats)
{
    if (!s->have_down)
        return;
    int rc = kvr_credit_take(s->down.fd, &s->down_credits, 0);
    if (rc) {
        KVR_WARN("%s: downstream lost: %s", s->name, kvr_strerror(rc));
        drop_down(s);
        return;
    }
    if (kvr_now_ns() - s->last_send > HEARTBEAT_MS * 1000000ull) {
        struct kvr_err err = {0};
        if (kvr_link_send_heartbeat(&s->down, ++*n_heartbeats, kvr_net_deadline(1000), &err)) {
            KVR_WARN("%s: downstream lost: %s", s->name, err.msg);
            drop_down(s);
        }
        s->last_send = kvr_now_ns();
    }
}

static void *tx_main(void *arg)
{
    struct stage *s = arg;
    int backoff_ms = BACKOFF_MIN_MS;
    uint64_t n_heartbeats = 0;
    while (!*s->stop) {
        pthread_mutex_lock(&s->down_lock);
        bool have_down = s->have_down;
        pthread_mutex_unlock(&s->down_lock);
        if (!have_down) {
            struct kvr_link fresh = {.fd = -1};
            if (connect_downstream(s, &fresh, &backoff_ms)) {
                pthread_mutex_lock(&s->down_lock);
                s->down = fresh;
                s->have_down = true;
                s->down_credits = 0;
                s->last_send = kvr_now_ns();
                pthread_mutex_unlock(&s->down_lock);
            }
        }
        int id = queue_pop_ready(&s->out_q, POLL_MS);
        pthread_mutex_lock(&s->down_lock);
        if (!send_notice(s, &s->down, s->have_down))
            drop_down(s);
        if (id < 0) {
            tx_idle(s, &n_heartbeats);
            pthread_mutex_unlock(&s->down_lock);
            continue;
        }
        /* Wait for the downstream to have room (credit.h): this wait is what the compute
         * thread sees as "blocked" once both output slots are taken. The lock is let go
         * while waiting, so credits are read under it but waited for outside it. */
        while (s->have_down && s->down_credits == 0 && !*s->stop) {
            int fd = s->down.fd;
            uint64_t gen = s->down_gen;
            pthread_mutex_unlock(&s->down_lock);
            struct pollfd pfd = {fd, POLLIN, 0};
            (void)poll(&pfd, 1, POLL_MS);
            pthread_mutex_lock(&s->down_lock);
            if (s->have_down && s->down_gen == gen) {
                int rc = kvr_credit_take(fd, &s->down_credits, 0);
                if (rc) {
                    KVR_WARN("%s: downstream lost while waiting for room: %s", s->name,
                             kvr_strerror(rc));
                    drop_down(s);
                }
            }
        }
        struct out_slot *o = &s->out[id];
        if (s->have_down && s->down_credits > 0) {
            s->down_credits--;
            send_frame(s, o);
        } else if (s->have_down || s->down_gen > 0) { /* it was up: a link went down */
            KVR_WARN("%s: no downstream, batch %llu dropped", s->name,
                     (unsigned long long)o->msg.batch_id);
        } else {
            /* Never connected yet: the ring is still forming, and the bridge's probe goes
             * again once it is whole. */
            KVR_INFO("%s: downstream not connected yet, batch %llu dropped", s->name,
                     (unsigned long long)o->msg.batch_id);
        }
        s->pending--;
        pthread_mutex_unlock(&s->down_lock);
        queue_give_free(&s->out_q, (uint32_t)id);
    }
    pthread_mutex_lock(&s->down_lock);
    if (s->have_down) {
        struct kvr_err err = {0};
        kvr_link_send_goodbye(&s->down, KVR_WIRE_GOODBYE_SHUTDOWN, kvr_net_deadline(200), &err);
        drop_down(s);
    }
    pthread_mutex_unlock(&s->down_lock);
    return NULL;
}

/* A finished batch goes downstream: straight from the compute thread when nothing is
 * queued ahead of it and the downstream has room (no thread to wake), else through tx, in
 * order. */
static void hand_off(struct stage *s, uint32_t out_id)
{
    pthread_mutex_lock(&s->down_lock);
    if (s->have_down && s->pending == 0) {
        int rc = KVR_OK;
        if (!send_notice(s, &s->down, true)) {
            drop_down(s); /* send_notice said why; tx reconnects */
        } else if (s->down_credits == 0 &&
                   (rc = kvr_credit_take(s->down.fd, &s->down_credits, 0)) != KVR_OK) {
            KVR_WARN("%s: downstream lost: %s", s->name, kvr_strerror(rc));
            drop_down(s);
        }
    }
    if (s->have_down && s->pending == 0 && s->down_credits > 0) {
        s->down_credits--;
        send_frame(s, &s->out[out_id]);
        pthread_mutex_unlock(&s->down_lock);
        queue_give_free(&s->out_q, out_id);
        return;
    }
    s->pending++;
    pthread_mutex_unlock(&s->down_lock);
    queue_push_ready(&s->out_q, out_id);
}

/* ---- compute -------------------------------------------------------------------------- */

static void sampling_params(const struct kvr_wire_sampling *w, struct kvr_sample_params *p)
{
    kvr_sample_params_default(p);
    p->temperature = w->temperature;
    p->top_k = w->top_k;
    p->top_p = w->top_p;
    p->min_p = w->min_p;
    p->repeat_penalty = w->repeat_penalty;
    p->frequency_penalty = w->frequency_penalty;
    p->presence_penalty = w->presence_penalty;
    p->repeat_last_n = w->repeat_last_n;
    p->seed = w->seed;
}

static void close_seq(struct stage *s, uint32_t seq)
{
    kvr_engine_seq_free(s->engine, seq);
    if (s->is_tail && s->open[seq]) {
        kvr_sampler_fini(&s->samplers[seq]);
        s->open[seq] = false;
    }
}

static void reset_all(struct stage *s)
{
    for (uint32_t q = 0; q < s->plan->max_seqs; q++)
        close_seq(s, q);
}

/* Tail: put a re-opened sequence's sampler back where it was (wire.h, REPLAY): the draws
 * its earlier samples made, then its recent tokens into the penalty window. */
static void replay_seq(struct stage *s, const struct kvr_wire_ctrl *c)
{
    if (!s->is_tail)
        return;
    if (!s->open[c->seq]) {
        KVR_ERROR("%s: REPLAY for sequence %u, which is not open", s->name, c->seq);
        return;
    }
    struct kvr_sampler *sm = &s->samplers[c->seq];
    for (uint32_t k = 0; k < c->replay.n_draws; k++)
        (void)kvr_sampler_uniform(sm);
    for (uint32_t k = 0; k < c->replay.n_ids; k++)
        kvr_sampler_accept(sm, c->replay.ids[k]);
}

/* Control records come before the batch's rows: an OPEN starts a sequence afresh (its slot
 * may hold a finished one), FREE and CANCEL release it everywhere, REPLAY restores the
 * sampler of one just re-opened. */
static void apply_control(struct stage *s, const struct in_slot *in)
{
    for (uint32_t i = 0; i < in->n_ctrl; i++) {
        const struct kvr_wire_ctrl *c = &in->ctrl[i];
        if (c->type == KVR_WIRE_CTRL_REPLAY) {
            replay_seq(s, c);
            continue;
        }
        close_seq(s, c->seq);
        if (c->type == KVR_WIRE_CTRL_OPEN && s->is_tail) {
            struct kvr_sample_params p;
            sampling_params(&c->sampling, &p);
            struct kvr_err err = {0};
            if (kvr_sampler_init(&s->samplers[c->seq], &p, &err)) {
                /* The codec checked the ranges, so this is a disagreement between codec and
                 * sampler; the sequence stays closed and its first result fails loudly. */
                KVR_ERROR("%s: sequence %u: %s", s->name, c->seq, err.msg);
                continue;
            }
            s->open[c->seq] = true;
            s->want_logprobs[c->seq] = (c->flags & KVR_WIRE_OPEN_LOGPROBS) != 0;
        }
    }
}

/* Tail: sample every segment that wants a token. */
static int sample_results(struct stage *s, const struct in_slot *in, struct out_slot *o,
                          struct kvr_err *err)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < in->n_segs; i++) {
        const struct kvr_seg *seg = &in->segs[i];
        if (!(seg->flags & KVR_SEG_WANTS_TOKEN))
            continue;
        if (!s->open[seg->seq])
            return kvr_err_set(err, KVR_EPROTO, "batch %llu: sequence %u wants a token but "
                               "was never opened", (unsigned long long)in->batch_id, seg->seq);
        float *logits = s->logits + (size_t)n * s->hp.n_vocab;
        float logprob = 0.0f;
        bool lp = s->want_logprobs[seg->seq];
        int32_t tok = kvr_sampler_sample(&s->samplers[seg->seq], logits, (int32_t)s->hp.n_vocab,
                                         s->scratch, lp ? &logprob : NULL);
        kvr_sampler_accept(&s->samplers[seg->seq], tok);
        o->results[n] = (struct kvr_wire_result){
            .seq = seg->seq, .token = tok, .logprob = lp ? logprob : 0.0f,
            .flags = (lp ? KVR_WIRE_RESULT_LOGPROB : 0) |
                     (s->tok && kvr_tok_is_eog(s->tok, tok) ? KVR_WIRE_RESULT_EOG : 0)};
        n++;
    }
    o->msg.results = o->results;
    o->msg.n_results = n;
    o->msg.payload = KVR_WIRE_PAYLOAD_RESULTS;
    o->msg.payload_data = NULL;
    o->msg.payload_bytes = 0;
    return KVR_OK;
}

static int compute_batch(struct stage *s, const struct in_slot *in, struct out_slot *o,
                         struct kvr_err *err)
{
    apply_control(s, in);
    memset(&o->msg, 0, sizeof o->msg);
    memcpy(o->ctrl, in->ctrl, in->n_ctrl * sizeof *in->ctrl);
    memcpy(o->segs, in->segs, in->n_segs * sizeof *in->segs);
    memcpy(o->timings, in->timings, in->n_timings * sizeof *in->timings);
    o->msg.type = s->is_tail ? KVR_WIRE_RESULT : KVR_WIRE_BATCH;
    o->msg.batch_id = in->batch_id;
    o->msg.ctrl = o->ctrl;
    o->msg.n_ctrl = in->n_ctrl;
    o->msg.segs = o->segs;
    o->msg.n_segs = in->n_segs;
    o->msg.timings = o->timings;
    o->msg.n_timings = in->n_timings;
    if (in->n_segs == 0) { /* a control-only batch */
        o->msg.payload = s->is_tail ? KVR_WIRE_PAYLOAD_RESULTS : s->rows_payload;
        return KVR_OK;
    }
    float *out = s->is_tail ? s->logits : o->rows;
    int rc = kvr_engine_forward(s->engine, in->segs, in->n_segs, in->tokens, in->rows, out, err);
    if (rc)
        return rc;
    if (s->is_tail)
        return sample_results(s, in, o, err);
    size_t n = (size_t)in->n_rows * s->hp.n_embd;
    o->msg.payload = s->rows_payload;
    if (s->rows_payload == KVR_WIRE_PAYLOAD_F32) {
        o->msg.payload_data = o->rows;
        o->msg.payload_bytes = n * sizeof(float);
    } else {
        kvr_wire_rows_from_f32(s->rows_payload, o->rows, n, o->wire_rows);
        o->msg.payload_data = o->wire_rows;
        o->msg.payload_bytes = n * 2;
    }
    return KVR_OK;
}

/* Free an input slot and, if its frame came over the current upstream link, give that link
 * the credit back. */
static void release_input(struct stage *s, const struct in_slot *in, uint32_t id)
{
    uint64_t gen = in->gen;
    queue_give_free(&s->in_q, id);
    pthread_mutex_lock(&s->up_lock);
    if (s->up_fd >= 0 && gen == s->up_gen && kvr_credit_grant(s->up_fd, 1))
        KVR_DEBUG("%s: credit not delivered (upstream gone)", s->name);
    pthread_mutex_unlock(&s->up_lock);
}

static void compute_loop(struct stage *s)
{
    uint64_t idle_since = kvr_now_ns();
    while (!*s->stop) {
        int in_id = queue_pop_ready(&s->in_q, POLL_MS);
        if (in_id < 0)
            continue;
        uint64_t t_arrived = kvr_now_ns();
        struct in_slot *in = &s->in[in_id];
        if (in->kind == IN_RESET) {
            uint32_t used, total;
            kvr_engine_kv_usage(s->engine, &used, &total);
            if (used > 0)
                KVR_INFO("%s: upstream changed: dropping every sequence", s->name);
            else
                KVR_DEBUG("%s: upstream changed; no sequence to drop", s->name);
            reset_all(s);
            raise_notice(s, s->index, KVR_WIRE_RESET_LINK);
            queue_give_free(&s->in_q, (uint32_t)in_id);
            idle_since = kvr_now_ns();
            continue;
        }
        int out_id;
        while ((out_id = queue_take_free(&s->out_q, POLL_MS)) < 0 && !*s->stop) {
        }
        if (out_id < 0)
            break;
        uint64_t t_start = kvr_now_ns();
        struct out_slot *o = &s->out[out_id];
        struct kvr_err err = {0};
        int rc = compute_batch(s, in, o, &err);
        uint64_t t_done = kvr_now_ns();
        if (rc) {
            /* The bridge and every stage decide membership from the same plan, so a batch
             * this stage cannot run means the ring's state diverged (typically: this stage
             * lost its sequences with its upstream link, and the bridge did not know yet).
             * The batch is not forwarded; a RESET naming it tells the bridge, which holds
             * and re-prefills its sequences unless it had already given up on the batch. */
            KVR_ERROR("%s: batch %llu dropped: %s", s->name, (unsigned long long)in->batch_id,
                      err.msg);
            reset_all(s);
            raise_notice(s, s->index, in->batch_id);
            release_input(s, in, (uint32_t)in_id);
            queue_give_free(&s->out_q, (uint32_t)out_id);
            idle_since = t_done;
            continue;
        } else {
            struct kvr_wire_timing *t = &o->timings[o->msg.n_timings++];
            t->stage = s->index;
            t->starved_ns = t_arrived > idle_since ? t_arrived - idle_since : 0;
            t->blocked_ns = t_start - t_arrived;
            t->held_ns = t_done - t_start;
        }
        /* The finished batch goes first: the downstream is waiting for it, while the
         * upstream still has a credit in hand unless this stage's input queue is full. A
         * wake-up or a system call before the send is where a stage whose CPU quota ran out
         * gets throttled, holding the batch. */
        hand_off(s, (uint32_t)out_id);
        release_input(s, in, (uint32_t)in_id);
        idle_since = t_done;
    }
}

/* ---- start-up and shutdown ------------------------------------------------------------ */

static void stage_fini(struct stage *s)
{
    if (s->rx_started)
        pthread_join(s->rx_thread, NULL);
    if (s->tx_started)
        pthread_join(s->tx_thread, NULL);
    if (s->listen_fd >= 0)
        close(s->listen_fd);
    free_slots(s);
    pthread_mutex_destroy(&s->up_lock);
    pthread_mutex_destroy(&s->notice_lock);
    pthread_mutex_destroy(&s->down_lock);
    if (s->samplers) {
        for (uint32_t q = 0; q < s->plan->max_seqs; q++)
            if (s->open[q])
                kvr_sampler_fini(&s->samplers[q]);
    }
    kvr_free(s->samplers);
    kvr_free(s->open);
    kvr_free(s->want_logprobs);
    kvr_free(s->logits);
    kvr_sample_scratch_destroy(s->scratch);
    kvr_tok_destroy(s->tok);
    kvr_engine_destroy(s->engine);
    kvr_gguf_close(s->gguf);
}

static int stage_init(struct stage *s, struct kvr_err *err)
{
    const struct kvr_plan *p = s->plan;
    char path[KVR_PLAN_PATH_BYTES];
    int rc;
    if ((rc = kvr_plan_path(p, p->model_path, path, sizeof path, err)) ||
        (rc = kvr_gguf_open(&s->gguf, path, err)))
        return rc;
    if (p->model_fingerprint &&
        (rc = kvr_plan_check_fingerprint(p, kvr_gguf_fingerprint(s->gguf), err)))
        return rc;
    if ((rc = kvr_hparams_read(&s->hp, s->gguf, err)) ||
        (rc = kvr_plan_validate(p, s->hp.n_layer, err)))
        return rc;
    const struct kvr_plan_stage *st = &p->stages[s->index];
    uint32_t threads = st->n_threads ? st->n_threads : p->n_threads ? p->n_threads : 1;
    struct kvr_engine_config cfg = {
        .first_layer = st->first_layer, .last_layer = st->last_layer,
        .max_rows = p->row_width, .max_seqs = p->max_seqs, .n_ctx = p->n_ctx,
        .kv_block_tokens = p->kv_block_tokens, .kv_n_blocks = p->kv_blocks,
        .n_threads = threads};
    if ((rc = kvr_engine_create(&s->engine, s->gguf, &cfg, err)))
        return rc;
    s->rows_payload = kvr_wire_payload_of_dtype(p->wire_dtype);
    int down = s->is_tail ? KVR_WIRE_RECV_BRIDGE : (int)s->index + 1;
    if ((rc = kvr_wire_limits_init(&s->up_limits, p, s->hp.n_embd, s->hp.n_vocab,
                                   (int)s->index, err)) ||
        (rc = kvr_wire_limits_init(&s->down_limits, p, s->hp.n_embd, s->hp.n_vocab, down,
                                   err)) ||
        (rc = alloc_slots(s, err)))
        return rc;
    if (s->is_tail) {
        s->samplers = kvr_calloc(p->max_seqs, sizeof *s->samplers);
        s->open = kvr_calloc(p->max_seqs, sizeof *s->open);
        s->want_logprobs = kvr_calloc(p->max_seqs, sizeof *s->want_logprobs);
        size_t n_logits;
        if (!s->samplers || !s->open || !s->want_logprobs ||
            !kvr_mul_size((size_t)p->row_width * s->hp.n_vocab, sizeof(float), &n_logits) ||
            !(s->logits = kvr_aligned_alloc(64, n_logits)) ||
            kvr_sample_scratch_create(&s->scratch, (int32_t)s->hp.n_vocab))
            return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory for the tail");
        struct kvr_err tok_err = {0};
        if (kvr_tok_create(&s->tok, s->gguf, &tok_err))
            KVR_WARN("%s: no usable vocabulary (%s): end-of-generation is not flagged",
                     s->name, tok_err.msg);
    }
    if ((rc = kvr_net_listen(p->stages[s->index].addr, 16, &s->listen_fd, NULL, err)))
        return rc;
    KVR_INFO("%s: layers %u-%u of %u, %u threads, listening on %s", s->name, st->first_layer,
             st->last_layer, s->hp.n_layer, threads, p->stages[s->index].addr);
    return KVR_OK;
}

int kvr_stage_run(const struct kvr_plan *plan, const struct kvr_stage_options *opt,
                  atomic_int *stop, struct kvr_err *err)
{
    if (opt->index >= plan->n_stages)
        return kvr_err_set(err, KVR_EINVAL, "stage index %u: the plan has %u stages",
                           opt->index, plan->n_stages);
    struct stage *s = kvr_calloc(1, sizeof *s);
    if (!s)
        return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory");
    struct kvr_plan *local = kvr_malloc(sizeof *local);
    if (!local) {
        kvr_free(s);
        return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory");
    }
    *local = *plan;
    if (opt->n_threads)
        local->stages[opt->index].n_threads = opt->n_threads;
    s->plan = local;
    s->index = opt->index;
    s->is_head = opt->index == 0;
    s->is_tail = opt->index + 1 == plan->n_stages;
    s->stop = stop;
    s->listen_fd = -1;
    s->up_fd = -1;
    pthread_mutex_init(&s->up_lock, NULL);
    pthread_mutex_init(&s->notice_lock, NULL);
    pthread_mutex_init(&s->down_lock, NULL);
    s->down.fd = -1;
    snprintf(s->name, sizeof s->name, "stage %u", opt->index);
    int rc = stage_init(s, err);
    if (rc == 0) {
        s->rx_started = pthread_create(&s->rx_thread, NULL, rx_main, s) == 0;
        s->tx_started = pthread_create(&s->tx_thread, NULL, tx_main, s) == 0;
        if (!s->rx_started || !s->tx_started) {
            rc = kvr_err_set(err, KVR_ENOMEM, "stage: cannot start threads");
            *stop = 1;
        } else {
            compute_loop(s);
        }
    }
    stage_fini(s);
    kvr_plan_wipe(local);
    kvr_free(local);
    kvr_free(s);
    return rc;
}
