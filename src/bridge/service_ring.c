#include "bridge/service_ring.h"

#include "core/clock.h"

/* The bridge's streams are the service's (bridge.h): only the server's default budgets are
 * added here; next, cancel and release are the bridge's own. */
static int ring_submit(void *ctx, const struct kvr_gen_request *req, struct kvr_gen_stream **out,
                       struct kvr_refusal *refusal)
{
    const struct kvr_ring_service *rs = ctx;
    struct kvr_gen_request br = *req;
    if (!br.first_token_ms)
        br.first_token_ms = rs->default_first_token_ms;
    if (!br.total_ms)
        br.total_ms = rs->default_total_ms;
    return kvr_bridge_submit(rs->bridge, &br, out, refusal);
}

/* GET /health and /readyz: the ring's state and each stage's, as the bridge sees it. */
static bool ring_health(void *ctx, json_t *detail)
{
    struct kvr_ring_service *rs = ctx;
    bool up = kvr_bridge_ring_up(rs->bridge);
    struct kvr_bridge_stage_state st[KVR_PLAN_MAX_STAGES];
    uint32_t n = kvr_bridge_stage_states(rs->bridge, st);
    uint64_t now = kvr_now_ns();
    json_t *stages = json_array();
    for (uint32_t i = 0; i < n; i++) {
        json_t *o = json_pack(
            "{s:i, s:s, s:[i,i], s:b, s:s, s:f}", "index", (int)i, "addr", st[i].addr, "layers",
            (int)st[i].first_layer, (int)st[i].last_layer, "up", st[i].state == KVR_STAGE_UP,
            "state", kvr_stage_state_name(st[i].state), "since_s", (now - st[i].since_ns) / 1e9);
        if (o && st[i].last_error[0])
            json_object_set_new(o, "last_error", json_string(st[i].last_error));
        json_array_append_new(stages, o);
    }
    json_object_set_new(detail, "ring", json_string(up ? "up" : "down"));
    json_object_set_new(detail, "stages", stages);
    return up;
}

static void gauge(struct kvr_sbuf *out, const char *name, const char *help, double v)
{
    kvr_sbuf_printf(out, "# HELP kvasir:%s %s\n# TYPE kvasir:%s gauge\nkvasir:%s %.9g\n", name,
                    help, name, name, v);
}

static void per_stage(struct kvr_sbuf *out, const struct kvr_sched_stats *st, const char *name,
                      const char *type, const char *help, int which)
{
    kvr_sbuf_printf(out, "# HELP kvasir:%s %s\n# TYPE kvasir:%s %s\n", name, help, name, type);
    for (uint32_t i = 0; i < st->n_stages; i++) {
        const struct kvr_sched_stage_stats *s = &st->stage[i];
        double v = which == 0   ? s->held_ns / 1e9
                   : which == 1 ? s->starved_ns / 1e9
                   : which == 2 ? s->blocked_ns / 1e9
                   : which == 3 ? s->util
                   : which == 4 ? s->starved_frac
                                : s->blocked_frac;
        kvr_sbuf_printf(out, "kvasir:%s{stage=\"%u\"} %.9g\n", name, i, v);
    }
}

/* The expert agents' load (docs/EXPERTS.md 2.5), when the plan has agents. */
static void per_agent(struct kvr_sbuf *out, const struct kvr_sched_stats *st)
{
    static const struct {
        const char *name, *help;
    } m[] = {
        {"expert_held_seconds_total", "Time each expert agent spent computing expert rows."},
        {"expert_starved_seconds_total", "Time each expert agent waited for rows to compute."},
        {"expert_blocked_seconds_total", "Time each expert agent spent sending its answers."},
        {"expert_pairs_total", "(row, expert) pairs each expert agent computed."},
    };
    for (uint32_t k = 0; st->n_agents && k < sizeof m / sizeof m[0]; k++) {
        kvr_sbuf_printf(out, "# HELP kvasir:%s %s\n# TYPE kvasir:%s counter\n", m[k].name,
                        m[k].help, m[k].name);
        for (uint32_t j = 0; j < st->n_agents && j < KVR_PLAN_MAX_AGENTS; j++) {
            const struct kvr_sched_agent_stats *a = &st->agent[j];
            double v = k == 0   ? a->held_ns / 1e9
                       : k == 1 ? a->starved_ns / 1e9
                       : k == 2 ? a->blocked_ns / 1e9
                                : (double)a->pairs;
            kvr_sbuf_printf(out, "kvasir:%s{agent=\"%u\"} %.9g\n", m[k].name, j, v);
        }
    }
}

static void ratio_hist(struct kvr_sbuf *out, const char *name, const char *help,
                       const uint64_t *hist, double sum)
{
    kvr_sbuf_printf(out, "# HELP kvasir:%s %s\n# TYPE kvasir:%s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (uint32_t i = 0; i < KVR_SCHED_RATIO_BUCKETS; i++) {
        cum += hist[i];
        kvr_sbuf_printf(out, "kvasir:%s_bucket{le=\"%g\"} %llu\n", name, kvr_sched_ratio_bounds[i],
                        (unsigned long long)cum);
    }
    cum += hist[KVR_SCHED_RATIO_BUCKETS];
    kvr_sbuf_printf(
        out, "kvasir:%s_bucket{le=\"+Inf\"} %llu\nkvasir:%s_sum %.9g\nkvasir:%s_count %llu\n", name,
        (unsigned long long)cum, name, sum, name, (unsigned long long)cum);
}

static long ring_reset_prefix_cache(void *ctx)
{
    struct kvr_ring_service *rs = ctx;
    return (long)kvr_bridge_flush_cache(rs->bridge);
}

/* The scheduler's refusals by reason (request.h), and whether a retry could help: "now"
 * (the load made it late, or the queue or ring was not ready) or "never" (the budget is
 * below what the idle ring takes, or the request needs more than the ring has). A total
 * budget refused to keep a running request on time has its own reason, running_late. */
static void refusals(struct kvr_sbuf *out, const struct kvr_sched_stats *st)
{
    static const char *const names[KVR_REFUSE_REASON_COUNT] = {
        [KVR_REFUSE_FIRST_TOKEN_BUDGET] = "first_token_budget",
        [KVR_REFUSE_TOTAL_BUDGET] = "total_budget",
        [KVR_REFUSE_KV_FULL] = "kv_full",
        [KVR_REFUSE_QUEUE_FULL] = "queue_full",
        [KVR_REFUSE_TOO_LONG] = "too_long",
        [KVR_REFUSE_RING_DOWN] = "ring_down",
        [KVR_REFUSE_INTERNAL] = "internal",
    };
    kvr_sbuf_puts(out, "# HELP kvasir:admission_refused_total Requests the scheduler refused, by "
                       "reason; when=\"never\" if no retry could succeed.\n"
                       "# TYPE kvasir:admission_refused_total counter\n");
    for (uint32_t r = 1; r < KVR_REFUSE_REASON_COUNT; r++) {
        uint64_t never = st->refused_never[r], now = st->refused[r] - never;
        if (r == KVR_REFUSE_TOTAL_BUDGET)
            now -= st->refused_for_running;
        kvr_sbuf_printf(out,
                        "kvasir:admission_refused_total{reason=\"%s\",when=\"now\"} %llu\n"
                        "kvasir:admission_refused_total{reason=\"%s\",when=\"never\"} %llu\n",
                        names[r], (unsigned long long)now, names[r], (unsigned long long)never);
    }
    kvr_sbuf_printf(out,
                    "kvasir:admission_refused_total{reason=\"running_late\",when=\"now\"} %llu\n",
                    (unsigned long long)st->refused_for_running);
}

/* Speculation's counters by draft source, named as vLLM's spec_decode_num_*. */
static void spec_metrics(struct kvr_sbuf *out, const struct kvr_sched_stats *st)
{
    static const struct {
        const char *name, *help;
    } m[3] = {{"spec_decode_num_drafts", "Decode rows that carried drafted tokens"},
              {"spec_decode_num_draft_tokens", "Drafted tokens sent through the ring"},
              {"spec_decode_num_accepted_tokens", "Drafted tokens the tail kept"}};
    const uint64_t *v[3] = {st->spec_steps, st->spec_drafted, st->spec_accepted};
    for (int i = 0; i < 3; i++) {
        kvr_sbuf_printf(out,
                        "# HELP kvasir:%s_total %s, by draft source.\n"
                        "# TYPE kvasir:%s_total counter\n",
                        m[i].name, m[i].help, m[i].name);
        for (uint32_t s = 0; s < KVR_DRAFT_SOURCE_COUNT; s++)
            kvr_sbuf_printf(out, "kvasir:%s_total{source=\"%s\"} %llu\n", m[i].name,
                            kvr_draft_source_name(s), (unsigned long long)v[i][s]);
    }
}

static void ring_metrics(void *ctx, struct kvr_sbuf *out)
{
    struct kvr_ring_service *rs = ctx;
    struct kvr_sched_stats st;
    kvr_bridge_stats(rs->bridge, &st);
    gauge(out, "ring_up", "1 when every link of the ring is up.", st.ring_up);
    gauge(out, "num_requests_running", "Requests holding a sequence slot.", st.running);
    gauge(out, "num_requests_waiting", "Admitted requests waiting for a slot.", st.waiting);
    gauge(out, "kv_blocks_used",
          "KV blocks running sequences use, per stage (a shared block "
          "once).",
          st.kv_blocks_used);
    gauge(out, "kv_blocks_cached",
          "KV blocks only the prefix cache holds (evicted least "
          "recently used when room is needed).",
          st.kv_blocks_cached);
    gauge(out, "kv_blocks_total", "KV blocks of each stage.", st.kv_blocks_total);
    gauge(out, "kv_cache_usage_perc",
          "Fraction of KV blocks running sequences use (cached "
          "blocks nobody uses count as free), as vLLM's.",
          st.kv_blocks_total ? (double)st.kv_blocks_used / st.kv_blocks_total : 0);
    /* Every stage maps the blocks the bridge names (DESIGN.md 12), so the layout is the
     * same on each; the label lets dashboards put it beside the stage's other series. */
    kvr_sbuf_puts(out, "# HELP kvasir:stage_kv_blocks_used KV blocks holding a sequence's or "
                       "the prefix cache's positions, per stage.\n"
                       "# TYPE kvasir:stage_kv_blocks_used gauge\n");
    for (uint32_t i = 0; i < st.n_stages; i++)
        kvr_sbuf_printf(out, "kvasir:stage_kv_blocks_used{stage=\"%u\"} %u\n", i,
                        st.kv_blocks_used + st.kv_blocks_cached);
    kvr_sbuf_printf(out,
                    "# HELP kvasir:prefix_cache_queries_total Prompt tokens looked up in "
                    "the prefix cache.\n# TYPE kvasir:prefix_cache_queries_total counter\n"
                    "kvasir:prefix_cache_queries_total %llu\n"
                    "# HELP kvasir:prefix_cache_hits_total Prompt tokens found there (not "
                    "computed).\n# TYPE kvasir:prefix_cache_hits_total counter\n"
                    "kvasir:prefix_cache_hits_total %llu\n"
                    "# HELP kvasir:prefix_cache_evictions_total Cached KV blocks evicted "
                    "to make room.\n# TYPE kvasir:prefix_cache_evictions_total counter\n"
                    "kvasir:prefix_cache_evictions_total %llu\n"
                    "# HELP kvasir:prompt_tokens_computed_total Prompt rows prefilled.\n"
                    "# TYPE kvasir:prompt_tokens_computed_total counter\n"
                    "kvasir:prompt_tokens_computed_total %llu\n",
                    (unsigned long long)st.prefix_queries, (unsigned long long)st.prefix_hits,
                    (unsigned long long)st.prefix_evicted, (unsigned long long)st.prompt_tokens);
    ratio_hist(out, "estimate_first_token_ratio",
               "Admission's first-token estimate / the "
               "time it took.",
               st.first_ratio_hist, st.first_ratio_sum);
    ratio_hist(out, "estimate_total_ratio",
               "Admission's estimate of the whole answer / the "
               "time it took.",
               st.total_ratio_hist, st.total_ratio_sum);
    gauge(out, "batch_latency_ms", "Moving average of a micro-batch's trip around the ring.",
          st.batch_ms_ema);
    gauge(out, "ring_tokens_per_second", "Tokens generated per second, last window.",
          st.tokens_per_s);
    kvr_sbuf_printf(out,
                    "# HELP kvasir:ring_batches_total Micro-batches completed.\n"
                    "# TYPE kvasir:ring_batches_total counter\n"
                    "kvasir:ring_batches_total %llu\n",
                    (unsigned long long)st.batches);
    kvr_sbuf_printf(out,
                    "# HELP kvasir:requests_admitted_total Requests admitted.\n"
                    "# TYPE kvasir:requests_admitted_total counter\n"
                    "kvasir:requests_admitted_total %llu\n",
                    (unsigned long long)st.admitted);
    refusals(out, &st);
    kvr_sbuf_puts(out, "# HELP kvasir:request_queue_time_seconds Time from admission to a "
                       "sequence slot.\n# TYPE kvasir:request_queue_time_seconds histogram\n");
    uint64_t cum = 0;
    for (uint32_t i = 0; i < KVR_SCHED_QUEUE_BUCKETS; i++) {
        cum += st.queue_hist[i];
        kvr_sbuf_printf(out, "kvasir:request_queue_time_seconds_bucket{le=\"%g\"} %llu\n",
                        kvr_sched_queue_bounds[i], (unsigned long long)cum);
    }
    cum += st.queue_hist[KVR_SCHED_QUEUE_BUCKETS];
    kvr_sbuf_printf(out,
                    "kvasir:request_queue_time_seconds_bucket{le=\"+Inf\"} %llu\n"
                    "kvasir:request_queue_time_seconds_sum %.9g\n"
                    "kvasir:request_queue_time_seconds_count %llu\n",
                    (unsigned long long)cum, st.queue_sum_s, (unsigned long long)st.queue_count);
    per_stage(out, &st, "stage_held_seconds_total", "counter",
              "Time each stage spent computing batches.", 0);
    per_stage(out, &st, "stage_starved_seconds_total", "counter",
              "Time each stage waited for its next batch.", 1);
    per_stage(out, &st, "stage_blocked_seconds_total", "counter",
              "Time each stage waited for its downstream to take a batch.", 2);
    per_stage(out, &st, "stage_utilization", "gauge",
              "Held fraction of the last window, per stage.", 3);
    per_stage(out, &st, "stage_starved_fraction", "gauge",
              "Starved fraction of the last window, per stage.", 4);
    per_stage(out, &st, "stage_blocked_fraction", "gauge",
              "Blocked fraction of the last window, per stage.", 5);
    per_agent(out, &st);
    spec_metrics(out, &st);
}

/* GET /v1/telemetry: the bridge's snapshot (telemetry.h). */
static void ring_telemetry(void *ctx, struct kvr_telemetry_reader *reader,
                           struct kvr_telemetry_snapshot *snap)
{
    struct kvr_ring_service *rs = ctx;
    kvr_bridge_telemetry(rs->bridge, reader, snap);
}

const struct kvr_service_ops kvr_ring_service_ops = {.submit = ring_submit,
                                                     .next = kvr_bridge_next,
                                                     .cancel = kvr_bridge_cancel,
                                                     .release = kvr_bridge_release,
                                                     .health = ring_health,
                                                     .metrics = ring_metrics,
                                                     .reset_prefix_cache = ring_reset_prefix_cache,
                                                     .estimate = kvr_bridge_estimate,
                                                     .telemetry = ring_telemetry,
                                                     .spec = kvr_bridge_spec};
