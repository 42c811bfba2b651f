/* loadgen.c - schedules, statistics and SVG plots for `kvasir bench` (see loadgen.h). */
#include "client/loadgen.h"

#include "core/rng.h"

#include "core/alloc.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- generator ------------------------------------------------------------------------ */

void kvr_lg_rng_seed(struct kvr_lg_rng *r, uint64_t seed)
{
    kvr_xoshiro_seed(r->s, seed);
}

uint64_t kvr_lg_rng_next(struct kvr_lg_rng *r)
{
    return kvr_xoshiro_next(r->s);
}

double kvr_lg_rng_uniform(struct kvr_lg_rng *r)
{
    /* 53 random bits, shifted by half a step so neither 0 nor 1 can come out (log(0) and
     * pow(0, ..) below would otherwise need special cases). */
    return ((double)(kvr_lg_rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

uint32_t kvr_lg_rng_range(struct kvr_lg_rng *r, uint32_t lo, uint32_t hi)
{
    uint64_t span = (uint64_t)hi - lo + 1;
    /* The modulo bias is below 2^-32 for spans under 2^32: irrelevant for prompt lengths. */
    return lo + (uint32_t)(kvr_lg_rng_next(r) % span);
}

static double normal(struct kvr_lg_rng *r)
{
    /* Box-Muller; the second variate of the pair is dropped to keep the state simple. */
    double u1 = kvr_lg_rng_uniform(r), u2 = kvr_lg_rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

double kvr_lg_gamma(struct kvr_lg_rng *r, double shape, double scale)
{
    if (shape < 1.0) {
        /* Gamma(a) = Gamma(a + 1) * U^(1/a) (Marsaglia and Tsang, section 6). */
        double u = kvr_lg_rng_uniform(r);
        return kvr_lg_gamma(r, shape + 1.0, scale) * pow(u, 1.0 / shape);
    }
    double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = normal(r), v = 1.0 + c * x;
        if (v <= 0.0)
            continue;
        v = v * v * v;
        double u = kvr_lg_rng_uniform(r);
        if (u < 1.0 - 0.0331 * x * x * x * x)
            return d * v * scale;
        if (log(u) < 0.5 * x * x + d * (1.0 - v + log(v)))
            return d * v * scale;
    }
}

/* ---- arrival schedules ---------------------------------------------------------------- */

int kvr_lg_schedule(const struct kvr_lg_schedule_spec *spec, double **arrivals_s, size_t *n,
                    struct kvr_err *err)
{
    *arrivals_s = NULL;
    *n = 0;
    bool inf = isinf(spec->rate_per_s) && spec->rate_per_s > 0;
    if (!(spec->rate_per_s > 0) || isnan(spec->rate_per_s))
        return kvr_err_set(err, KVR_EINVAL, "request rate must be > 0, got %g", spec->rate_per_s);
    if (!(spec->burstiness > 0) || !isfinite(spec->burstiness))
        return kvr_err_set(err, KVR_EINVAL, "burstiness must be > 0, got %g", spec->burstiness);
    if (!(spec->duration_s >= 0) || !isfinite(spec->duration_s))
        return kvr_err_set(err, KVR_EINVAL, "duration must be >= 0 s, got %g", spec->duration_s);
    if (spec->max_requests == 0 && (spec->duration_s == 0 || inf))
        return kvr_err_set(err, KVR_EINVAL,
                           "an unbounded run: give a request count (or a finite rate and a "
                           "duration)");
    size_t cap = spec->max_requests;
    if (cap == 0) {
        /* Expected count plus a wide margin; grown below if the draw exceeds it. */
        double want = spec->rate_per_s * spec->duration_s * 1.2 + 64;
        cap = want > KVR_LG_MAX_REQUESTS ? KVR_LG_MAX_REQUESTS : (size_t)want;
    }
    if (cap > KVR_LG_MAX_REQUESTS)
        return kvr_err_set(err, KVR_ERANGE, "%zu requests is more than the %u allowed", cap,
                           KVR_LG_MAX_REQUESTS);
    double *a = kvr_malloc(cap * sizeof *a);
    if (!a)
        return kvr_err_set(err, KVR_ENOMEM, "out of memory for %zu arrivals", cap);
    struct kvr_lg_rng rng;
    kvr_lg_rng_seed(&rng, spec->seed);
    double t = 0, scale = inf ? 0 : 1.0 / (spec->rate_per_s * spec->burstiness);
    size_t count = 0;
    for (;;) {
        if (spec->max_requests && count == spec->max_requests)
            break;
        if (spec->duration_s > 0 && t >= spec->duration_s)
            break;
        if (count == cap) {
            if (cap == KVR_LG_MAX_REQUESTS) {
                kvr_free(a);
                return kvr_err_set(err, KVR_ERANGE,
                                   "the schedule needs more than %u requests; lower the rate "
                                   "or the duration",
                                   KVR_LG_MAX_REQUESTS);
            }
            size_t ncap = cap * 2 > KVR_LG_MAX_REQUESTS ? KVR_LG_MAX_REQUESTS : cap * 2;
            double *na = kvr_realloc(a, ncap * sizeof *na);
            if (!na) {
                kvr_free(a);
                return kvr_err_set(err, KVR_ENOMEM, "out of memory for %zu arrivals", ncap);
            }
            a = na;
            cap = ncap;
        }
        a[count++] = t;
        if (!inf)
            t += kvr_lg_gamma(&rng, spec->burstiness, scale);
    }
    *arrivals_s = a;
    *n = count;
    return 0;
}

/* ---- lengths and option lists --------------------------------------------------------- */

static int parse_u32(const char *s, const char *end, uint32_t *out)
{
    if (s == end || *s < '0' || *s > '9')
        return -1;
    uint64_t v = 0;
    for (; s < end; s++) {
        if (*s < '0' || *s > '9')
            return -1;
        v = v * 10 + (uint64_t)(*s - '0');
        if (v > UINT32_MAX)
            return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

int kvr_lg_range_parse(struct kvr_lg_range *out, const char *s, uint32_t max, struct kvr_err *err)
{
    const char *colon = strchr(s, ':'), *end = s + strlen(s);
    uint32_t lo, hi;
    if (colon) {
        if (parse_u32(s, colon, &lo) || parse_u32(colon + 1, end, &hi))
            return kvr_err_set(err, KVR_EINVAL, "'%s' is not N or LO:HI", s);
    } else {
        if (parse_u32(s, end, &lo))
            return kvr_err_set(err, KVR_EINVAL, "'%s' is not N or LO:HI", s);
        hi = lo;
    }
    if (lo < 1 || lo > hi || hi > max)
        return kvr_err_set(err, KVR_ERANGE, "'%s': need 1 <= LO <= HI <= %u", s, max);
    out->lo = lo;
    out->hi = hi;
    return 0;
}

uint32_t kvr_lg_range_draw(const struct kvr_lg_range *r, struct kvr_lg_rng *rng)
{
    return r->lo == r->hi ? r->lo : kvr_lg_rng_range(rng, r->lo, r->hi);
}

int kvr_lg_parse_rates(const char *s, double *out, size_t cap, struct kvr_err *err)
{
    size_t n = 0;
    const char *p = s;
    for (;;) {
        char *end;
        errno = 0;
        double v = strtod(p, &end);
        if (end == p || errno || !isfinite(v) || v <= 0 || (*end && *end != ','))
            return kvr_err_set(err, KVR_EINVAL, "'%s' is not a list of rates > 0 like 1,2,4", s);
        if (n == cap)
            return kvr_err_set(err, KVR_ERANGE, "more than %zu rates in '%s'", cap, s);
        out[n++] = v;
        if (!*end)
            break;
        p = end + 1;
    }
    return (int)n;
}

/* ---- statistics ----------------------------------------------------------------------- */

double kvr_lg_percentile(const double *sorted, size_t n, double p)
{
    if (n == 0)
        return NAN;
    if (p <= 0)
        return sorted[0];
    if (p >= 100)
        return sorted[n - 1];
    double rank = p / 100.0 * (double)(n - 1);
    size_t i = (size_t)rank;
    double frac = rank - (double)i;
    if (i + 1 >= n)
        return sorted[n - 1];
    return sorted[i] + (sorted[i + 1] - sorted[i]) * frac;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void kvr_lg_summarize(double *v, size_t n, struct kvr_lg_summary *out)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (!isnan(v[i]))
            v[m++] = v[i];
    out->n = m;
    if (m == 0) {
        out->mean = out->min = out->p50 = out->p90 = out->p99 = out->max = NAN;
        return;
    }
    qsort(v, m, sizeof *v, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < m; i++)
        sum += v[i];
    out->mean = sum / (double)m;
    out->min = v[0];
    out->max = v[m - 1];
    out->p50 = kvr_lg_percentile(v, m, 50);
    out->p90 = kvr_lg_percentile(v, m, 90);
    out->p99 = kvr_lg_percentile(v, m, 99);
}

/* ---- per-request records and the run's result ----------------------------------------- */

const char *kvr_lg_outcome_name(enum kvr_lg_outcome o)
{
    static const char *const names[KVR_LG_OUTCOME_COUNT] = {"ok", "refused", "error", "timeout"};
    return (unsigned)o < KVR_LG_OUTCOME_COUNT ? names[o] : "?";
}

/* Count (status, reason) in a small table; the last slot collects whatever does not fit. */
static void count_reason(struct kvr_lg_reason_count *t, size_t *n, int status, const char *reason)
{
    for (size_t i = 0; i < *n; i++)
        if (t[i].http_status == status && !strcmp(t[i].reason, reason)) {
            t[i].n++;
            return;
        }
    if (*n < KVR_LG_MAX_REASONS) {
        t[*n].http_status = status;
        snprintf(t[*n].reason, sizeof t[*n].reason, "%s", reason);
        t[*n].n = 1;
        (*n)++;
        return;
    }
    struct kvr_lg_reason_count *last = &t[KVR_LG_MAX_REASONS - 1];
    last->http_status = 0;
    snprintf(last->reason, sizeof last->reason, "other");
    last->n++;
}

static int cmp_reason(const void *a, const void *b)
{
    const struct kvr_lg_reason_count *x = a, *y = b;
    if (x->n != y->n)
        return x->n < y->n ? 1 : -1;
    if (x->http_status != y->http_status)
        return x->http_status - y->http_status;
    return strcmp(x->reason, y->reason);
}

int kvr_lg_aggregate(struct kvr_lg_record *rec, size_t n, double duration_s, double ttft_budget_s,
                     double total_budget_s, struct kvr_lg_result *out)
{
    memset(out, 0, sizeof *out);
    out->n_total = n;
    out->duration_s = duration_s;
    size_t n_itl = 0;
    for (size_t i = 0; i < n; i++)
        if (rec[i].outcome == KVR_LG_OK && !kvr_add_size(n_itl, rec[i].n_itl, &n_itl))
            return KVR_ENOMEM;
    size_t per = n ? n : 1, itl_bytes;
    if (!kvr_mul_size(n_itl ? n_itl : 1, sizeof(double), &itl_bytes))
        return KVR_ENOMEM;
    double *ttft = kvr_malloc(per * sizeof *ttft), *tpot = kvr_malloc(per * sizeof *tpot);
    double *e2e = kvr_malloc(per * sizeof *e2e), *ref = kvr_malloc(per * sizeof *ref);
    double *itl = kvr_malloc(itl_bytes);
    int rc = KVR_ENOMEM;
    if (!ttft || !tpot || !e2e || !ref || !itl)
        goto free_all;
    size_t n_ok = 0, n_ref = 0, k = 0;
    for (size_t i = 0; i < n; i++) {
        struct kvr_lg_record *r = &rec[i];
        r->met_budget = false;
        out->n_outcome[r->outcome < KVR_LG_OUTCOME_COUNT ? r->outcome : KVR_LG_ERROR]++;
        if (r->outcome == KVR_LG_REFUSED) {
            count_reason(out->refused, &out->n_refused_reasons, r->http_status, r->reason);
            ref[n_ref++] = r->response_s;
            if (r->response_s > KVR_LG_REFUSAL_LIMIT_S)
                out->n_refusal_over_limit++;
            continue;
        }
        if (r->outcome != KVR_LG_OK) {
            count_reason(out->errors, &out->n_error_reasons, r->http_status, r->reason);
            continue;
        }
        ttft[n_ok] = r->ttft_s;
        e2e[n_ok] = r->e2e_s;
        tpot[n_ok] = r->output_tokens > 1 && !isnan(r->ttft_s)
                         ? (r->e2e_s - r->ttft_s) / (double)(r->output_tokens - 1)
                         : NAN;
        n_ok++;
        for (uint32_t j = 0; j < r->n_itl; j++)
            itl[k++] = r->itl_s[j];
        out->prompt_tokens += r->prompt_tokens;
        out->output_tokens += r->output_tokens;
        r->met_budget = !isnan(r->ttft_s) && (ttft_budget_s <= 0 || r->ttft_s <= ttft_budget_s) &&
                        (total_budget_s <= 0 || r->e2e_s <= total_budget_s);
        if (r->met_budget)
            out->n_met_budget++;
    }
    kvr_lg_summarize(ttft, n_ok, &out->ttft_s);
    kvr_lg_summarize(tpot, n_ok, &out->tpot_s);
    kvr_lg_summarize(e2e, n_ok, &out->e2e_s);
    kvr_lg_summarize(itl, k, &out->itl_s);
    kvr_lg_summarize(ref, n_ref, &out->refusal_s);
    qsort(out->refused, out->n_refused_reasons, sizeof out->refused[0], cmp_reason);
    qsort(out->errors, out->n_error_reasons, sizeof out->errors[0], cmp_reason);
    if (duration_s > 0) {
        out->req_per_s = (double)n_ok / duration_s;
        out->output_tok_per_s = (double)out->output_tokens / duration_s;
        out->total_tok_per_s = (double)(out->prompt_tokens + out->output_tokens) / duration_s;
        out->goodput_req_per_s = (double)out->n_met_budget / duration_s;
    }
    rc = 0;
free_all:
    kvr_free(ttft);
    kvr_free(tpot);
    kvr_free(e2e);
    kvr_free(ref);
    kvr_free(itl);
    return rc;
}

/* ---- SVG line plots ------------------------------------------------------------------- */

size_t kvr_lg_nice_ticks(double lo, double hi, size_t max_ticks, double *ticks, size_t cap)
{
    if (!isfinite(lo) || !isfinite(hi) || cap == 0)
        return 0;
    if (hi < lo) {
        double t = lo;
        lo = hi;
        hi = t;
    }
    if (hi == lo) {
        double pad = lo == 0 ? 1 : fabs(lo) * 0.5;
        lo -= pad;
        hi += pad;
    }
    if (max_ticks < 2)
        max_ticks = 2;
    double raw = (hi - lo) / (double)(max_ticks - 1);
    double e = floor(log10(raw)), mag = pow(10, e), norm = raw / mag;
    double mult = norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10, step = mult * mag;
    /* Tick k is k * mult * 10^e. For e < 0 it is computed as (k * mult) / 10^-e: both are
     * exact integers, so the quotient is the double nearest the decimal value and labels
     * print as 0.3 rather than 0.30000000000000004. */
    double k0 = floor(lo / step + 1e-9);
    size_t n = 0;
    while (n < cap) {
        double k = k0 + (double)n;
        double t = e < 0 ? k * mult / pow(10, -e) : k * mult * mag;
        ticks[n++] = t == 0 ? 0 : t; /* no "-0" */
        if (t >= hi - step * 1e-9)
            break;
    }
    return n;
}

/* Geometry of one panel, in SVG user units. */
enum {
    SVG_WIDTH = 800,
    PANEL_HEIGHT = 320,
    TITLE_HEIGHT = 36,
    SUBTITLE_HEIGHT = 18,
    MARGIN_LEFT = 78,
    MARGIN_RIGHT = 200, /* room for the legend */
    MARGIN_TOP = 34,
    MARGIN_BOTTOM = 52,
    MAX_TICKS = 16,
};

static void put_escaped(struct kvr_sbuf *out, const char *s)
{
    for (; s && *s; s++) {
        switch (*s) {
        case '<':
            kvr_sbuf_puts(out, "&lt;");
            break;
        case '>':
            kvr_sbuf_puts(out, "&gt;");
            break;
        case '&':
            kvr_sbuf_puts(out, "&amp;");
            break;
        case '"':
            kvr_sbuf_puts(out, "&quot;");
            break;
        case '\'':
            kvr_sbuf_puts(out, "&apos;");
            break;
        default:
            /* Control characters are not allowed in XML 1.0 text. */
            if ((unsigned char)*s >= 0x20 || *s == '\t' || *s == '\n')
                kvr_sbuf_append(out, s, 1);
        }
    }
}

/* An axis maps data values onto a pixel span; a log axis works on log10 of the value. */
struct axis {
    bool log;
    double lo, hi; /* data range after rounding to ticks (log10 for a log axis) */
    double ticks[MAX_TICKS * 3];
    size_t n_ticks;  /* tick values in data units */
    double px0, px1; /* pixel positions of lo and hi */
};

static double axis_map(const struct axis *a, double v)
{
    double t = a->log ? log10(v) : v;
    return a->px0 + (t - a->lo) / (a->hi - a->lo) * (a->px1 - a->px0);
}

static bool usable(const struct axis *a, double v)
{
    return isfinite(v) && (!a->log || v > 0);
}

static void axis_fit(struct axis *a, double lo, double hi, bool log_axis, bool from_zero)
{
    a->log = log_axis;
    if (!(lo <= hi)) { /* no data */
        lo = log_axis ? 1 : 0;
        hi = log_axis ? 10 : 1;
    }
    if (log_axis) {
        double d0 = floor(log10(lo)), d1 = ceil(log10(hi));
        if (d1 <= d0)
            d1 = d0 + 1;
        a->n_ticks = 0;
        bool minor = d1 - d0 <= 2; /* few decades: also label 2x and 5x */
        for (double d = d0; d <= d1 && a->n_ticks + 3 <= sizeof a->ticks / sizeof a->ticks[0];
             d++) {
            double base = pow(10, d);
            a->ticks[a->n_ticks++] = base;
            if (minor && d < d1) {
                a->ticks[a->n_ticks++] = 2 * base;
                a->ticks[a->n_ticks++] = 5 * base;
            }
        }
        a->lo = d0;
        a->hi = d1;
        return;
    }
    if (from_zero && lo > 0)
        lo = 0;
    a->n_ticks = kvr_lg_nice_ticks(lo, hi, 8, a->ticks, MAX_TICKS);
    a->lo = a->ticks[0];
    a->hi = a->ticks[a->n_ticks - 1];
    if (a->hi <= a->lo)
        a->hi = a->lo + 1;
}

static void fmt_tick(char *buf, size_t cap, double v)
{
    if (v != 0 && (fabs(v) >= 1e6 || fabs(v) < 1e-3))
        snprintf(buf, cap, "%.0e", v);
    else
        snprintf(buf, cap, "%.6g", v);
}

static void write_panel(struct kvr_sbuf *out, const struct kvr_svg_panel *p, double top)
{
    double x0 = MARGIN_LEFT, x1 = SVG_WIDTH - MARGIN_RIGHT;
    double y0 = top + PANEL_HEIGHT - MARGIN_BOTTOM, y1 = top + MARGIN_TOP;
    struct axis ax = {0}, ay = {0};
    double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
    for (size_t s = 0; s < p->n_series; s++) {
        const struct kvr_svg_series *se = &p->series[s];
        for (size_t i = 0; i < se->n; i++) {
            if (!isfinite(se->x[i]) || !isfinite(se->y[i]) || (p->log_y && se->y[i] <= 0))
                continue;
            xlo = fmin(xlo, se->x[i]);
            xhi = fmax(xhi, se->x[i]);
            ylo = fmin(ylo, se->y[i]);
            yhi = fmax(yhi, se->y[i]);
        }
    }
    axis_fit(&ax, xlo, xhi, false, true);
    axis_fit(&ay, ylo, yhi, p->log_y, true);
    ax.px0 = x0, ax.px1 = x1;
    ay.px0 = y0, ay.px1 = y1;

    kvr_sbuf_printf(out, "<g class=\"panel\">\n<text x=\"%.1f\" y=\"%.1f\" class=\"ptitle\">",
                    (x0 + x1) / 2, top + 20);
    put_escaped(out, p->title);
    kvr_sbuf_puts(out, "</text>\n");
    /* Grid and ticks. */
    char label[32];
    for (size_t i = 0; i < ax.n_ticks; i++) {
        double x = axis_map(&ax, ax.ticks[i]);
        fmt_tick(label, sizeof label, ax.ticks[i]);
        kvr_sbuf_printf(out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" class=\"grid\"/>"
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" class=\"axis\"/>"
                        "<text x=\"%.1f\" y=\"%.1f\" class=\"xtick\">%s</text>\n",
                        x, y0, x, y1, x, y0, x, y0 + 5, x, y0 + 18, label);
    }
    for (size_t i = 0; i < ay.n_ticks; i++) {
        double y = axis_map(&ay, ay.ticks[i]);
        fmt_tick(label, sizeof label, ay.ticks[i]);
        kvr_sbuf_printf(out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" class=\"grid\"/>"
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" class=\"axis\"/>"
                        "<text x=\"%.1f\" y=\"%.1f\" class=\"ytick\">%s</text>\n",
                        x0, y, x1, y, x0 - 5, y, x0, y, x0 - 8, y + 4, label);
    }
    kvr_sbuf_printf(out,
                    "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" class=\"frame\"/>\n"
                    "<text x=\"%.1f\" y=\"%.1f\" class=\"xlabel\">",
                    x0, y1, x1 - x0, y0 - y1, (x0 + x1) / 2, y0 + 38);
    put_escaped(out, p->x_label);
    kvr_sbuf_printf(out,
                    "</text>\n<text x=\"%.1f\" y=\"%.1f\" class=\"ylabel\" "
                    "transform=\"rotate(-90 %.1f %.1f)\">",
                    x0 - 58, (y0 + y1) / 2, x0 - 58, (y0 + y1) / 2);
    put_escaped(out, p->y_label);
    kvr_sbuf_puts(out, "</text>\n");

    /* Series: a polyline per unbroken run of points, a marker on every point. */
    for (size_t s = 0; s < p->n_series; s++) {
        const struct kvr_svg_series *se = &p->series[s];
        kvr_sbuf_puts(out, "<g class=\"series\" data-name=\"");
        put_escaped(out, se->name);
        kvr_sbuf_puts(out, "\">\n");
        bool open = false;
        for (size_t i = 0; i < se->n; i++) {
            bool ok = isfinite(se->x[i]) && usable(&ay, se->y[i]);
            if (!ok) {
                if (open)
                    kvr_sbuf_puts(out, "\"/>\n");
                open = false;
                continue;
            }
            if (!open)
                kvr_sbuf_printf(out,
                                "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s "
                                "points=\"",
                                se->color, se->dashed ? " stroke-dasharray=\"6 4\"" : "");
            kvr_sbuf_printf(out, "%s%.1f,%.1f", open ? " " : "", axis_map(&ax, se->x[i]),
                            axis_map(&ay, se->y[i]));
            open = true;
        }
        if (open)
            kvr_sbuf_puts(out, "\"/>\n");
        for (size_t i = 0; i < se->n; i++)
            if (isfinite(se->x[i]) && usable(&ay, se->y[i]))
                kvr_sbuf_printf(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n",
                                axis_map(&ax, se->x[i]), axis_map(&ay, se->y[i]), se->color);
        kvr_sbuf_puts(out, "</g>\n");
    }

    /* Legend, right of the plot area. */
    double lx = x1 + 16, ly = y1 + 8;
    for (size_t s = 0; s < p->n_series; s++, ly += 20) {
        const struct kvr_svg_series *se = &p->series[s];
        kvr_sbuf_printf(out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                        "stroke-width=\"2\"%s/><text x=\"%.1f\" y=\"%.1f\" class=\"legend\">",
                        lx, ly, lx + 26, ly, se->color,
                        se->dashed ? " stroke-dasharray=\"6 4\"" : "", lx + 32, ly + 4);
        put_escaped(out, se->name);
        kvr_sbuf_puts(out, "</text>\n");
    }
    kvr_sbuf_puts(out, "</g>\n");
}

void kvr_svg_write(struct kvr_sbuf *out, const char *title, const struct kvr_svg_panel *panels,
                   size_t n_panels)
{
    /* The first line of the title is the heading, further lines ('\n') smaller below it. */
    int n_lines = 1;
    for (const char *p = title; p && *p; p++)
        n_lines += *p == '\n';
    int head = TITLE_HEIGHT + (n_lines - 1) * SUBTITLE_HEIGHT;
    int height = head + PANEL_HEIGHT * (int)n_panels;
    kvr_sbuf_printf(out,
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                    "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
                    "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\">\n"
                    "<style>\n"
                    ".grid{stroke:#e4e4e4;stroke-width:1}\n"
                    ".axis{stroke:#333;stroke-width:1}\n"
                    ".frame{fill:none;stroke:#333;stroke-width:1}\n"
                    ".title{font-size:17px;font-weight:bold;text-anchor:middle}\n"
                    ".subtitle{font-size:12px;text-anchor:middle}\n"
                    ".ptitle{font-size:14px;font-weight:bold;text-anchor:middle}\n"
                    ".xtick{font-size:11px;text-anchor:middle}\n"
                    ".ytick{font-size:11px;text-anchor:end}\n"
                    ".xlabel,.ylabel{font-size:12px;text-anchor:middle}\n"
                    ".legend{font-size:12px}\n"
                    "</style>\n"
                    "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                    SVG_WIDTH, height, SVG_WIDTH, height);
    const char *line = title ? title : "";
    for (int i = 0; i < n_lines; i++) {
        const char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        char buf[512];
        snprintf(buf, sizeof buf, "%.*s", (int)(len < sizeof buf ? len : sizeof buf - 1), line);
        kvr_sbuf_printf(out, "<text x=\"%d\" y=\"%d\" class=\"%s\">", SVG_WIDTH / 2,
                        i == 0 ? 24 : 24 + 4 + i * SUBTITLE_HEIGHT, i == 0 ? "title" : "subtitle");
        put_escaped(out, buf);
        kvr_sbuf_puts(out, "</text>\n");
        line = nl ? nl + 1 : line + len;
    }
    for (size_t i = 0; i < n_panels; i++)
        write_panel(out, &panels[i], head + (double)PANEL_HEIGHT * (double)i);
    kvr_sbuf_puts(out, "</svg>\n");
}
