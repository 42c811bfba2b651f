/* top.c - `kvasir top`: a live terminal view of a running bridge, read from GET /metrics.
 *
 *   kvasir top [--url http://127.0.0.1:8080] [--interval 1]     redraws in place
 *   kvasir top --once                                             one plain snapshot
 *
 * Shows whether the ring is up, requests running / waiting, admitted and refused (with
 * rates between two polls), tokens per second, KV cache use, mean latencies over the last
 * interval, and for every stage bars of the fraction of time it was busy (held), waiting
 * for work (starved) and waiting for its downstream (blocked). Only the kvasir:* series it
 * knows are read; anything else in the metrics text is ignored, and a series that is
 * missing shows as "-". */
#include "cli/cmd.h"
#include "cli/common.h"

#include "client/httpc.h"
#include "client/promtext.h"
#include "bridge/sbuf.h"
#include "core/alloc.h"
#include "core/clock.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_STAGES 64
#define BAR_WIDTH 16

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

struct top_opts {
    const char *url, *api_key;
    double interval_s;
    uint32_t count; /* snapshots to show; 0 = until interrupted */
    bool once;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvasir top [options]\n"
               "  A live view of a running Kvasir server's ring, from its /metrics.\n"
               "  --url URL          server (default http://127.0.0.1:8080)\n"
               "  --api-key KEY      bearer key (default: env KVASIR_API_KEY)\n"
               "  --interval S       seconds between polls (default 1)\n"
               "  --count N          stop after N snapshots\n"
               "  --once             print one snapshot without terminal escapes and exit\n"
               "                     (exit status 1 if the server cannot be read)\n");
}

static int parse_opts(int argc, char **argv, struct top_opts *o)
{
    memset(o, 0, sizeof *o);
    o->url = "http://127.0.0.1:8080";
    o->api_key = getenv("KVASIR_API_KEY");
    o->interval_s = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--once")) {
            o->once = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "kvasir top: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--url")) {
            o->url = v;
        } else if (!strcmp(a, "--api-key")) {
            o->api_key = v;
        } else if (!strcmp(a, "--interval")) {
            float f;
            if (kvr_cli_float(a, v, 0.05f, 3600.0f, &f))
                return 2;
            o->interval_s = f;
        } else if (!strcmp(a, "--count")) {
            if (kvr_cli_u32(a, v, 1, 1u << 30, &o->count))
                return 2;
        } else {
            fprintf(stderr, "kvasir top: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (o->once)
        o->count = 1;
    return 0;
}

/* ---- one poll ------------------------------------------------------------------------------ */

/* What one poll read; NAN where the server did not say. */
struct snapshot {
    uint64_t t_ns;
    bool ok;
    char error[KVR_ERR_MSG_BYTES];
    double ring_up, running, waiting, in_progress, kv_used, kv_total, tok_per_s, batch_ms;
    double admitted, refused, generated;
    double ttft_sum, ttft_count, itl_sum, itl_count, e2e_sum, e2e_count;
    uint32_t n_stages;
    double held[MAX_STAGES], starved[MAX_STAGES], blocked[MAX_STAGES];
    /* refusals by reason, as the server labels them */
    char reason[8][32];
    double reason_n[8];
    uint32_t n_reasons;
};

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

static void read_snapshot(const struct kvr_prom *p, struct snapshot *s)
{
    s->ring_up = metric(p, "ring_up", NULL);
    s->running = metric(p, "num_requests_running", NULL);
    s->waiting = metric(p, "num_requests_waiting", NULL);
    s->in_progress = metric(p, "http_generations_in_progress", NULL);
    s->kv_used = metric(p, "kv_blocks_used", NULL);
    s->kv_total = metric(p, "kv_blocks_total", NULL);
    s->tok_per_s = metric(p, "ring_tokens_per_second", NULL);
    s->batch_ms = metric(p, "batch_latency_ms", NULL);
    s->admitted = metric(p, "requests_admitted_total", NULL);
    s->refused = metric_sum(p, "request_refused_total");
    s->generated = metric(p, "generation_tokens_total", NULL);
    s->ttft_sum = metric(p, "time_to_first_token_seconds_sum", NULL);
    s->ttft_count = metric(p, "time_to_first_token_seconds_count", NULL);
    s->itl_sum = metric(p, "inter_token_latency_seconds_sum", NULL);
    s->itl_count = metric(p, "inter_token_latency_seconds_count", NULL);
    s->e2e_sum = metric(p, "e2e_request_latency_seconds_sum", NULL);
    s->e2e_count = metric(p, "e2e_request_latency_seconds_count", NULL);
    s->n_stages = 0;
    for (uint32_t i = 0; i < MAX_STAGES; i++)
        s->held[i] = s->starved[i] = s->blocked[i] = NAN;
    for (size_t i = 0; i < p->n_samples; i++) {
        const struct kvr_prom_sample *x = &p->samples[i];
        double *dst = !strcmp(x->name, "kvasir:stage_utilization")        ? s->held
                      : !strcmp(x->name, "kvasir:stage_starved_fraction") ? s->starved
                      : !strcmp(x->name, "kvasir:stage_blocked_fraction") ? s->blocked
                                                                          : NULL;
        const char *st = dst ? kvr_prom_label(x, "stage") : NULL;
        char *end;
        unsigned long idx = st ? strtoul(st, &end, 10) : MAX_STAGES;
        if (!dst || !st || *end || end == st || idx >= MAX_STAGES)
            continue;
        dst[idx] = x->value;
        if (idx + 1 > s->n_stages)
            s->n_stages = (uint32_t)idx + 1;
    }
    s->n_reasons = 0;
    for (size_t i = 0; i < p->n_samples && s->n_reasons < 8; i++) {
        const struct kvr_prom_sample *x = &p->samples[i];
        const char *r =
            strcmp(x->name, "kvasir:request_refused_total") ? NULL : kvr_prom_label(x, "reason");
        if (!r)
            continue;
        snprintf(s->reason[s->n_reasons], sizeof s->reason[0], "%s", r);
        s->reason_n[s->n_reasons++] = x->value;
    }
}

static void poll_once(const struct top_opts *o, const struct kvr_httpc_url *u, struct snapshot *s)
{
    memset(s, 0, sizeof *s);
    s->t_ns = kvr_now_ns();
    struct kvr_httpc_resp resp;
    struct kvr_err err = {0};
    uint32_t timeout_ms = o->interval_s * 1000 > 5000 ? (uint32_t)(o->interval_s * 1000) : 5000;
    int rc = kvr_httpc_get(u, "/metrics", o->api_key, timeout_ms, &resp, &err);
    if (rc) {
        snprintf(s->error, sizeof s->error, "%s", err.msg);
    } else if (resp.status != 200) {
        snprintf(s->error, sizeof s->error, "GET /metrics answered %d", resp.status);
    } else {
        struct kvr_prom p;
        if (kvr_prom_parse(&p, resp.body ? resp.body : "", resp.body_len) == 0) {
            read_snapshot(&p, s);
            s->ok = true;
        } else {
            snprintf(s->error, sizeof s->error, "out of memory reading the metrics");
        }
        kvr_prom_fini(&p);
    }
    kvr_httpc_resp_fini(&resp);
}

/* ---- drawing ------------------------------------------------------------------------------- */

struct style {
    bool ansi;
};

static void bar(struct kvr_sbuf *b, const struct style *st, double frac, const char *color)
{
    if (isnan(frac)) {
        kvr_sbuf_printf(b, "[%*s]     -", BAR_WIDTH, "");
        return;
    }
    double f = frac < 0 ? 0 : frac > 1 ? 1 : frac;
    int fill = (int)(f * BAR_WIDTH + 0.5);
    kvr_sbuf_puts(b, "[");
    if (st->ansi && fill)
        kvr_sbuf_puts(b, color);
    for (int i = 0; i < fill; i++)
        kvr_sbuf_puts(b, "#");
    if (st->ansi && fill)
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
static void eol(struct kvr_sbuf *b, const struct style *st)
{
    kvr_sbuf_puts(b, st->ansi ? "\033[K\n" : "\n");
}

static void render(struct kvr_sbuf *b, const struct style *st, const struct top_opts *o,
                   const struct snapshot *s, const struct snapshot *prev)
{
    bool have_prev = prev && prev->ok;
    double dt = have_prev ? (double)(s->t_ns - prev->t_ns) / 1e9 : 0;
    char clock[16];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(clock, sizeof clock, "%H:%M:%S", &tm);
    kvr_sbuf_printf(b, "kvasir top  %s  ", o->url);
    if (!s->ok) {
        kvr_sbuf_printf(b, "%s", st->ansi ? "\033[1;31mUNREACHABLE\033[0m" : "UNREACHABLE");
        kvr_sbuf_printf(b, "  %s", clock);
        eol(b, st);
        kvr_sbuf_printf(b, "  %s", s->error);
        eol(b, st);
        return;
    }
    const char *ring = isnan(s->ring_up) ? "ring ?"
                       : s->ring_up >= 1 ? (st->ansi ? "ring \033[1;32mUP\033[0m" : "ring UP")
                                         : (st->ansi ? "ring \033[1;31mDOWN\033[0m" : "ring DOWN");
    kvr_sbuf_printf(b, "%s  %u stages  %s", ring, s->n_stages, clock);
    eol(b, st);
    eol(b, st);

    kvr_sbuf_puts(b, "requests  running ");
    num(b, 0, "", s->running);
    kvr_sbuf_puts(b, "  waiting ");
    num(b, 0, "", s->waiting);
    kvr_sbuf_puts(b, "  in progress ");
    num(b, 0, "", s->in_progress);
    eol(b, st);
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
    eol(b, st);

    kvr_sbuf_puts(b, "tokens    ");
    num(b, 1, " tok/s", s->tok_per_s);
    kvr_sbuf_puts(b, "  generated ");
    count_rate(b, s->generated, have_prev ? &prev->generated : NULL, dt);
    kvr_sbuf_puts(b, "  batch ");
    num(b, 2, " ms", s->batch_ms);
    eol(b, st);

    kvr_sbuf_puts(b, "KV cache  ");
    double kv = s->kv_total > 0 ? s->kv_used / s->kv_total : NAN;
    bar(b, st, kv, "\033[35m");
    kvr_sbuf_puts(b, "  ");
    num(b, 0, "", s->kv_used);
    kvr_sbuf_puts(b, " / ");
    num(b, 0, "", s->kv_total);
    kvr_sbuf_puts(b, " blocks");
    eol(b, st);

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
    eol(b, st);
    eol(b, st);

    kvr_sbuf_printf(b, "stage  %-*s  %-*s  %s", BAR_WIDTH + 9, "held (busy)", BAR_WIDTH + 9,
                    "starved (no work)", "blocked (downstream full)");
    eol(b, st);
    for (uint32_t i = 0; i < s->n_stages; i++) {
        kvr_sbuf_printf(b, "%5u  ", i);
        bar(b, st, s->held[i], "\033[32m");
        kvr_sbuf_puts(b, "  ");
        bar(b, st, s->starved[i], "\033[33m");
        kvr_sbuf_puts(b, "  ");
        bar(b, st, s->blocked[i], "\033[31m");
        eol(b, st);
    }
    if (s->n_stages == 0) {
        kvr_sbuf_puts(b, "  (no per-stage series in the metrics)");
        eol(b, st);
    }
}

/* ---- the command --------------------------------------------------------------------------- */

int kvr_cmd_top(int argc, char **argv)
{
    struct top_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    struct kvr_httpc_url u;
    struct kvr_err err = {0};
    if (kvr_httpc_url_parse(&u, o.url, &err)) {
        fprintf(stderr, "kvasir top: --url: %s\n", err.msg);
        return 2;
    }
    kvr_cli_on_stop(on_signal);

    struct style st = {.ansi = !o.once && isatty(STDOUT_FILENO)};
    struct snapshot *both = kvr_calloc(2, sizeof *both);
    if (!both)
        return 1;
    struct snapshot *cur = &both[0], *prev = &both[1];
    uint64_t last_poll_ns = 0;
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    if (st.ansi) /* the alternate screen, without a cursor, restored on the way out */
        fputs("\033[?1049h\033[?25l", stdout);
    rc = 0;
    for (uint32_t n = 0; !stop_flag && (o.count == 0 || n < o.count); n++) {
        if (n > 0) {
            uint64_t until = last_poll_ns + (uint64_t)(o.interval_s * 1e9);
            for (uint64_t t = kvr_now_ns(); t < until && !stop_flag; t = kvr_now_ns())
                kvr_sleep_ns(until - t < 50000000ull ? until - t : 50000000ull);
            if (stop_flag)
                break;
        }
        poll_once(&o, &u, cur);
        last_poll_ns = cur->t_ns;
        kvr_sbuf_clear(&b);
        if (st.ansi)
            kvr_sbuf_puts(&b, "\033[H");
        else if (n > 0)
            kvr_sbuf_puts(&b, "\n");
        render(&b, &st, &o, cur, n > 0 ? prev : NULL);
        if (st.ansi)
            kvr_sbuf_puts(&b, "\033[J");
        if (!b.failed)
            fwrite(b.data, 1, b.len, stdout);
        fflush(stdout);
        if (o.once && !cur->ok)
            rc = 1;
        if (cur->ok) { /* rates are taken against the last good poll */
            struct snapshot *t = prev;
            prev = cur;
            cur = t;
        }
    }
    if (st.ansi)
        fputs("\033[?25h\033[?1049l", stdout);
    fflush(stdout);
    kvr_sbuf_fini(&b);
    kvr_free(both);
    return rc;
}
