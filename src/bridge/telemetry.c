/* telemetry.c - ring buffers of batch traces and ring events, and their JSON (telemetry.h;
 * the format is documented in docs/API.md, which this file must follow). */
#include "bridge/telemetry.h"

#include "core/alloc.h"
#include "core/jsonw.h"

#include <math.h>
#include <stddef.h>
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

/* Fills the header and the stages and agents in use, and nothing else: the whole summary
 * is 40 KiB, mostly unused, and this runs under the bridge's lock. */
static void summarise_plan(struct kvr_plan_summary *ps, const struct kvr_plan *plan)
{
    if (!plan) {
        memset(ps, 0, offsetof(struct kvr_plan_summary, stage));
        return;
    }
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

/* Only the parts of a trace in use: a whole one is 4 KiB, a typical one a tenth of that, and
 * this runs under the bridge's lock. */
static void copy_trace(struct kvr_telemetry_trace *dst, const struct kvr_telemetry_trace *src)
{
    memcpy(dst, src, offsetof(struct kvr_telemetry_trace, seqs));
    memcpy(dst->seqs, src->seqs, src->n_seqs * sizeof src->seqs[0]);
    dst->n_stages = src->n_stages;
    memcpy(dst->stage, src->stage, src->n_stages * sizeof src->stage[0]);
    dst->n_agents = src->n_agents;
    dst->n_agents_more = src->n_agents_more;
    memcpy(dst->agent, src->agent, src->n_agents * sizeof src->agent[0]);
}

void kvr_telemetry_take(const struct kvr_telemetry *t, struct kvr_telemetry_reader *reader,
                        const struct kvr_plan *plan, const struct kvr_sched_stats *stats,
                        const struct kvr_telemetry_stage_state *states, uint32_t n_states,
                        uint64_t now_ns, struct kvr_telemetry_snapshot *snap)
{
    snap->now_ns = now_ns;
    summarise_plan(&snap->plan, plan);
    if (!stats)
        memset(&snap->stats, 0, sizeof snap->stats);
    else if (stats != &snap->stats) /* else the caller filled it in place */
        snap->stats = *stats;
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
        copy_trace(&snap->traces[snap->n_traces++], &t->traces[(s - 1) % KVR_TELEMETRY_TRACES]);
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

/* Times go out in milliseconds on the bridge's monotonic clock, to the microsecond: exact
 * as a double for 104 days of uptime, and what a page's performance.now() arithmetic wants. */
static int64_t ms_micros(uint64_t ns)
{
    return (int64_t)((ns + 500) / 1000); /* whole microseconds, as ms */
}

static void ms_value(struct kvr_jsonw *w, uint64_t ns)
{
    kvr_jsonw_fixed(w, ms_micros(ns), 3);
}

/* Shares and rates, to four decimals. */
static void frac_value(struct kvr_jsonw *w, double x)
{
    kvr_jsonw_fixed(w, (int64_t)llround(x * 1e4), 4);
}

static void pair_value(struct kvr_jsonw *w, uint32_t a, uint32_t b)
{
    kvr_jsonw_arr(w);
    kvr_jsonw_uint(w, a);
    kvr_jsonw_uint(w, b);
    kvr_jsonw_end(w);
}

/* A field whose key is a literal: written without escaping it (KVR_JSONW_KEY). */
#define UINT_FIELD(w, key, v) (KVR_JSONW_KEY(w, key), kvr_jsonw_uint(w, v))
#define STR_FIELD(w, key, v) (KVR_JSONW_KEY(w, key), kvr_jsonw_str(w, v))
#define MS_FIELD(w, key, ns) (KVR_JSONW_KEY(w, key), ms_value(w, ns))
#define FRAC_FIELD(w, key, x) (KVR_JSONW_KEY(w, key), frac_value(w, x))
#define PAIR_FIELD(w, key, a, b) (KVR_JSONW_KEY(w, key), pair_value(w, a, b))

/* Appends a literal to a text being built at p. */
#define PUT_LIT(p, lit) (memcpy((p), lit, sizeof(lit) - 1), (p) + sizeof(lit) - 1)

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

static void stage_json(struct kvr_jsonw *w, const struct kvr_telemetry_snapshot *sn, uint32_t i)
{
    const struct kvr_plan_summary *ps = &sn->plan;
    const struct kvr_sched_stats *st = &sn->stats;
    kvr_jsonw_obj(w);
    UINT_FIELD(w, "index", i);
    STR_FIELD(w, "addr", ps->stage[i].addr);
    PAIR_FIELD(w, "layers", ps->stage[i].first_layer, ps->stage[i].last_layer);
    UINT_FIELD(w, "threads", ps->stage[i].n_threads);
    if (i < sn->n_stage_states) {
        const struct kvr_telemetry_stage_state *ss = &sn->stage_state[i];
        STR_FIELD(w, "state", ss->state[0] ? ss->state : "unknown");
        MS_FIELD(w, "since_ms", ss->since_ns);
        STR_FIELD(w, "error", ss->last_error);
    } else {
        STR_FIELD(w, "state", st->ring_up ? "up" : "unknown");
        KVR_JSONW_KEY(w, "since_ms");
        kvr_jsonw_null(w);
        STR_FIELD(w, "error", "");
    }
    const struct kvr_sched_stage_stats *ss = i < st->n_stages ? &st->stage[i] : NULL;
    FRAC_FIELD(w, "held", ss ? ss->util : 0);
    FRAC_FIELD(w, "starved", ss ? ss->starved_frac : 0);
    FRAC_FIELD(w, "blocked", ss ? ss->blocked_frac : 0);
    MS_FIELD(w, "held_ms_total", ss ? ss->held_ns : 0);
    MS_FIELD(w, "starved_ms_total", ss ? ss->starved_ns : 0);
    MS_FIELD(w, "blocked_ms_total", ss ? ss->blocked_ns : 0);
    UINT_FIELD(w, "kv_blocks", (uint64_t)st->kv_blocks_used + st->kv_blocks_cached);
    KVR_JSONW_KEY(w, "agents");
    kvr_jsonw_arr(w);
    for (uint32_t a = 0; a < ps->n_agents; a++)
        if (agent_serves(ps, a, i))
            kvr_jsonw_uint(w, a);
    kvr_jsonw_end(w);
    kvr_jsonw_end(w);
}

static void agent_json(struct kvr_jsonw *w, const struct kvr_telemetry_snapshot *sn, uint32_t i)
{
    const struct kvr_plan_summary *ps = &sn->plan;
    kvr_jsonw_obj(w);
    UINT_FIELD(w, "index", i);
    STR_FIELD(w, "addr", ps->agent[i].addr);
    UINT_FIELD(w, "threads", ps->agent[i].n_threads);
    KVR_JSONW_KEY(w, "holds");
    kvr_jsonw_arr(w);
    for (uint32_t h = 0; h < ps->agent[i].n_holds; h++) {
        const struct kvr_plan_hold *hd = &ps->agent[i].holds[h];
        kvr_jsonw_obj(w);
        PAIR_FIELD(w, "layers", hd->first_layer, hd->last_layer);
        PAIR_FIELD(w, "experts", hd->first_expert, hd->last_expert);
        kvr_jsonw_end(w);
    }
    kvr_jsonw_end(w);
    KVR_JSONW_KEY(w, "stages");
    kvr_jsonw_arr(w);
    for (uint32_t s = 0; s < ps->n_stages; s++)
        if (agent_serves(ps, i, s))
            kvr_jsonw_uint(w, s);
    kvr_jsonw_end(w);
    const struct kvr_sched_agent_stats *as = i < sn->stats.n_agents ? &sn->stats.agent[i] : NULL;
    MS_FIELD(w, "held_ms_total", as ? as->held_ns : 0);
    MS_FIELD(w, "starved_ms_total", as ? as->starved_ns : 0);
    MS_FIELD(w, "blocked_ms_total", as ? as->blocked_ns : 0);
    UINT_FIELD(w, "pairs", as ? as->pairs : 0);
    kvr_jsonw_end(w);
}

static void sched_json(struct kvr_jsonw *w, const struct kvr_sched_stats *st)
{
    kvr_jsonw_obj(w);
    UINT_FIELD(w, "running", st->running);
    UINT_FIELD(w, "waiting", st->waiting);
    UINT_FIELD(w, "inflight", st->inflight);
    UINT_FIELD(w, "batches", st->batches);
    UINT_FIELD(w, "prompt_tokens", st->prompt_tokens);
    UINT_FIELD(w, "generated_tokens", st->generated_tokens);
    FRAC_FIELD(w, "tokens_per_s", st->tokens_per_s);
    FRAC_FIELD(w, "batch_ms", st->batch_ms_ema);
    KVR_JSONW_KEY(w, "kv_blocks");
    kvr_jsonw_obj(w);
    UINT_FIELD(w, "used", st->kv_blocks_used);
    UINT_FIELD(w, "cached", st->kv_blocks_cached);
    UINT_FIELD(w, "total", st->kv_blocks_total);
    kvr_jsonw_end(w);
    KVR_JSONW_KEY(w, "prefix_cache");
    kvr_jsonw_obj(w);
    UINT_FIELD(w, "queries", st->prefix_queries);
    UINT_FIELD(w, "hits", st->prefix_hits);
    UINT_FIELD(w, "evicted", st->prefix_evicted);
    kvr_jsonw_end(w);
    UINT_FIELD(w, "admitted", st->admitted);
    KVR_JSONW_KEY(w, "refused");
    kvr_jsonw_obj(w);
    for (int r = 0; r < KVR_REFUSE_REASON_COUNT; r++) {
        const char *name = kvr_telemetry_refusal_name((enum kvr_refusal_reason)r);
        if (name) {
            kvr_jsonw_key(w, name);
            kvr_jsonw_uint(w, st->refused[r]);
        }
    }
    kvr_jsonw_end(w);
    kvr_jsonw_end(w);
}

/* A stage's [held_ms, starved_ms, blocked_ms], built whole: a snapshot has up to 64 x 64. */
static void time_json(struct kvr_jsonw *w, const struct kvr_telemetry_time *tm)
{
    char buf[3 * 40 + 4], *p = buf;
    *p++ = '[';
    p = kvr_jsonw_fixed_text(p, ms_micros(tm->held_ns), 3);
    *p++ = ',';
    p = kvr_jsonw_fixed_text(p, ms_micros(tm->starved_ns), 3);
    *p++ = ',';
    p = kvr_jsonw_fixed_text(p, ms_micros(tm->blocked_ns), 3);
    *p++ = ']';
    kvr_jsonw_raw(w, buf, (size_t)(p - buf));
}

/* One sequence of a batch, built whole and placed as one value: sequences are the bulk of
 * a snapshot (up to 64 batches of 64), where the writer's per-value bookkeeping would be
 * most of its cost. The same text the field-by-field writer gives. */
static void seq_json(struct kvr_jsonw *w, const struct kvr_telemetry_seq *q)
{
    char buf[160], *p = buf;
    p = PUT_LIT(p, "{\"seq\":");
    p = kvr_jsonw_uint_text(p, q->seq);
    p = PUT_LIT(p, ",\"req\":");
    p = q->req_id ? kvr_jsonw_uint_text(p, q->req_id) : PUT_LIT(p, "null");
    p = PUT_LIT(p, ",\"kind\":\"");
    const char *kind = kvr_telemetry_kind_name(q->kind); /* plain ASCII, no escapes */
    size_t n = strlen(kind);
    memcpy(p, kind, n);
    p = PUT_LIT(p + n, "\",\"rows\":");
    p = kvr_jsonw_uint_text(p, q->n_rows);
    if (q->last_chunk)
        p = PUT_LIT(p, ",\"last\":true");
    *p++ = '}';
    kvr_jsonw_raw(w, buf, (size_t)(p - buf));
}

static void trace_json(struct kvr_jsonw *w, const struct kvr_telemetry_trace *tr)
{
    kvr_jsonw_obj(w);
    UINT_FIELD(w, "id", tr->batch_id);
    MS_FIELD(w, "sent_ms", tr->sent_ns);
    MS_FIELD(w, "returned_ms", tr->returned_ns);
    UINT_FIELD(w, "ctrl", tr->n_ctrl);
    UINT_FIELD(w, "prefill_rows", tr->n_rows_prefill);
    UINT_FIELD(w, "decode_rows", tr->n_rows_decode);
    KVR_JSONW_KEY(w, "seqs");
    kvr_jsonw_arr(w);
    for (uint32_t i = 0; i < tr->n_seqs; i++)
        seq_json(w, &tr->seqs[i]);
    kvr_jsonw_end(w);
    UINT_FIELD(w, "seqs_more", tr->n_seqs_more);
    KVR_JSONW_KEY(w, "stages");
    kvr_jsonw_arr(w);
    for (uint32_t i = 0; i < tr->n_stages; i++)
        time_json(w, &tr->stage[i]);
    kvr_jsonw_end(w);
    KVR_JSONW_KEY(w, "agents");
    kvr_jsonw_arr(w);
    for (uint32_t i = 0; i < tr->n_agents; i++) {
        const struct kvr_telemetry_time *tm = &tr->agent[i];
        kvr_jsonw_obj(w);
        UINT_FIELD(w, "agent", tm->agent);
        MS_FIELD(w, "held_ms", tm->held_ns);
        MS_FIELD(w, "starved_ms", tm->starved_ns);
        MS_FIELD(w, "blocked_ms", tm->blocked_ns);
        UINT_FIELD(w, "pairs", tm->pairs);
        kvr_jsonw_end(w);
    }
    kvr_jsonw_end(w);
    if (tr->n_agents_more)
        UINT_FIELD(w, "agents_more", tr->n_agents_more);
    kvr_jsonw_end(w);
}

static void event_json(struct kvr_jsonw *w, const struct kvr_telemetry_event *ev)
{
    kvr_jsonw_obj(w);
    MS_FIELD(w, "t_ms", ev->t_ns);
    STR_FIELD(w, "type", kvr_telemetry_event_name(ev->type));
    KVR_JSONW_KEY(w, "stage");
    if (ev->stage >= 0)
        kvr_jsonw_int(w, ev->stage);
    else
        kvr_jsonw_null(w);
    UINT_FIELD(w, "held", ev->n_held);
    if (ev->type == KVR_TELEMETRY_EV_RECOVERED)
        MS_FIELD(w, "outage_ms", ev->outage_ns);
    STR_FIELD(w, "why", ev->why); /* a message cut inside a character gets U+FFFD */
    kvr_jsonw_end(w);
}

/* Written straight into the buffer, not through a DOM: a page asks for up to ten of these
 * a second, each with up to 64 traces of 64 sequences. */
int kvr_telemetry_json(const struct kvr_telemetry_snapshot *sn, struct kvr_sbuf *out)
{
    const struct kvr_plan_summary *ps = &sn->plan;
    struct kvr_jsonw w;
    kvr_jsonw_init(&w, out);
    kvr_jsonw_obj(&w);
    UINT_FIELD(&w, "v", 1);
    MS_FIELD(&w, "t_ms", sn->now_ns);
    UINT_FIELD(&w, "interval_ms", sn->interval_ms);
    KVR_JSONW_KEY(&w, "ring");
    kvr_jsonw_obj(&w);
    KVR_JSONW_KEY(&w, "up");
    kvr_jsonw_bool(&w, sn->stats.ring_up);
    UINT_FIELD(&w, "epoch", ps->epoch);
    UINT_FIELD(&w, "row_width", ps->row_width);
    UINT_FIELD(&w, "microbatches", ps->microbatches);
    UINT_FIELD(&w, "max_seqs", ps->max_seqs);
    UINT_FIELD(&w, "n_ctx", ps->n_ctx);
    UINT_FIELD(&w, "kv_block_tokens", ps->kv_block_tokens);
    UINT_FIELD(&w, "kv_blocks", ps->kv_blocks);
    KVR_JSONW_KEY(&w, "stages");
    kvr_jsonw_arr(&w);
    for (uint32_t i = 0; i < ps->n_stages; i++)
        stage_json(&w, sn, i);
    kvr_jsonw_end(&w);
    KVR_JSONW_KEY(&w, "agents");
    kvr_jsonw_arr(&w);
    for (uint32_t i = 0; i < ps->n_agents; i++)
        agent_json(&w, sn, i);
    kvr_jsonw_end(&w);
    kvr_jsonw_end(&w);
    KVR_JSONW_KEY(&w, "sched");
    sched_json(&w, &sn->stats);
    KVR_JSONW_KEY(&w, "batches");
    kvr_jsonw_arr(&w);
    for (uint32_t i = 0; i < sn->n_traces; i++)
        trace_json(&w, &sn->traces[i]);
    kvr_jsonw_end(&w);
    UINT_FIELD(&w, "batches_missed", sn->traces_missed);
    KVR_JSONW_KEY(&w, "events");
    kvr_jsonw_arr(&w);
    for (uint32_t i = 0; i < sn->n_events; i++)
        event_json(&w, &sn->events[i]);
    kvr_jsonw_end(&w);
    UINT_FIELD(&w, "events_missed", sn->events_missed);
    kvr_jsonw_end(&w);
    if (w.depth != 0)
        out->failed = true;
    return out->failed ? KVR_ENOMEM : KVR_OK;
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
