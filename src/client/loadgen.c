/* loadgen.c - schedules and statistics for `kvasir bench` (see loadgen.h). */
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
