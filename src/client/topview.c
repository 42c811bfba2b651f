/* topview.c - `kvasir top`'s snapshot and frame (see topview.h). */
#include "client/topview.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BAR_WIDTH 16

static double metric(const struct kvr_prom *p, const char *name, const char *const *kv)
{
    char full[128];
    snprintf(full, sizeof full, "kvasir:%s", name);
    return kvr_prom_value(p, full, kv, NAN);
}

/* Sum of every sample of a counter, whatever its labels; NAN if there is none. */
static double metric_sum(const struct kvr_prom *p, const char *name)
{
    char full[128];
    snprintf(full, sizeof full, "kvasir:%s", name);
    double sum = 0;
    bool any = false;
    for (size_t i = 0; i < p->n_samples; i++)
        if (!strcmp(p->samples[i].name, full) && isfinite(p->samples[i].value)) {
            sum += p->samples[i].value;
            any = true;
        }
    return any ? sum : NAN;
}

/* The index in a sample's label `key` ("stage" or "agent"): a decimal below max, else -1. */
static long label_index(const struct kvr_prom_sample *x, const char *key, uint32_t max)
{
    const char *v = kvr_prom_label(x, key);
    char *end;
    unsigned long idx = v ? strtoul(v, &end, 10) : max;
    if (!v || end == v || *end || idx >= max)
        return -1;
    return (long)idx;
}

void kvr_top_read(const struct kvr_prom *p, struct kvr_top_snapshot *s)
{
    static const struct {
        const char *name;
        size_t off;
    } plain[] = {
#define F(name, field) {name, offsetof(struct kvr_top_snapshot, field)}
        F("ring_up", ring_up),
        F("num_requests_running", running),
        F("num_requests_waiting", waiting),
        F("http_generations_in_progress", in_progress),
        F("kv_blocks_used", kv_used),
        F("kv_blocks_total", kv_total),
        F("ring_tokens_per_second", tok_per_s),
        F("batch_latency_ms", batch_ms),
        F("requests_admitted_total", admitted),
        F("generation_tokens_total", generated),
        F("time_to_first_token_seconds_sum", ttft_sum),
        F("time_to_first_token_seconds_count", ttft_count),
        F("inter_token_latency_seconds_sum", itl_sum),
        F("inter_token_latency_seconds_count", itl_count),
        F("e2e_request_latency_seconds_sum", e2e_sum),
        F("e2e_request_latency_seconds_count", e2e_count),
#undef F
    };
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++)
        *(double *)(void *)((char *)s + plain[i].off) = metric(p, plain[i].name, NULL);
    s->refused = metric_sum(p, "request_refused_total");
    s->n_stages = s->n_agents = 0;
    for (uint32_t i = 0; i < KVR_TOP_MAX_STAGES; i++)
        s->held[i] = s->starved[i] = s->blocked[i] = NAN;
    for (uint32_t j = 0; j < KVR_TOP_MAX_AGENTS; j++)
        s->agent_held_s[j] = s->agent_starved_s[j] = s->agent_blocked_s[j] = s->agent_pairs[j] =
            NAN;
    for (size_t i = 0; i < p->n_samples; i++) {
        const struct kvr_prom_sample *x = &p->samples[i];
        const char *n = x->name;
        double *st = !strcmp(n, "kvasir:stage_utilization")        ? s->held
                     : !strcmp(n, "kvasir:stage_starved_fraction") ? s->starved
                     : !strcmp(n, "kvasir:stage_blocked_fraction") ? s->blocked
                                                                   : NULL;
        double *ag = !strcmp(n, "kvasir:expert_held_seconds_total")      ? s->agent_held_s
                     : !strcmp(n, "kvasir:expert_starved_seconds_total") ? s->agent_starved_s
                     : !strcmp(n, "kvasir:expert_blocked_seconds_total") ? s->agent_blocked_s
                     : !strcmp(n, "kvasir:expert_pairs_total")           ? s->agent_pairs
                                                                         : NULL;
        long idx;
        if (st && (idx = label_index(x, "stage", KVR_TOP_MAX_STAGES)) >= 0) {
            st[idx] = x->value;
            if ((uint32_t)idx + 1 > s->n_stages)
                s->n_stages = (uint32_t)idx + 1;
        } else if (ag && (idx = label_index(x, "agent", KVR_TOP_MAX_AGENTS)) >= 0) {
            ag[idx] = x->value;
            if ((uint32_t)idx + 1 > s->n_agents)
                s->n_agents = (uint32_t)idx + 1;
        }
    }
    s->n_reasons = 0;
    for (size_t i = 0; i < p->n_samples && s->n_reasons < KVR_TOP_MAX_REASONS; i++) {
        const struct kvr_prom_sample *x = &p->samples[i];
        const char *r =
            strcmp(x->name, "kvasir:request_refused_total") ? NULL : kvr_prom_label(x, "reason");
        if (!r)
            continue;
        snprintf(s->reason[s->n_reasons], sizeof s->reason[0], "%s", r);
        s->reason_n[s->n_reasons++] = x->value;
    }
}

/* ---- drawing ------------------------------------------------------------------------------- */

static void bar(struct kvr_sbuf *b, bool ansi, double frac, const char *color)
{
    if (isnan(frac)) {
        kvr_sbuf_printf(b, "[%*s]     -", BAR_WIDTH, "");
        return;
    }
    double f = frac < 0 ? 0 : frac > 1 ? 1 : frac;
    int fill = (int)(f * BAR_WIDTH + 0.5);
    kvr_sbuf_puts(b, "[");
    if (ansi && fill)
        kvr_sbuf_puts(b, color);
    for (int i = 0; i < fill; i++)
        kvr_sbuf_puts(b, "#");
    if (ansi && fill)
        kvr_sbuf_puts(b, "\033[0m");
    for (int i = fill; i < BAR_WIDTH; i++)
        kvr_sbuf_puts(b, ".");
    kvr_sbuf_printf(b, "] %5.1f%%", f * 100);
}

/* A number with `decimals` places and a unit suffix, or "-" when the server did not say. */
static void num(struct kvr_sbuf *b, int decimals, const char *suffix, double v)
{
    if (isnan(v))
        kvr_sbuf_puts(b, "-");
    else
        kvr_sbuf_printf(b, "%.*f%s", decimals, v, suffix);
}

/* Per-second rate of a counter between two polls, NAN when unknown or reset. */
static double rate(double now, double before, double dt_s)
{
    if (isnan(now) || isnan(before) || dt_s <= 0 || now < before)
        return NAN;
    return (now - before) / dt_s;
}

/* A counter, and its per-second rate since the last poll (before: its value then, NULL
 * before the second poll). */
static void count_rate(struct kvr_sbuf *b, double now, const double *before, double dt_s)
{
    num(b, 0, "", now);
    if (before) {
        kvr_sbuf_puts(b, " (");
        num(b, 1, "/s", rate(now, *before, dt_s));
        kvr_sbuf_puts(b, ")");
    }
}

/* Mean of a histogram over the last interval when it saw samples, else since start. */
static void mean_ms(struct kvr_sbuf *b, double sum, double count, double psum, double pcount,
                    bool have_prev)
{
    if (have_prev && !isnan(psum) && count > pcount && sum >= psum) {
        kvr_sbuf_printf(b, "%.1f ms", (sum - psum) / (count - pcount) * 1e3);
        return;
    }
    if (!isnan(count) && count > 0)
        kvr_sbuf_printf(b, "%.1f ms*", sum / count * 1e3);
    else
        kvr_sbuf_puts(b, "-");
}

/* End a line: with ANSI, also clear what a longer previous frame left on it. */
static void eol(struct kvr_sbuf *b, bool ansi)
{
    kvr_sbuf_puts(b, ansi ? "\033[K\n" : "\n");
}

/* A counter's share of the interval since the previous poll (a fraction of time when the
 * counter is in seconds); NAN when unknown. */
static double frac(const double *now, const double *before, uint32_t j, double dt_s)
{
    return before ? rate(now[j], before[j], dt_s) : NAN;
}

/* Per expert agent: its held, starved and blocked fractions of the last interval, its
 * pairs (and their rate) and its share of all agents' pairs. */
static void agents(struct kvr_sbuf *b, bool ansi, const struct kvr_top_snapshot *s,
                   const struct kvr_top_snapshot *prev, double dt)
{
    double total = 0;
    for (uint32_t j = 0; j < s->n_agents; j++)
        if (!isnan(s->agent_pairs[j]))
            total += s->agent_pairs[j];
    eol(b, ansi);
    kvr_sbuf_printf(b, "agent  %-*s  %-*s  %-*s  %s", BAR_WIDTH + 9, "held (busy)", BAR_WIDTH + 9,
                    "starved (no work)", BAR_WIDTH + 9, "blocked (sending)", "pairs");
    eol(b, ansi);
    for (uint32_t j = 0; j < s->n_agents; j++) {
        kvr_sbuf_printf(b, "%5u  ", j);
        bar(b, ansi, frac(s->agent_held_s, prev ? prev->agent_held_s : NULL, j, dt), "\033[32m");
        kvr_sbuf_puts(b, "  ");
        bar(b, ansi, frac(s->agent_starved_s, prev ? prev->agent_starved_s : NULL, j, dt),
            "\033[33m");
        kvr_sbuf_puts(b, "  ");
        bar(b, ansi, frac(s->agent_blocked_s, prev ? prev->agent_blocked_s : NULL, j, dt),
            "\033[31m");
        kvr_sbuf_puts(b, "  ");
        count_rate(b, s->agent_pairs[j], prev ? &prev->agent_pairs[j] : NULL, dt);
        kvr_sbuf_puts(b, "  share ");
        num(b, 1, "%",
            total > 0 && !isnan(s->agent_pairs[j]) ? s->agent_pairs[j] / total * 100 : NAN);
        eol(b, ansi);
    }
}

void kvr_top_render(struct kvr_sbuf *b, bool ansi, const char *url, const char *clock,
                    const struct kvr_top_snapshot *s, const struct kvr_top_snapshot *prev)
{
    bool have_prev = prev && prev->ok;
    double dt = have_prev ? (double)(s->t_ns - prev->t_ns) / 1e9 : 0;
    kvr_sbuf_printf(b, "kvasir top  %s  ", url);
    if (!s->ok) {
        const char *what = s->status == 401 ? "UNAUTHORIZED" : "UNREACHABLE";
        kvr_sbuf_printf(b, ansi ? "\033[1;31m%s\033[0m" : "%s", what);
        kvr_sbuf_printf(b, "  %s", clock);
        eol(b, ansi);
        kvr_sbuf_printf(b, "  %s", s->error);
        eol(b, ansi);
        return;
    }
    const char *ring = isnan(s->ring_up) ? "ring ?"
                       : s->ring_up >= 1 ? (ansi ? "ring \033[1;32mUP\033[0m" : "ring UP")
                                         : (ansi ? "ring \033[1;31mDOWN\033[0m" : "ring DOWN");
    kvr_sbuf_printf(b, "%s  %u stages", ring, s->n_stages);
    if (s->n_agents)
        kvr_sbuf_printf(b, "  %u expert agents", s->n_agents);
    kvr_sbuf_printf(b, "  %s", clock);
    eol(b, ansi);
    eol(b, ansi);

    kvr_sbuf_puts(b, "requests  running ");
    num(b, 0, "", s->running);
    kvr_sbuf_puts(b, "  waiting ");
    num(b, 0, "", s->waiting);
    kvr_sbuf_puts(b, "  in progress ");
    num(b, 0, "", s->in_progress);
    eol(b, ansi);
    kvr_sbuf_puts(b, "          admitted ");
    count_rate(b, s->admitted, have_prev ? &prev->admitted : NULL, dt);
    kvr_sbuf_puts(b, "  refused ");
    count_rate(b, s->refused, have_prev ? &prev->refused : NULL, dt);
    bool any = false;
    for (uint32_t i = 0; i < s->n_reasons; i++)
        if (s->reason_n[i] > 0) {
            kvr_sbuf_printf(b, "%s%s %.0f", any ? ", " : ": ", s->reason[i], s->reason_n[i]);
            any = true;
        }
    eol(b, ansi);

    kvr_sbuf_puts(b, "tokens    ");
    num(b, 1, " tok/s", s->tok_per_s);
    kvr_sbuf_puts(b, "  generated ");
    count_rate(b, s->generated, have_prev ? &prev->generated : NULL, dt);
    kvr_sbuf_puts(b, "  batch ");
    num(b, 2, " ms", s->batch_ms);
    eol(b, ansi);

    kvr_sbuf_puts(b, "KV cache  ");
    double kv = s->kv_total > 0 ? s->kv_used / s->kv_total : NAN;
    bar(b, ansi, kv, "\033[35m");
    kvr_sbuf_puts(b, "  ");
    num(b, 0, "", s->kv_used);
    kvr_sbuf_puts(b, " / ");
    num(b, 0, "", s->kv_total);
    kvr_sbuf_puts(b, " blocks");
    eol(b, ansi);

    kvr_sbuf_puts(b, "latency   TTFT ");
    mean_ms(b, s->ttft_sum, s->ttft_count, have_prev ? prev->ttft_sum : NAN,
            have_prev ? prev->ttft_count : NAN, have_prev);
    kvr_sbuf_puts(b, "  ITL ");
    mean_ms(b, s->itl_sum, s->itl_count, have_prev ? prev->itl_sum : NAN,
            have_prev ? prev->itl_count : NAN, have_prev);
    kvr_sbuf_puts(b, "  E2E ");
    mean_ms(b, s->e2e_sum, s->e2e_count, have_prev ? prev->e2e_sum : NAN,
            have_prev ? prev->e2e_count : NAN, have_prev);
    kvr_sbuf_puts(b, "  (means; * = since start)");
    eol(b, ansi);
    eol(b, ansi);

    kvr_sbuf_printf(b, "stage  %-*s  %-*s  %s", BAR_WIDTH + 9, "held (busy)", BAR_WIDTH + 9,
                    "starved (no work)", "blocked (downstream full)");
    eol(b, ansi);
    for (uint32_t i = 0; i < s->n_stages; i++) {
        kvr_sbuf_printf(b, "%5u  ", i);
        bar(b, ansi, s->held[i], "\033[32m");
        kvr_sbuf_puts(b, "  ");
        bar(b, ansi, s->starved[i], "\033[33m");
        kvr_sbuf_puts(b, "  ");
        bar(b, ansi, s->blocked[i], "\033[31m");
        eol(b, ansi);
    }
    if (s->n_stages == 0) {
        kvr_sbuf_puts(b, "  (no per-stage series in the metrics)");
        eol(b, ansi);
    }
    if (s->n_agents)
        agents(b, ansi, s, have_prev ? prev : NULL, dt);
}
