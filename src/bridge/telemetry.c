/* telemetry.c - ring buffers of batch traces and ring events, and their JSON (telemetry.h;
 * the format is documented in docs/API.md, which this file must follow). */
#include "bridge/telemetry.h"

#include "core/alloc.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

struct kvr_telemetry {
    struct kvr_telemetry_trace *traces; /* [KVR_TELEMETRY_TRACES], serial s at (s-1) % N */
    uint64_t n_traces;                  /* recorded so far = the newest serial */
    struct kvr_telemetry_event events[KVR_TELEMETRY_EVENTS];
    uint64_t n_events;
    uint64_t lost_since_ns; /* the first LOST since the last RECOVERED; 0: none */
};

int kvr_telemetry_create(struct kvr_telemetry **out, struct kvr_err *err)
{
    *out = NULL;
    struct kvr_telemetry *t = kvr_calloc(1, sizeof *t);
    if (!t)
        return kvr_err_set(err, KVR_ENOMEM, "telemetry: out of memory");
    t->traces = kvr_calloc(KVR_TELEMETRY_TRACES, sizeof *t->traces);
    if (!t->traces) {
        kvr_free(t);
        return kvr_err_set(err, KVR_ENOMEM, "telemetry: out of memory for %u batch traces",
                           KVR_TELEMETRY_TRACES);
    }
    *out = t;
    return KVR_OK;
}

void kvr_telemetry_destroy(struct kvr_telemetry *t)
{
    if (!t)
        return;
    kvr_free(t->traces);
    kvr_free(t);
}

/* ---- recording ----------------------------------------------------------------------------- */

static void copy_time(struct kvr_telemetry_time *dst, const struct kvr_wire_timing *src, bool agent)
{
    *dst = (struct kvr_telemetry_time){.held_ns = src->held_ns,
                                       .starved_ns = src->starved_ns,
                                       .blocked_ns = src->blocked_ns,
                                       .agent = agent ? src->stage & ~KVR_WIRE_TIMING_AGENT : 0,
                                       .pairs = agent ? src->pairs : 0};
}

void kvr_telemetry_record_batch(struct kvr_telemetry *t, const struct kvr_telemetry_batch *b)
{
    struct kvr_telemetry_trace *tr = &t->traces[t->n_traces % KVR_TELEMETRY_TRACES];
    tr->serial = ++t->n_traces;
    tr->batch_id = b->batch_id;
    tr->sent_ns = b->sent_ns;
    tr->returned_ns = b->returned_ns;
    tr->n_ctrl = b->n_ctrl;
    tr->n_rows_prefill = tr->n_rows_decode = 0;
    tr->n_seqs = tr->n_seqs_more = 0;
    for (uint32_t i = 0; i < b->n_segs; i++) {
        const struct kvr_seg *sg = &b->segs[i];
        bool prefill = (sg->flags & KVR_SEG_PREFILL) != 0;
        if (prefill)
            tr->n_rows_prefill += sg->n_tokens;
        else
            tr->n_rows_decode += sg->n_tokens;
        if (tr->n_seqs == KVR_TELEMETRY_SEQS) {
            tr->n_seqs_more++;
            continue;
        }
        tr->seqs[tr->n_seqs++] = (struct kvr_telemetry_seq){
            .req_id = b->req_ids ? b->req_ids[i] : 0,
            .seq = sg->seq,
            .n_rows = sg->n_tokens,
            .kind = prefill ? KVR_TELEMETRY_PREFILL : KVR_TELEMETRY_DECODE,
            .last_chunk = (sg->flags & KVR_SEG_LAST_CHUNK) != 0};
    }
    tr->n_stages = b->n_timings < KVR_PLAN_MAX_STAGES ? b->n_timings : KVR_PLAN_MAX_STAGES;
    for (uint32_t i = 0; i < tr->n_stages; i++)
        copy_time(&tr->stage[i], &b->timings[i], false);
    tr->n_agents =
        b->n_agent_timings < KVR_TELEMETRY_AGENTS ? b->n_agent_timings : KVR_TELEMETRY_AGENTS;
    tr->n_agents_more = b->n_agent_timings - tr->n_agents;
    for (uint32_t i = 0; i < tr->n_agents; i++)
        copy_time(&tr->agent[i], &b->agent_timings[i], true);
}

void kvr_telemetry_ring_event(struct kvr_telemetry *t, enum kvr_telemetry_event_type type,
                              int32_t stage, uint32_t n_held, const char *why, uint64_t now_ns)
{
    struct kvr_telemetry_event *ev = &t->events[t->n_events % KVR_TELEMETRY_EVENTS];
    *ev = (struct kvr_telemetry_event){.serial = ++t->n_events,
                                       .t_ns = now_ns,
                                       .type = (uint8_t)type,
                                       .stage = stage,
                                       .n_held = n_held};
    snprintf(ev->why, sizeof ev->why, "%s", why ? why : "");
    if (type == KVR_TELEMETRY_EV_LOST && !t->lost_since_ns) {
        t->lost_since_ns = now_ns ? now_ns : 1;
    } else if (type == KVR_TELEMETRY_EV_RECOVERED) {
        if (t->lost_since_ns && now_ns >= t->lost_since_ns)
            ev->outage_ns = now_ns - t->lost_since_ns;
        t->lost_since_ns = 0;
    }
}

/* ---- taking a snapshot ------------------------------------------------------------------- */

static void summarise_plan(struct kvr_plan_summary *ps, const struct kvr_plan *plan)
{
    memset(ps, 0, sizeof *ps);
    if (!plan)
        return;
    ps->epoch = plan->epoch;
    ps->n_stages = plan->n_stages < KVR_PLAN_MAX_STAGES ? plan->n_stages : KVR_PLAN_MAX_STAGES;
    ps->n_agents = plan->n_agents < KVR_PLAN_MAX_AGENTS ? plan->n_agents : KVR_PLAN_MAX_AGENTS;
    ps->row_width = plan->row_width;
    ps->microbatches = plan->microbatches;
    ps->max_seqs = plan->max_seqs;
    ps->n_ctx = plan->n_ctx;
    ps->kv_block_tokens = plan->kv_block_tokens;
    ps->kv_blocks = plan->kv_blocks;
    ps->n_threads = plan->n_threads;
    for (uint32_t i = 0; i < ps->n_stages; i++) {
        const struct kvr_plan_stage *st = &plan->stages[i];
        memcpy(ps->stage[i].addr, st->addr, sizeof ps->stage[i].addr);
        ps->stage[i].addr[sizeof ps->stage[i].addr - 1] = 0;
        ps->stage[i].first_layer = st->first_layer;
        ps->stage[i].last_layer = st->last_layer;
        ps->stage[i].n_threads = st->n_threads ? st->n_threads : plan->n_threads;
    }
    for (uint32_t i = 0; i < ps->n_agents; i++) {
        const struct kvr_plan_agent *ag = &plan->agents[i];
        memcpy(ps->agent[i].addr, ag->addr, sizeof ps->agent[i].addr);
        ps->agent[i].addr[sizeof ps->agent[i].addr - 1] = 0;
        ps->agent[i].n_threads = ag->n_threads ? ag->n_threads : plan->n_threads;
        ps->agent[i].n_holds = ag->n_holds < KVR_PLAN_MAX_HOLDS ? ag->n_holds : KVR_PLAN_MAX_HOLDS;
        memcpy(ps->agent[i].holds, ag->holds, ps->agent[i].n_holds * sizeof ag->holds[0]);
    }
}

void kvr_telemetry_take(const struct kvr_telemetry *t, struct kvr_telemetry_reader *reader,
                        const struct kvr_plan *plan, const struct kvr_sched_stats *stats,
                        const struct kvr_telemetry_stage_state *states, uint32_t n_states,
                        uint64_t now_ns, struct kvr_telemetry_snapshot *snap)
{
    snap->now_ns = now_ns;
    summarise_plan(&snap->plan, plan);
    if (stats)
        snap->stats = *stats;
    else
        memset(&snap->stats, 0, sizeof snap->stats);
    snap->n_stage_states =
        states ? (n_states < KVR_PLAN_MAX_STAGES ? n_states : KVR_PLAN_MAX_STAGES) : 0;
    if (snap->n_stage_states)
        memcpy(snap->stage_state, states, snap->n_stage_states * sizeof *states);

    /* Traces after the reader's cursor: the newest that fit, oldest first. A cursor ahead
     * of the buffer (a telemetry recreated under an old reader) starts over. */
    uint64_t newest = t->n_traces;
    if (reader->trace_serial > newest)
        reader->trace_serial = 0;
    uint64_t oldest_kept = newest > KVR_TELEMETRY_TRACES ? newest - KVR_TELEMETRY_TRACES + 1 : 1;
    uint64_t first = reader->trace_serial + 1;
    uint64_t pending = newest - reader->trace_serial;
    if (first < oldest_kept)
        first = oldest_kept;
    if (newest - first + 1 > KVR_TELEMETRY_SNAPSHOT_TRACES && newest >= first)
        first = newest - KVR_TELEMETRY_SNAPSHOT_TRACES + 1;
    snap->n_traces = 0;
    for (uint64_t s = first; s <= newest; s++)
        snap->traces[snap->n_traces++] = t->traces[(s - 1) % KVR_TELEMETRY_TRACES];
    snap->traces_missed = pending - snap->n_traces;
    reader->trace_serial = newest;

    uint64_t newest_ev = t->n_events;
    if (reader->event_serial > newest_ev)
        reader->event_serial = 0;
    uint64_t ev_pending = newest_ev - reader->event_serial;
    uint64_t ev_first = reader->event_serial + 1;
    if (newest_ev > KVR_TELEMETRY_EVENTS && ev_first < newest_ev - KVR_TELEMETRY_EVENTS + 1)
        ev_first = newest_ev - KVR_TELEMETRY_EVENTS + 1;
    snap->n_events = 0;
    for (uint64_t s = ev_first; s <= newest_ev; s++)
        snap->events[snap->n_events++] = t->events[(s - 1) % KVR_TELEMETRY_EVENTS];
    snap->events_missed = ev_pending - snap->n_events;
    reader->event_serial = newest_ev;
}

/* ---- JSON ---------------------------------------------------------------------------------- */

const char *kvr_telemetry_kind_name(enum kvr_telemetry_kind kind)
{
    static const char *const names[KVR_TELEMETRY_KIND_COUNT] = {"prefill", "decode"};
    return (unsigned)kind < KVR_TELEMETRY_KIND_COUNT ? names[kind] : "unknown";
}

const char *kvr_telemetry_event_name(enum kvr_telemetry_event_type type)
{
    static const char *const names[KVR_TELEMETRY_EV_TYPE_COUNT] = {"lost", "recovered"};
    return (unsigned)type < KVR_TELEMETRY_EV_TYPE_COUNT ? names[type] : "unknown";
}

const char *kvr_telemetry_refusal_name(enum kvr_refusal_reason reason)
{
    static const char *const names[KVR_REFUSE_REASON_COUNT] = {
        [KVR_REFUSE_FIRST_TOKEN_BUDGET] = "first_token_budget",
        [KVR_REFUSE_TOTAL_BUDGET] = "total_budget",
        [KVR_REFUSE_KV_FULL] = "kv_full",
        [KVR_REFUSE_QUEUE_FULL] = "queue_full",
        [KVR_REFUSE_TOO_LONG] = "too_long",
        [KVR_REFUSE_RING_DOWN] = "ring_down",
        [KVR_REFUSE_INTERNAL] = "internal"};
    return (unsigned)reason < KVR_REFUSE_REASON_COUNT ? names[reason] : NULL;
}

/* Times go out in milliseconds on the bridge's monotonic clock, as doubles: exact to the
 * nanosecond for 104 days of uptime, and what a page's performance.now() arithmetic wants. */
static double ms_of(uint64_t ns)
{
    return round((double)ns / 1e3) / 1e3; /* to the microsecond: shorter text */
}

static json_t *ms(uint64_t ns)
{
    return json_real(ms_of(ns));
}

/* Shares and rates, to four decimals. */
static json_t *frac(double x)
{
    return json_real(round(x * 1e4) / 1e4);
}

/* json_object_set_new that remembers a failed allocation (jansson returns -1 and frees). */
static void put(json_t *obj, const char *key, json_t *v, bool *failed)
{
    if (!v || json_object_set_new(obj, key, v) != 0)
        *failed = true;
}

static void push(json_t *arr, json_t *v, bool *failed)
{
    if (!v || json_array_append_new(arr, v) != 0)
        *failed = true;
}

static json_t *pair(uint32_t a, uint32_t b)
{
    json_t *p = json_array();
    if (p &&
        (json_array_append_new(p, json_integer(a)) || json_array_append_new(p, json_integer(b)))) {
        json_decref(p);
        return NULL;
    }
    return p;
}

/* Does agent `ag` hold any layer of stage `st`? Then it is drawn beside that stage. */
static bool agent_serves(const struct kvr_plan_summary *ps, uint32_t ag, uint32_t st)
{
    for (uint32_t h = 0; h < ps->agent[ag].n_holds; h++) {
        const struct kvr_plan_hold *hd = &ps->agent[ag].holds[h];
        if (hd->first_layer <= ps->stage[st].last_layer &&
            hd->last_layer >= ps->stage[st].first_layer)
            return true;
    }
    return false;
}

static json_t *stages_json(const struct kvr_telemetry_snapshot *sn, bool *failed)
{
    const struct kvr_plan_summary *ps = &sn->plan;
    const struct kvr_sched_stats *st = &sn->stats;
    json_t *arr = json_array();
    if (!arr) {
        *failed = true;
        return NULL;
    }
    uint32_t kv_per_stage = st->kv_blocks_used + st->kv_blocks_cached;
    for (uint32_t i = 0; i < ps->n_stages; i++) {
        json_t *o = json_object();
        if (!o) {
            *failed = true;
            break;
        }
        put(o, "index", json_integer(i), failed);
        put(o, "addr", json_string(ps->stage[i].addr), failed);
        put(o, "layers", pair(ps->stage[i].first_layer, ps->stage[i].last_layer), failed);
        put(o, "threads", json_integer(ps->stage[i].n_threads), failed);
        if (i < sn->n_stage_states) {
            const struct kvr_telemetry_stage_state *ss = &sn->stage_state[i];
            put(o, "state", json_string(ss->state[0] ? ss->state : "unknown"), failed);
            put(o, "since_ms", ms(ss->since_ns), failed);
            put(o, "error", json_string(ss->last_error), failed);
        } else {
            put(o, "state", json_string(st->ring_up ? "up" : "unknown"), failed);
            put(o, "since_ms", json_null(), failed);
            put(o, "error", json_string(""), failed);
        }
        const struct kvr_sched_stage_stats *ss = i < st->n_stages ? &st->stage[i] : NULL;
        put(o, "held", frac(ss ? ss->util : 0), failed);
        put(o, "starved", frac(ss ? ss->starved_frac : 0), failed);
        put(o, "blocked", frac(ss ? ss->blocked_frac : 0), failed);
        put(o, "held_ms_total", ms(ss ? ss->held_ns : 0), failed);
        put(o, "starved_ms_total", ms(ss ? ss->starved_ns : 0), failed);
        put(o, "blocked_ms_total", ms(ss ? ss->blocked_ns : 0), failed);
        put(o, "kv_blocks", json_integer(kv_per_stage), failed);
        json_t *agents = json_array();
        for (uint32_t a = 0; agents && a < ps->n_agents; a++)
            if (agent_serves(ps, a, i))
                push(agents, json_integer(a), failed);
        put(o, "agents", agents, failed);
        push(arr, o, failed);
    }
    return arr;
}

static json_t *agents_json(const struct kvr_telemetry_snapshot *sn, bool *failed)
{
    const struct kvr_plan_summary *ps = &sn->plan;
    json_t *arr = json_array();
    for (uint32_t i = 0; arr && i < ps->n_agents; i++) {
        json_t *o = json_object();
        if (!o) {
            *failed = true;
            break;
        }
        put(o, "index", json_integer(i), failed);
        put(o, "addr", json_string(ps->agent[i].addr), failed);
        put(o, "threads", json_integer(ps->agent[i].n_threads), failed);
        json_t *holds = json_array();
        for (uint32_t h = 0; holds && h < ps->agent[i].n_holds; h++) {
            const struct kvr_plan_hold *hd = &ps->agent[i].holds[h];
            json_t *ho = json_object();
            if (ho) {
                put(ho, "layers", pair(hd->first_layer, hd->last_layer), failed);
                put(ho, "experts", pair(hd->first_expert, hd->last_expert), failed);
            }
            push(holds, ho, failed);
        }
        put(o, "holds", holds, failed);
        json_t *stages = json_array();
        for (uint32_t s = 0; stages && s < ps->n_stages; s++)
            if (agent_serves(ps, i, s))
                push(stages, json_integer(s), failed);
        put(o, "stages", stages, failed);
        const struct kvr_sched_agent_stats *as =
            i < sn->stats.n_agents ? &sn->stats.agent[i] : NULL;
        put(o, "held_ms_total", ms(as ? as->held_ns : 0), failed);
        put(o, "starved_ms_total", ms(as ? as->starved_ns : 0), failed);
        put(o, "blocked_ms_total", ms(as ? as->blocked_ns : 0), failed);
        put(o, "pairs", json_integer(as ? (json_int_t)as->pairs : 0), failed);
        push(arr, o, failed);
    }
    if (!arr)
        *failed = true;
    return arr;
}

static json_t *sched_json(const struct kvr_sched_stats *st, bool *failed)
{
    json_t *o = json_object();
    if (!o) {
        *failed = true;
        return NULL;
    }
    put(o, "running", json_integer(st->running), failed);
    put(o, "waiting", json_integer(st->waiting), failed);
    put(o, "inflight", json_integer(st->inflight), failed);
    put(o, "batches", json_integer((json_int_t)st->batches), failed);
    put(o, "prompt_tokens", json_integer((json_int_t)st->prompt_tokens), failed);
    put(o, "generated_tokens", json_integer((json_int_t)st->generated_tokens), failed);
    put(o, "tokens_per_s", frac(st->tokens_per_s), failed);
    put(o, "batch_ms", frac(st->batch_ms_ema), failed);
    json_t *kv = json_object();
    if (kv) {
        put(kv, "used", json_integer(st->kv_blocks_used), failed);
        put(kv, "cached", json_integer(st->kv_blocks_cached), failed);
        put(kv, "total", json_integer(st->kv_blocks_total), failed);
    }
    put(o, "kv_blocks", kv, failed);
    json_t *pc = json_object();
    if (pc) {
        put(pc, "queries", json_integer((json_int_t)st->prefix_queries), failed);
        put(pc, "hits", json_integer((json_int_t)st->prefix_hits), failed);
        put(pc, "evicted", json_integer((json_int_t)st->prefix_evicted), failed);
    }
    put(o, "prefix_cache", pc, failed);
    put(o, "admitted", json_integer((json_int_t)st->admitted), failed);
    json_t *ref = json_object();
    for (int r = 0; ref && r < KVR_REFUSE_REASON_COUNT; r++) {
        const char *name = kvr_telemetry_refusal_name((enum kvr_refusal_reason)r);
        if (name)
            put(ref, name, json_integer((json_int_t)st->refused[r]), failed);
    }
    put(o, "refused", ref, failed);
    return o;
}

static json_t *time_json(const struct kvr_telemetry_time *tm)
{
    return json_pack("[f,f,f]", ms_of(tm->held_ns), ms_of(tm->starved_ns), ms_of(tm->blocked_ns));
}

static json_t *trace_json(const struct kvr_telemetry_trace *tr, bool *failed)
{
    json_t *o = json_object();
    if (!o) {
        *failed = true;
        return NULL;
    }
    put(o, "id", json_integer((json_int_t)tr->batch_id), failed);
    put(o, "sent_ms", ms(tr->sent_ns), failed);
    put(o, "returned_ms", ms(tr->returned_ns), failed);
    put(o, "ctrl", json_integer(tr->n_ctrl), failed);
    put(o, "prefill_rows", json_integer(tr->n_rows_prefill), failed);
    put(o, "decode_rows", json_integer(tr->n_rows_decode), failed);
    json_t *seqs = json_array();
    for (uint32_t i = 0; seqs && i < tr->n_seqs; i++) {
        const struct kvr_telemetry_seq *q = &tr->seqs[i];
        json_t *so = json_object();
        if (so) {
            put(so, "seq", json_integer(q->seq), failed);
            put(so, "req", q->req_id ? json_integer((json_int_t)q->req_id) : json_null(), failed);
            put(so, "kind", json_string(kvr_telemetry_kind_name(q->kind)), failed);
            put(so, "rows", json_integer(q->n_rows), failed);
            if (q->last_chunk)
                put(so, "last", json_true(), failed);
        }
        push(seqs, so, failed);
    }
    put(o, "seqs", seqs, failed);
    put(o, "seqs_more", json_integer(tr->n_seqs_more), failed);
    json_t *stages = json_array();
    for (uint32_t i = 0; stages && i < tr->n_stages; i++)
        push(stages, time_json(&tr->stage[i]), failed);
    put(o, "stages", stages, failed);
    json_t *agents = json_array();
    for (uint32_t i = 0; agents && i < tr->n_agents; i++) {
        const struct kvr_telemetry_time *tm = &tr->agent[i];
        push(agents,
             json_pack("{s:i,s:f,s:f,s:f,s:i}", "agent", (json_int_t)tm->agent, "held_ms",
                       ms_of(tm->held_ns), "starved_ms", ms_of(tm->starved_ns), "blocked_ms",
                       ms_of(tm->blocked_ns), "pairs", (json_int_t)tm->pairs),
             failed);
    }
    put(o, "agents", agents, failed);
    if (tr->n_agents_more)
        put(o, "agents_more", json_integer(tr->n_agents_more), failed);
    return o;
}

static json_t *event_json(const struct kvr_telemetry_event *ev, bool *failed)
{
    json_t *o = json_object();
    if (!o) {
        *failed = true;
        return NULL;
    }
    put(o, "t_ms", ms(ev->t_ns), failed);
    put(o, "type", json_string(kvr_telemetry_event_name(ev->type)), failed);
    put(o, "stage", ev->stage >= 0 ? json_integer(ev->stage) : json_null(), failed);
    put(o, "held", json_integer(ev->n_held), failed);
    if (ev->type == KVR_TELEMETRY_EV_RECOVERED)
        put(o, "outage_ms", ms(ev->outage_ns), failed);
    /* A message cut inside a UTF-8 character would make json_string refuse it. */
    json_t *why = json_string(ev->why);
    put(o, "why", why ? why : json_string(""), failed);
    return o;
}

static int dump_to_sbuf(const char *buf, size_t size, void *data)
{
    struct kvr_sbuf *out = data;
    kvr_sbuf_append(out, buf, size);
    return out->failed ? -1 : 0;
}

int kvr_telemetry_json(const struct kvr_telemetry_snapshot *sn, struct kvr_sbuf *out)
{
    bool failed = false;
    json_t *root = json_object();
    if (!root) {
        out->failed = true;
        return KVR_ENOMEM;
    }
    const struct kvr_plan_summary *ps = &sn->plan;
    put(root, "v", json_integer(1), &failed);
    put(root, "t_ms", ms(sn->now_ns), &failed);
    put(root, "interval_ms", json_integer(sn->interval_ms), &failed);
    json_t *ring = json_object();
    if (ring) {
        put(ring, "up", json_boolean(sn->stats.ring_up), &failed);
        put(ring, "epoch", json_integer(ps->epoch), &failed);
        put(ring, "row_width", json_integer(ps->row_width), &failed);
        put(ring, "microbatches", json_integer(ps->microbatches), &failed);
        put(ring, "max_seqs", json_integer(ps->max_seqs), &failed);
        put(ring, "n_ctx", json_integer(ps->n_ctx), &failed);
        put(ring, "kv_block_tokens", json_integer(ps->kv_block_tokens), &failed);
        put(ring, "kv_blocks", json_integer(ps->kv_blocks), &failed);
        put(ring, "stages", stages_json(sn, &failed), &failed);
        put(ring, "agents", agents_json(sn, &failed), &failed);
    }
    put(root, "ring", ring, &failed);
    put(root, "sched", sched_json(&sn->stats, &failed), &failed);
    json_t *batches = json_array();
    for (uint32_t i = 0; batches && i < sn->n_traces; i++)
        push(batches, trace_json(&sn->traces[i], &failed), &failed);
    put(root, "batches", batches, &failed);
    put(root, "batches_missed", json_integer((json_int_t)sn->traces_missed), &failed);
    json_t *events = json_array();
    for (uint32_t i = 0; events && i < sn->n_events; i++)
        push(events, event_json(&sn->events[i], &failed), &failed);
    put(root, "events", events, &failed);
    put(root, "events_missed", json_integer((json_int_t)sn->events_missed), &failed);

    if (!failed &&
        json_dump_callback(root, dump_to_sbuf, out, JSON_COMPACT | JSON_REAL_PRECISION(15)) != 0)
        failed = true;
    json_decref(root);
    if (failed || out->failed) {
        out->failed = true;
        return KVR_ENOMEM;
    }
    return KVR_OK;
}

int kvr_telemetry_sse(const struct kvr_telemetry_snapshot *snap, struct kvr_sbuf *out)
{
    /* The JSON is one line (compact), so one data field carries it whole. */
    kvr_sbuf_puts(out, "event: snapshot\ndata: ");
    int rc = kvr_telemetry_json(snap, out);
    kvr_sbuf_puts(out, "\n\n");
    return rc ? rc : out->failed ? KVR_ENOMEM : KVR_OK;
}

uint32_t kvr_telemetry_interval_ms(const char *arg)
{
    if (!arg || !*arg)
        return KVR_TELEMETRY_DEFAULT_INTERVAL_MS;
    uint64_t v = 0;
    for (const char *p = arg; *p; p++) {
        if (*p < '0' || *p > '9')
            return KVR_TELEMETRY_DEFAULT_INTERVAL_MS;
        if (v < KVR_TELEMETRY_MAX_INTERVAL_MS) /* stop growing: no overflow on long input */
            v = v * 10 + (uint64_t)(*p - '0');
    }
    if (v < KVR_TELEMETRY_MIN_INTERVAL_MS)
        return KVR_TELEMETRY_MIN_INTERVAL_MS;
    if (v > KVR_TELEMETRY_MAX_INTERVAL_MS)
        return KVR_TELEMETRY_MAX_INTERVAL_MS;
    return (uint32_t)v;
}
