/* experts.c - expert agents and the owning stage's dispatcher (see experts.h). */
#include "ring/experts.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/ev.h"
#include "core/log.h"
#include "core/pool.h"
#include "ring/accept.h"
#include "ring/auth.h"
#include "ring/dial.h"
#include "ring/net.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define HANDSHAKE_MS 2000
#define SEND_MS 5000
#define BACKOFF_MAX_MS 500
#define MAX_CONNS 8 /* stages one agent serves at once (the event loop's fds bound it) */

/* ---- Shared ---------------------------------------------------------------------------- */

static uint64_t expert_body_max(const struct kvr_plan *p, const struct kvr_hparams *hp)
{
    uint64_t r = p->row_width, k = hp->moe.n_used;
    return KVR_EXPERTS_HEAD_BYTES + r * k * KVR_EXPERTS_ROUTE_BYTES + r * hp->n_embd * 4ull;
}

static uint64_t result_body_max(const struct kvr_plan *p, const struct kvr_hparams *hp)
{
    return KVR_EXPERTS_RESULT_HEAD + (uint64_t)p->row_width * hp->moe.n_used * hp->n_embd * 4ull;
}

int kvr_experts_limits(struct kvr_wire_limits *lim, const struct kvr_plan *plan,
                       const struct kvr_hparams *hp, bool at_agent, struct kvr_err *err)
{
    memset(lim, 0, sizeof *lim);
    uint64_t a = expert_body_max(plan, hp), b = result_body_max(plan, hp);
    uint64_t total = KVR_WIRE_HEADER_BYTES + (a > b ? a : b);
    if (total > KVR_WIRE_MAX_FRAME_BYTES)
        return kvr_err_set(err, KVR_ERANGE,
                           "experts: the largest expert frame is %" PRIu64 " bytes (row_width %u "
                           "x %u experts per row x n_embd %u), beyond the %u-byte frame bound: "
                           "lower row_width",
                           total, plan->row_width, hp->moe.n_used, hp->n_embd,
                           KVR_WIRE_MAX_FRAME_BYTES);
    /* One buffer size for both directions: a link's scratch and sealed buffer fit both. */
    lim->max_frame_bytes = (uint32_t)total;
    lim->max_rows = plan->row_width;
    lim->n_embd = hp->n_embd;
    lim->rows_payload = KVR_WIRE_PAYLOAD_F32;
    lim->batch_payload = KVR_WIRE_PAYLOAD_COUNT;
    lim->accept_types = 1u << KVR_WIRE_HEARTBEAT | 1u << KVR_WIRE_GOODBYE |
                        1u << (at_agent ? KVR_WIRE_EXPERT : KVR_WIRE_EXPERT_RESULT);
    return KVR_OK;
}

int kvr_experts_check_model(const struct kvr_plan *plan, const struct kvr_hparams *hp,
                            struct kvr_err *err)
{
    if (plan->n_agents && hp->moe.n_expert == 0)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: it places experts on %u agents, but the model has no "
                           "mixture-of-experts layers",
                           plan->n_agents);
    for (uint32_t j = 0; j < plan->n_agents; j++)
        for (uint32_t h = 0; h < plan->agents[j].n_holds; h++) {
            const struct kvr_plan_hold *hd = &plan->agents[j].holds[h];
            if (hd->last_layer >= hp->n_layer)
                return kvr_err_set(err, KVR_EINVAL,
                                   "plan: experts[%u].holds[%u] names layer %u; the model has "
                                   "%u layers",
                                   j, h, hd->last_layer, hp->n_layer);
            if (hd->last_expert >= hp->moe.n_expert)
                return kvr_err_set(err, KVR_EINVAL,
                                   "plan: experts[%u].holds[%u] names expert %u; the model's "
                                   "layers have %u experts",
                                   j, h, hd->last_expert, hp->moe.n_expert);
        }
    return KVR_OK;
}

#define PROTO(...) kvr_err_set(err, KVR_EPROTO, __VA_ARGS__)

/* ---- The agent ------------------------------------------------------------------------- */

struct agent;

struct conn {
    struct agent *agent; /* its owner */
    bool used;
    struct kvr_link link;
};

struct agent {
    const struct kvr_plan *plan;
    const struct kvr_plan_agent *me;
    uint32_t index;
    atomic_int *stop;
    char name[48];
    struct kvr_gguf *gguf;
    struct kvr_hparams hp;
    struct kvr_moe_layer *layers; /* [n_layer]; only held layers are viewed */
    uint8_t *held;                /* [n_layer x n_expert] */
    struct kvr_moe_work *work;
    struct kvr_pool *pool;
    struct kvr_wire_limits limits; /* what an agent accepts */
    struct kvr_ev *ev;
    int listen_fd;
    struct conn conns[MAX_CONNS];
    struct kvr_accept acc; /* stages in their handshakes (accept.h) */
    /* Per frame (sized for row_width rows). */
    uint32_t *ids;
    float *weights;
    float *pairs;   /* [row_width x n_used x n_embd] kvr_moe_experts output */
    uint8_t *reply; /* the result body */
    uint64_t frames, n_pairs;
    uint64_t idle_since_ns;   /* when the agent's last answer went out (starved time starts) */
    uint64_t last_blocked_ns; /* sending that answer */
};

static _Atomic(struct kvr_ev *) running_agent_ev;

void kvr_expert_agent_signal_stop(void)
{
    struct kvr_ev *ev = atomic_load(&running_agent_ev);
    if (ev)
        kvr_ev_wake(ev);
}

static void conn_drop(struct agent *a, struct conn *c)
{
    kvr_ev_unwatch(a->ev, c->link.fd);
    kvr_link_fini(&c->link);
    c->used = false;
}

/* Check an EXPERT body and compute it into a->reply; *reply_bytes its length. */
static int serve_frame(struct agent *a, const struct kvr_wire_frame *f, size_t *reply_bytes,
                       struct kvr_err *err)
{
    const uint8_t *b = f->payload;
    size_t len = f->hdr.payload_bytes;
    const struct kvr_hparams *hp = &a->hp;
    uint32_t k = hp->moe.n_used, E = hp->moe.n_expert, n_embd = hp->n_embd;
    if (len < KVR_EXPERTS_HEAD_BYTES)
        return PROTO("EXPERT body of %zu bytes is shorter than its %d-byte head", len,
                     KVR_EXPERTS_HEAD_BYTES);
    uint32_t layer = kvr_ld32(b), n_used = kvr_ld16(b + 4), kind = kvr_ld16(b + 6);
    uint32_t n_rows = kvr_ld32(b + 8);
    if (layer >= hp->n_layer || !kvr_plan_agent_holds_layer(a->me, layer))
        return PROTO("EXPERT frame for layer %u, of which this agent holds no expert", layer);
    if (n_used != k || kind != 0 || kvr_ld32(b + 12) != 0)
        return PROTO("EXPERT frame with n_used %u (the model's is %u), row kind %u (0 only) "
                     "or a nonzero reserved field",
                     n_used, k, kind);
    if (n_rows == 0 || n_rows > a->plan->row_width)
        return PROTO("EXPERT frame with %u rows; 1 to row_width %u", n_rows, a->plan->row_width);
    uint64_t want = KVR_EXPERTS_HEAD_BYTES + (uint64_t)n_rows * k * KVR_EXPERTS_ROUTE_BYTES +
                    (uint64_t)n_rows * n_embd * 4;
    if (len != want)
        return PROTO("EXPERT body is %zu bytes; %u rows need %" PRIu64, len, n_rows, want);
    const uint8_t *held = a->held + (size_t)layer * E;
    const uint8_t *rt = b + KVR_EXPERTS_HEAD_BYTES;
    uint32_t mine = 0;
    for (uint32_t r = 0; r < n_rows; r++) {
        uint32_t row_mine = 0;
        for (uint32_t s = 0; s < k; s++) {
            const uint8_t *q = rt + ((size_t)r * k + s) * KVR_EXPERTS_ROUTE_BYTES;
            uint32_t e = kvr_ld16(q);
            float wgt = kvr_ldf32(q + 4);
            if (e >= E || kvr_ld16(q + 2) != 0 || !isfinite(wgt))
                return PROTO("EXPERT row %u slot %u: expert %u (of %u), weight %g", r, s, e, E,
                             (double)wgt);
            a->ids[(size_t)r * k + s] = e;
            a->weights[(size_t)r * k + s] = wgt;
            row_mine += held[e] != 0;
        }
        if (!row_mine)
            return PROTO("EXPERT row %u uses no expert this agent holds", r);
        mine += row_mine;
    }
    /* The rows sit 16-byte aligned in the link's body buffer (head and routing are whole
     * multiples of 8; the body starts 64-byte aligned): read them in place when 4-aligned. */
    const float *x = (const float *)(const void *)(rt + (size_t)n_rows * k * 8);
    kvr_moe_experts(a->work, &a->layers[layer], x, n_rows, a->ids, a->weights, held, a->pairs,
                    a->pool);
    uint8_t *o = a->reply;
    kvr_st32(o, layer);
    kvr_st32(o + 4, mine);
    uint8_t *dst = o + KVR_EXPERTS_RESULT_HEAD;
    for (uint32_t p = 0; p < n_rows * k; p++)
        if (held[a->ids[p]]) {
            memcpy(dst, a->pairs + (size_t)p * n_embd, (size_t)n_embd * 4);
            dst += (size_t)n_embd * 4;
        }
    *reply_bytes = (size_t)(dst - o);
    a->n_pairs += mine;
    return KVR_OK;
}

static void on_conn(struct kvr_ev *ev, int fd, uint32_t events, void *arg);

static int begin_accept(void *ctx, struct kvr_link *link, struct kvr_link_hs *hs,
                        struct kvr_err *err)
{
    struct agent *a = ctx;
    struct kvr_auth_id self = {KVR_AUTH_ROLE_AGENT, a->index};
    struct kvr_auth_id any = {KVR_AUTH_ROLE_STAGE, KVR_AUTH_INDEX_ANY};
    return kvr_link_hs_begin_ids(link, hs, a->plan, self, any, false, err);
}

/* A stage passed its handshake (accept.h, in steps inside the loop: a peer that connects
 * and says nothing delays no frame): its link moves to a free connection slot. */
static void accepted(void *ctx, struct kvr_accept_slot *s)
{
    struct agent *a = ctx;
    struct conn *c = NULL;
    for (uint32_t i = 0; i < MAX_CONNS && !c; i++)
        if (!a->conns[i].used)
            c = &a->conns[i];
    struct kvr_link fresh;
    kvr_accept_take(&a->acc, s, &fresh);
    if (!c) {
        KVR_WARN("%s: refused %s: already serving %d links", a->name, fresh.peer, MAX_CONNS);
        kvr_link_fini(&fresh);
        return;
    }
    c->link = fresh;
    if (kvr_ev_watch(a->ev, c->link.fd, KVR_EV_READ, on_conn, c)) {
        kvr_link_fini(&c->link);
        return;
    }
    c->agent = a;
    c->used = true;
    KVR_INFO("%s: %s linked", a->name, c->link.peer);
    on_conn(a->ev, c->link.fd, KVR_EV_READ, c); /* a frame may have come with the handshake */
}

static void on_conn(struct kvr_ev *ev, int fd, uint32_t events, void *arg)
{
    (void)ev;
    (void)fd;
    (void)events;
    struct conn *c = arg;
    struct agent *a = c->agent;
    for (;;) {
        const struct kvr_wire_frame *f;
        struct kvr_err err = {0};
        int rc = kvr_link_recv(&c->link, KVR_NET_NOW, &f, &err);
        if (rc == KVR_ETIMEDOUT)
            return;
        if (rc) {
            if (rc == KVR_ECLOSED)
                KVR_INFO("%s: %s closed the link", a->name, c->link.peer);
            else
                KVR_WARN("%s: link %s dropped: %s", a->name, c->link.peer, err.msg);
            conn_drop(a, c);
            return;
        }
        if (f->hdr.type == KVR_WIRE_GOODBYE) {
            KVR_INFO("%s: %s said goodbye", a->name, c->link.peer);
            conn_drop(a, c);
            return;
        }
        if (f->hdr.type != KVR_WIRE_EXPERT)
            continue; /* a heartbeat */
        uint64_t t0 = kvr_now_ns();
        size_t n = 0;
        if ((rc = serve_frame(a, f, &n, &err))) {
            KVR_WARN("%s: link %s dropped: %s", a->name, c->link.peer, err.msg);
            conn_drop(a, c);
            return;
        }
        uint64_t t1 = kvr_now_ns();
        kvr_st64(a->reply + 8, t1 - t0);
        kvr_st64(a->reply + 16, t0 > a->idle_since_ns ? t0 - a->idle_since_ns : 0);
        kvr_st64(a->reply + 24, a->last_blocked_ns);
        struct kvr_wire_msg m = {.type = KVR_WIRE_EXPERT_RESULT,
                                 .batch_id = f->hdr.batch_id,
                                 .payload = KVR_WIRE_PAYLOAD_EXPERT,
                                 .payload_data = a->reply,
                                 .payload_bytes = n};
        if ((rc = kvr_link_send(&c->link, &m, kvr_net_deadline(SEND_MS), &err))) {
            KVR_WARN("%s: link %s dropped: %s", a->name, c->link.peer, err.msg);
            conn_drop(a, c);
            return;
        }
        a->idle_since_ns = kvr_now_ns();
        a->last_blocked_ns = a->idle_since_ns - t1;
        a->frames++;
    }
}

static void on_agent_wake(struct kvr_ev *ev, void *arg)
{
    struct agent *a = arg;
    if (atomic_load(a->stop))
        kvr_ev_stop(ev);
}

static void agent_fini(struct agent *a)
{
    kvr_accept_fini(&a->acc);
    for (uint32_t i = 0; i < MAX_CONNS; i++)
        if (a->conns[i].used) {
            struct kvr_err err = {0};
            kvr_link_send_goodbye(&a->conns[i].link, KVR_WIRE_GOODBYE_SHUTDOWN,
                                  kvr_net_deadline(200), &err);
            conn_drop(a, &a->conns[i]);
        }
    if (a->listen_fd >= 0)
        close(a->listen_fd);
    kvr_ev_destroy(a->ev);
    kvr_pool_destroy(a->pool);
    kvr_moe_work_destroy(a->work);
    kvr_free(a->layers);
    kvr_free(a->held);
    kvr_free(a->ids);
    kvr_free(a->weights);
    kvr_free(a->pairs);
    kvr_free(a->reply);
    kvr_gguf_close(a->gguf);
}

static int agent_init(struct agent *a, struct kvr_err *err)
{
    const struct kvr_plan *p = a->plan;
    char path[KVR_PLAN_PATH_BYTES];
    int rc;
    if ((rc = kvr_plan_path(p, p->model_path, path, sizeof path, err)) ||
        (rc = kvr_gguf_open(&a->gguf, path, err)))
        return rc;
    if (p->model_fingerprint &&
        (rc = kvr_plan_check_fingerprint(p, kvr_gguf_fingerprint(a->gguf), err)))
        return rc;
    if ((rc = kvr_hparams_read(&a->hp, a->gguf, err)) ||
        (rc = kvr_plan_validate(p, a->hp.n_layer, err)) ||
        (rc = kvr_experts_check_model(p, &a->hp, err)) ||
        (rc = kvr_experts_limits(&a->limits, p, &a->hp, true, err)))
        return rc;
    const struct kvr_hparams *hp = &a->hp;
    uint32_t L = hp->n_layer, E = hp->moe.n_expert, k = hp->moe.n_used, R = p->row_width;
    a->layers = kvr_calloc(L, sizeof *a->layers);
    a->held = kvr_calloc((size_t)L * E, 1);
    struct kvr_moe_layer *mine = kvr_calloc(L, sizeof *mine);
    size_t pair_floats = (size_t)R * k * hp->n_embd;
    a->ids = kvr_calloc((size_t)R * k, sizeof *a->ids);
    a->weights = kvr_calloc((size_t)R * k, sizeof *a->weights);
    a->pairs = kvr_calloc(pair_floats, sizeof *a->pairs);
    a->reply = kvr_malloc(KVR_EXPERTS_RESULT_HEAD + pair_floats * 4);
    if (!a->layers || !a->held || !mine || !a->ids || !a->weights || !a->pairs || !a->reply) {
        kvr_free(mine);
        return kvr_err_set(err, KVR_ENOMEM, "%s: out of memory", a->name);
    }
    uint32_t n_mine = 0, n_held = 0;
    for (uint32_t il = 0; il < L; il++) {
        if (!kvr_plan_agent_holds_layer(a->me, il) || !kvr_hparams_layer_moe(hp, il))
            continue; /* a leading dense layer has no experts to hold */
        if ((rc = kvr_moe_layer_view(&a->layers[il], a->gguf, il, hp->n_embd, &hp->moe, err))) {
            kvr_free(mine);
            return rc;
        }
        mine[n_mine++] = a->layers[il];
        for (uint32_t e = 0; e < E; e++) {
            a->held[(size_t)il * E + e] = kvr_plan_agent_holds(a->me, il, e);
            n_held += a->held[(size_t)il * E + e];
        }
    }
    rc = kvr_moe_work_create(&a->work, hp->n_embd, &hp->moe, mine, n_mine, R, err);
    kvr_free(mine);
    if (rc)
        return rc;
    uint32_t threads = a->me->n_threads ? a->me->n_threads : p->n_threads ? p->n_threads : 1;
    if (!(a->pool = kvr_pool_create((int)threads)))
        return kvr_err_set(err, KVR_ENOMEM, "%s: cannot start %u compute threads", a->name,
                           threads);
    if ((rc = kvr_ev_create(&a->ev, err)))
        return rc;
    kvr_ev_on_wake(a->ev, on_agent_wake, a);
    struct kvr_accept_config ac = {.name = a->name,
                                   .limits = &a->limits,
                                   .dirs = KVR_LINK_SEND | KVR_LINK_RECV,
                                   .handshake_ms = HANDSHAKE_MS,
                                   .begin = begin_accept,
                                   .done = accepted,
                                   .ctx = a};
    if ((rc = kvr_net_listen(a->me->addr, 16, &a->listen_fd, NULL, err)) ||
        (rc = kvr_accept_start(&a->acc, a->ev, a->listen_fd, &ac, err)))
        return rc;
    KVR_INFO("%s: %u experts of %u layers (%u threads), listening on %s", a->name, n_held, n_mine,
             threads, a->me->addr);
    return KVR_OK;
}

int kvr_expert_agent_run(const struct kvr_plan *plan, const struct kvr_expert_agent_options *opt,
                         atomic_int *stop, struct kvr_err *err)
{
    if (opt->index >= plan->n_agents)
        return kvr_err_set(err, KVR_EINVAL, "expert agent %u: the plan has %u agents", opt->index,
                           plan->n_agents);
    struct agent *a = kvr_calloc(1, sizeof *a);
    struct kvr_plan *local = kvr_malloc(sizeof *local);
    if (!a || !local) {
        kvr_free(a);
        kvr_free(local);
        return kvr_err_set(err, KVR_ENOMEM, "expert agent: out of memory");
    }
    *local = *plan;
    if (opt->n_threads)
        local->agents[opt->index].n_threads = opt->n_threads;
    a->plan = local;
    a->me = &local->agents[opt->index];
    a->index = opt->index;
    a->stop = stop;
    a->listen_fd = -1;
    snprintf(a->name, sizeof a->name, "expert agent %u", opt->index);
    int rc = agent_init(a, err);
    if (rc == 0) {
        atomic_store(&running_agent_ev, a->ev);
        a->idle_since_ns = kvr_now_ns();
        if (!atomic_load(stop))
            rc = kvr_ev_run(a->ev);
        atomic_store(&running_agent_ev, NULL);
        KVR_INFO("%s: stopping after %" PRIu64 " frames, %" PRIu64 " pairs", a->name, a->frames,
                 a->n_pairs);
        if (rc)
            kvr_err_set(err, rc, "%s: event loop failed", a->name);
    }
    agent_fini(a);
    kvr_plan_wipe(local);
    kvr_free(local);
    kvr_free(a);
    return rc;
}

/* ---- The owning stage's client ------------------------------------------------------- */

struct remote {
    uint32_t j; /* index in the plan's agents */
    struct kvr_dialer *dialer;
    struct kvr_link link;
    bool linked;
    bool sent;                    /* a frame of the layer in hand went out */
    uint64_t req;                 /* the link's request counter (EXPERT batch_id) */
    uint32_t expect;              /* pairs its answer must carry */
    uint8_t *body;                /* the EXPERT body being sent, [expert_body_max] */
    uint32_t *rows;               /* [row_width] batch row of each row sent */
    uint8_t *mask;                /* [n_expert] its experts of the layer in hand */
    char name[64];                /* for the dialler's log lines */
    struct kvr_wire_timing batch; /* since the last take_timings (compute thread) */
    bool batch_used;
    struct kvr_auth_id id;
    /* counters, read by other threads */
    atomic_bool a_linked;
    _Atomic uint64_t frames, pairs, fallback_pairs, lost, held_ns, starved_ns, blocked_ns, wait_ns;
};

struct kvr_experts_client {
    const struct kvr_plan *plan;
    uint32_t stage, first_layer, last_layer;
    uint32_t n_embd, n_used, n_expert;
    struct kvr_wire_limits limits; /* what the stage accepts (EXPERT_RESULT) */
    uint32_t n_remote;
    struct remote *remote; /* [n_remote], in agent order */
    int16_t *owner;        /* [n_local x n_expert]: remote index, or OWNER_SELF */
    uint8_t *local;        /* [n_expert] mask of the pairs computed here */
};

/* The owner of an expert that none of this stage's agents holds: the stage computes it. */
#define OWNER_SELF ((int16_t)-1)

static void remote_lose(struct kvr_experts_client *c, struct remote *r, const char *why)
{
    KVR_WARN("stage %u: expert agent %u lost (%s): its experts are computed here until it "
             "is back",
             c->stage, r->j, why);
    kvr_link_fini(&r->link);
    r->linked = false;
    atomic_store(&r->a_linked, false);
    atomic_fetch_add(&r->lost, 1);
    kvr_dialer_redial(r->dialer);
}

void kvr_experts_client_destroy(struct kvr_experts_client *c)
{
    if (!c)
        return;
    for (uint32_t i = 0; i < c->n_remote; i++) {
        struct remote *r = &c->remote[i];
        if (r->linked) {
            struct kvr_err err = {0};
            kvr_link_send_goodbye(&r->link, KVR_WIRE_GOODBYE_SHUTDOWN, kvr_net_deadline(200), &err);
            kvr_link_fini(&r->link);
        }
        kvr_dialer_stop(r->dialer);
        kvr_free(r->body);
        kvr_free(r->rows);
        kvr_free(r->mask);
    }
    kvr_free(c->remote);
    kvr_free(c->owner);
    kvr_free(c->local);
    kvr_free(c);
}

int kvr_experts_client_create(struct kvr_experts_client **out, const struct kvr_plan *plan,
                              uint32_t stage, const struct kvr_hparams *hp, const char *name,
                              struct kvr_err *err)
{
    *out = NULL;
    const struct kvr_plan_stage *st = &plan->stages[stage];
    uint32_t used[KVR_PLAN_MAX_AGENTS], n = 0;
    for (uint32_t j = 0; j < plan->n_agents; j++) {
        bool any = false;
        for (uint32_t il = st->first_layer; il <= st->last_layer && !any; il++)
            any = kvr_plan_agent_holds_layer(&plan->agents[j], il);
        if (any)
            used[n++] = j;
    }
    if (n == 0)
        return KVR_OK;
    int rc = kvr_experts_check_model(plan, hp, err);
    if (rc)
        return rc;
    struct kvr_experts_client *c = kvr_calloc(1, sizeof *c);
    if (!c)
        return kvr_err_set(err, KVR_ENOMEM, "%s: out of memory", name);
    c->plan = plan;
    c->stage = stage;
    c->first_layer = st->first_layer;
    c->last_layer = st->last_layer;
    c->n_embd = hp->n_embd;
    c->n_used = hp->moe.n_used;
    c->n_expert = hp->moe.n_expert;
    uint32_t n_local = st->last_layer - st->first_layer + 1;
    c->remote = kvr_calloc(n, sizeof *c->remote);
    c->owner = kvr_malloc((size_t)n_local * c->n_expert * sizeof *c->owner);
    c->local = kvr_calloc(c->n_expert, 1);
    if (!c->remote || !c->owner || !c->local) {
        kvr_experts_client_destroy(c);
        return kvr_err_set(err, KVR_ENOMEM, "%s: out of memory", name);
    }
    if ((rc = kvr_experts_limits(&c->limits, plan, hp, false, err))) {
        kvr_experts_client_destroy(c);
        return rc;
    }
    c->n_remote = n;
    for (uint32_t il = 0; il < n_local; il++)
        for (uint32_t e = 0; e < c->n_expert; e++) {
            int16_t o = OWNER_SELF;
            for (uint32_t i = 0; i < n && o == OWNER_SELF; i++)
                if (kvr_plan_agent_holds(&plan->agents[used[i]], st->first_layer + il, e))
                    o = (int16_t)i;
            c->owner[(size_t)il * c->n_expert + e] = o;
        }
    for (uint32_t i = 0; i < n; i++) {
        struct remote *r = &c->remote[i];
        r->j = used[i];
        r->link.fd = -1;
        r->body = kvr_malloc(expert_body_max(plan, hp));
        r->rows = kvr_calloc(plan->row_width, sizeof *r->rows);
        r->mask = kvr_calloc(c->n_expert, 1);
        if (!r->body || !r->rows || !r->mask) {
            kvr_experts_client_destroy(c);
            return kvr_err_set(err, KVR_ENOMEM, "%s: out of memory", name);
        }
        snprintf(r->name, sizeof r->name, "%s, expert agent %u", name, r->j);
        r->id = (struct kvr_auth_id){KVR_AUTH_ROLE_AGENT, r->j};
        struct kvr_dialer_config dc = {.plan = plan,
                                       .addr = plan->agents[r->j].addr,
                                       .limits = &c->limits,
                                       .role = KVR_AUTH_ROLE_STAGE,
                                       .index = stage,
                                       .name = r->name,
                                       .handshake_ms = HANDSHAKE_MS,
                                       .backoff_max_ms = BACKOFF_MAX_MS,
                                       .wake = NULL,
                                       .peer = &r->id,
                                       .dirs = KVR_LINK_SEND | KVR_LINK_RECV};
        if ((rc = kvr_dialer_start(&r->dialer, &dc, err))) {
            kvr_experts_client_destroy(c);
            return rc;
        }
    }
    KVR_INFO("%s: experts of layers %u-%u on %u agents (the rest computed here)", name,
             st->first_layer, st->last_layer, n);
    *out = c;
    return KVR_OK;
}

bool kvr_experts_client_stats(const struct kvr_experts_client *c, uint32_t j,
                              struct kvr_experts_agent_stats *out)
{
    memset(out, 0, sizeof *out);
    for (uint32_t i = 0; c && i < c->n_remote; i++) {
        struct remote *r = &c->remote[i];
        if (r->j != j)
            continue;
        out->linked = atomic_load(&r->a_linked);
        out->frames = atomic_load(&r->frames);
        out->pairs = atomic_load(&r->pairs);
        out->fallback_pairs = atomic_load(&r->fallback_pairs);
        out->lost = atomic_load(&r->lost);
        out->held_ns = atomic_load(&r->held_ns);
        out->starved_ns = atomic_load(&r->starved_ns);
        out->blocked_ns = atomic_load(&r->blocked_ns);
        out->wait_ns = atomic_load(&r->wait_ns);
        return true;
    }
    return false;
}

/* Build and send agent r's EXPERT frame for this layer: the rows using an expert it holds.
 * Returns whether a frame went out (false: nothing for it, or the link failed). */
static bool remote_send(struct kvr_experts_client *c, struct remote *r, uint32_t layer,
                        const float *x, uint32_t n_rows, const uint32_t *ids, const float *weights)
{
    uint32_t k = c->n_used, n_sel = 0, expect = 0;
    for (uint32_t row = 0; row < n_rows; row++) {
        uint32_t m = 0;
        for (uint32_t s = 0; s < k; s++)
            m += r->mask[ids[(size_t)row * k + s]] != 0;
        if (m) {
            r->rows[n_sel++] = row;
            expect += m;
        }
    }
    if (n_sel == 0)
        return false;
    uint8_t *b = r->body;
    kvr_st32(b, layer);
    kvr_st16(b + 4, (uint16_t)k);
    kvr_st16(b + 6, 0);
    kvr_st32(b + 8, n_sel);
    kvr_st32(b + 12, 0);
    uint8_t *q = b + KVR_EXPERTS_HEAD_BYTES;
    for (uint32_t i = 0; i < n_sel; i++)
        for (uint32_t s = 0; s < k; s++, q += KVR_EXPERTS_ROUTE_BYTES) {
            size_t p = (size_t)r->rows[i] * k + s;
            kvr_st16(q, (uint16_t)ids[p]);
            kvr_st16(q + 2, 0);
            kvr_stf32(q + 4, weights[p]);
        }
    size_t row_bytes = (size_t)c->n_embd * 4;
    for (uint32_t i = 0; i < n_sel; i++, q += row_bytes)
        memcpy(q, x + (size_t)r->rows[i] * c->n_embd, row_bytes);
    struct kvr_wire_msg m = {.type = KVR_WIRE_EXPERT,
                             .batch_id = ++r->req,
                             .payload = KVR_WIRE_PAYLOAD_EXPERT,
                             .payload_data = b,
                             .payload_bytes = (size_t)(q - b)};
    struct kvr_err err = {0};
    if (kvr_link_send(&r->link, &m, kvr_net_deadline(SEND_MS), &err)) {
        remote_lose(c, r, err.msg);
        return false;
    }
    r->expect = expect;
    r->sent = true;
    return true;
}

/* Read agent r's answer into pairs. */
static int remote_recv(struct kvr_experts_client *c, struct remote *r, uint32_t layer,
                       uint32_t n_rows, const uint32_t *ids, float *pairs, struct kvr_err *err)
{
    uint64_t deadline = kvr_net_deadline(KVR_EXPERTS_RESULT_MS);
    const struct kvr_wire_frame *f;
    int rc;
    do {
        if ((rc = kvr_link_recv(&r->link, deadline, &f, err)))
            return rc == KVR_ETIMEDOUT
                       ? kvr_err_set(err, rc, "no answer within %d ms", KVR_EXPERTS_RESULT_MS)
                       : rc;
        if (f->hdr.type == KVR_WIRE_GOODBYE)
            return kvr_err_set(err, KVR_ECLOSED, "it said goodbye");
    } while (f->hdr.type != KVR_WIRE_EXPERT_RESULT);
    const uint8_t *b = f->payload;
    size_t len = f->hdr.payload_bytes, row_bytes = (size_t)c->n_embd * 4;
    if (f->hdr.batch_id != r->req)
        return PROTO("answer to request %" PRIu64 ", expected %" PRIu64, f->hdr.batch_id, r->req);
    if (len < KVR_EXPERTS_RESULT_HEAD || kvr_ld32(b) != layer || kvr_ld32(b + 4) != r->expect ||
        len != KVR_EXPERTS_RESULT_HEAD + (size_t)r->expect * row_bytes)
        return PROTO("answer of %zu bytes for layer %u with %u pairs; expected layer %u, %u "
                     "pairs",
                     len, len >= 8 ? kvr_ld32(b) : 0, len >= 8 ? kvr_ld32(b + 4) : 0, layer,
                     r->expect);
    (void)n_rows;
    const uint8_t *src = b + KVR_EXPERTS_RESULT_HEAD;
    uint32_t k = c->n_used;
    for (uint32_t row = 0; row < n_rows; row++)
        for (uint32_t s = 0; s < k; s++) {
            size_t p = (size_t)row * k + s;
            if (!r->mask[ids[p]])
                continue;
            memcpy(pairs + p * c->n_embd, src, row_bytes);
            src += row_bytes;
        }
    r->batch.held_ns += kvr_ld64(b + 8);
    r->batch.starved_ns += kvr_ld64(b + 16);
    r->batch.blocked_ns += kvr_ld64(b + 24);
    r->batch.pairs += r->expect;
    r->batch_used = true;
    atomic_fetch_add(&r->frames, 1);
    atomic_fetch_add(&r->pairs, r->expect);
    atomic_fetch_add(&r->held_ns, kvr_ld64(b + 8));
    atomic_fetch_add(&r->starved_ns, kvr_ld64(b + 16));
    atomic_fetch_add(&r->blocked_ns, kvr_ld64(b + 24));
    return KVR_OK;
}

static uint32_t count_pairs(const uint8_t *mask, const uint32_t *ids, size_t n_pairs)
{
    uint32_t n = 0;
    for (size_t p = 0; p < n_pairs; p++)
        n += mask[ids[p]] != 0;
    return n;
}

void kvr_experts_dispatch(void *ctx, uint32_t layer, struct kvr_moe_work *w,
                          const struct kvr_moe_layer *l, const float *x, uint32_t n_rows,
                          const uint32_t *ids, const float *weights, float *pairs,
                          struct kvr_pool *pool)
{
    struct kvr_experts_client *c = ctx;
    const int16_t *owner = c->owner + (size_t)(layer - c->first_layer) * c->n_expert;
    size_t n_pairs = (size_t)n_rows * c->n_used;
    /* 1. Links the diallers made since the last layer; every agent's experts of this layer;
     *    one frame to each linked agent that has work, all before any answer is read. */
    for (uint32_t i = 0; i < c->n_remote; i++) {
        struct remote *r = &c->remote[i];
        if (!r->linked && kvr_dialer_take(r->dialer, &r->link)) {
            if (r->link.peer_id.role != KVR_AUTH_ROLE_AGENT || r->link.peer_id.index != r->j) {
                remote_lose(c, r, "the peer is not that agent");
            } else {
                r->linked = true;
                atomic_store(&r->a_linked, true);
                KVR_INFO("stage %u: expert agent %u linked", c->stage, r->j);
            }
        }
        for (uint32_t e = 0; e < c->n_expert; e++)
            r->mask[e] = owner[e] == (int16_t)i;
        r->sent = r->linked && remote_send(c, r, layer, x, n_rows, ids, weights);
    }
    /* 2. Here, while the agents work: every pair no agent took. */
    for (uint32_t e = 0; e < c->n_expert; e++)
        c->local[e] = owner[e] == OWNER_SELF || !c->remote[owner[e]].sent;
    for (uint32_t i = 0; i < c->n_remote; i++)
        if (!c->remote[i].sent)
            atomic_fetch_add(&c->remote[i].fallback_pairs,
                             count_pairs(c->remote[i].mask, ids, n_pairs));
    kvr_moe_experts(w, l, x, n_rows, ids, weights, c->local, pairs, pool);
    /* 3. The answers, in agent order (each pair has its own place: order does not matter
     *    for the result, only for who waits); a lost one's pairs computed here. */
    for (uint32_t i = 0; i < c->n_remote; i++) {
        struct remote *r = &c->remote[i];
        if (!r->sent)
            continue;
        r->sent = false;
        struct kvr_err err = {0};
        uint64_t t0 = kvr_now_ns();
        int rc = remote_recv(c, r, layer, n_rows, ids, pairs, &err);
        atomic_fetch_add(&r->wait_ns, kvr_now_ns() - t0);
        if (rc) {
            remote_lose(c, r, err.msg);
            atomic_fetch_add(&r->fallback_pairs, r->expect);
            kvr_moe_experts(w, l, x, n_rows, ids, weights, r->mask, pairs, pool);
        }
    }
}

uint32_t kvr_experts_client_take_timings(struct kvr_experts_client *c, struct kvr_wire_timing *out)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < c->n_remote && n < KVR_PLAN_MAX_AGENTS; i++) {
        struct remote *r = &c->remote[i];
        if (!r->batch_used)
            continue;
        r->batch.stage = KVR_WIRE_TIMING_AGENT | r->j;
        out[n++] = r->batch;
        memset(&r->batch, 0, sizeof r->batch);
        r->batch_used = false;
    }
    return n;
}
