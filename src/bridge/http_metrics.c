/* http_metrics.c - the HTTP layer's Prometheus metrics (see http_metrics.h).
 *
 * Recording: small functions that take the mutex and bump counters. Printing: one row per
 * metric in `metric_table`, each with its reader; the rows print in table order, so the
 * /metrics text is stable for scrapers and tests. */
#include "bridge/http_metrics.h"

#include <stddef.h>
#include <string.h>

static const char *const endpoint_names[KVR_HTTP_ENDPOINT_COUNT] = {
    [KVR_HTTP_ENDPOINT_COMPLETIONS] = "/v1/completions",
    [KVR_HTTP_ENDPOINT_CHAT] = "/v1/chat/completions",
    [KVR_HTTP_ENDPOINT_MODELS] = "/v1/models",
    [KVR_HTTP_ENDPOINT_HEALTH] = "/health",
    [KVR_HTTP_ENDPOINT_METRICS] = "/metrics",
    [KVR_HTTP_ENDPOINT_TOKENIZE] = "/tokenize",
    [KVR_HTTP_ENDPOINT_DETOKENIZE] = "/detokenize",
    [KVR_HTTP_ENDPOINT_APPLY_TEMPLATE] = "/apply-template",
    [KVR_HTTP_ENDPOINT_LIVEZ] = "/livez",
    [KVR_HTTP_ENDPOINT_RESET_PREFIX_CACHE] = "/reset_prefix_cache",
    [KVR_HTTP_ENDPOINT_CONSOLE] = "/console",
    [KVR_HTTP_ENDPOINT_TELEMETRY] = "/v1/telemetry",
    [KVR_HTTP_ENDPOINT_RESPONSES] = "/v1/responses",
    [KVR_HTTP_ENDPOINT_OTHER] = "other",
};

static const char *const outcome_labels[KVR_HTTP_OUTCOME_COUNT] = {
    [KVR_HTTP_OUTCOME_STOP] = "stop",
    [KVR_HTTP_OUTCOME_LENGTH] = "length",
    [KVR_HTTP_OUTCOME_ERROR] = "error",
    [KVR_HTTP_OUTCOME_CLIENT_GONE] = "client_gone",
};

static const char *const refused_names[KVR_HTTP_REFUSED_COUNT] = {
    [KVR_HTTP_REFUSED_OVER_BUDGET] = "over_budget", [KVR_HTTP_REFUSED_KV_FULL] = "kv_full",
    [KVR_HTTP_REFUSED_QUEUE_FULL] = "queue_full",   [KVR_HTTP_REFUSED_RING_DOWN] = "ring_down",
    [KVR_HTTP_REFUSED_INVALID] = "invalid",         [KVR_HTTP_REFUSED_INTERNAL] = "internal",
};

const char *kvr_http_endpoint_name(enum kvr_http_endpoint ep)
{
    return (unsigned)ep < KVR_HTTP_ENDPOINT_COUNT ? endpoint_names[ep] : "other";
}

const char *kvr_http_refused_name(enum kvr_http_refused why)
{
    return (unsigned)why < KVR_HTTP_REFUSED_COUNT ? refused_names[why] : "internal";
}

/* ---- histograms ----------------------------------------------------------------------- */

/* Bucket bounds in seconds: vLLM's, and on up to the default budgets (60 s to the first
 * token, 600 s for the whole answer) so that a request near its budget is not just +Inf. */
static const double ttft_bounds[] = {0.005, 0.01, 0.02, 0.04,  0.06,  0.08, 0.1,  0.25,
                                     0.5,   0.75, 1.0,  2.5,   5.0,   7.5,  10.0, 20.0,
                                     40.0,  60.0, 80.0, 160.0, 320.0, 600.0};
static const double itl_bounds[] = {0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                                    0.1,   0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1.0,  2.5};
static const double e2e_bounds[] = {0.1,  0.3,  0.5,  0.8,  1.0,  1.5,  2.0,   2.5,   5.0,   10.0,
                                    15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 600.0};

#define N_OF(a) (uint32_t)(sizeof(a) / sizeof(a)[0])

static void hist_init(struct kvr_http_histogram *h, const double *bounds, uint32_t n)
{
    memset(h, 0, sizeof *h);
    h->bounds = bounds;
    h->n_bounds = n;
}

static void hist_observe(struct kvr_http_histogram *h, double v)
{
    uint32_t i = 0;
    while (i < h->n_bounds && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

/* ---- recording ------------------------------------------------------------------------ */

void kvr_http_metrics_init(struct kvr_http_metrics *m)
{
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    hist_init(&m->ttft, ttft_bounds, N_OF(ttft_bounds));
    hist_init(&m->itl, itl_bounds, N_OF(itl_bounds));
    hist_init(&m->e2e, e2e_bounds, N_OF(e2e_bounds));
}

void kvr_http_metrics_fini(struct kvr_http_metrics *m)
{
    pthread_mutex_destroy(&m->mu);
}

void kvr_http_metrics_response(struct kvr_http_metrics *m, enum kvr_http_endpoint ep, int status)
{
    if (status < 100 || status > 599 || (unsigned)ep >= KVR_HTTP_ENDPOINT_COUNT)
        return;
    pthread_mutex_lock(&m->mu);
    m->responses[ep][status - 100]++;
    pthread_mutex_unlock(&m->mu);
}

void kvr_http_metrics_refused(struct kvr_http_metrics *m, enum kvr_http_refused why)
{
    if ((unsigned)why >= KVR_HTTP_REFUSED_COUNT)
        why = KVR_HTTP_REFUSED_INTERNAL;
    pthread_mutex_lock(&m->mu);
    m->refused[why]++;
    pthread_mutex_unlock(&m->mu);
}

void kvr_http_metrics_admitted(struct kvr_http_metrics *m, uint32_t n_prompt)
{
    pthread_mutex_lock(&m->mu);
    m->prompt_tokens += n_prompt;
    m->running++;
    pthread_mutex_unlock(&m->mu);
}

void kvr_http_metrics_token(struct kvr_http_metrics *m, bool first, double seconds)
{
    pthread_mutex_lock(&m->mu);
    m->generation_tokens++;
    hist_observe(first ? &m->ttft : &m->itl, seconds);
    pthread_mutex_unlock(&m->mu);
}

void kvr_http_metrics_ended(struct kvr_http_metrics *m, enum kvr_http_outcome outcome,
                            double e2e_seconds)
{
    pthread_mutex_lock(&m->mu);
    m->outcomes[outcome]++;
    m->running--;
    if (outcome == KVR_HTTP_OUTCOME_STOP || outcome == KVR_HTTP_OUTCOME_LENGTH)
        hist_observe(&m->e2e, e2e_seconds);
    pthread_mutex_unlock(&m->mu);
}

void kvr_http_metrics_telemetry_cpu(struct kvr_http_metrics *m, uint64_t cpu_ns)
{
    pthread_mutex_lock(&m->mu);
    m->telemetry_cpu_ns += cpu_ns;
    pthread_mutex_unlock(&m->mu);
}

int64_t kvr_http_metrics_running(struct kvr_http_metrics *m)
{
    pthread_mutex_lock(&m->mu);
    int64_t n = m->running;
    pthread_mutex_unlock(&m->mu);
    return n;
}

/* ---- printing ------------------------------------------------------------------------- */

/* One metric: its HELP and TYPE lines, then what `read` prints from the struct. */
struct metric {
    const char *name; /* after "kvasir:" */
    const char *type; /* "counter", "gauge" or "histogram" */
    const char *help;
    /* Print the samples (the lines after HELP and TYPE). */
    void (*read)(const struct kvr_http_metrics *m, const struct metric *d, struct kvr_sbuf *b);
    size_t field; /* read_u64, read_i64, read_histogram: offsetof the value in the struct */
};

static const void *field_of(const struct kvr_http_metrics *m, const struct metric *d)
{
    return (const char *)m + d->field;
}

static void read_ns_as_s(const struct kvr_http_metrics *m, const struct metric *d,
                         struct kvr_sbuf *b)
{
    kvr_sbuf_printf(b, "kvasir:%s %.6f\n", d->name,
                    (double)*(const uint64_t *)field_of(m, d) / 1e9);
}

static void read_u64(const struct kvr_http_metrics *m, const struct metric *d, struct kvr_sbuf *b)
{
    kvr_sbuf_printf(b, "kvasir:%s %llu\n", d->name,
                    (unsigned long long)*(const uint64_t *)field_of(m, d));
}

static void read_i64(const struct kvr_http_metrics *m, const struct metric *d, struct kvr_sbuf *b)
{
    kvr_sbuf_printf(b, "kvasir:%s %lld\n", d->name, (long long)*(const int64_t *)field_of(m, d));
}

/* Cumulative buckets, then sum and count. */
static void read_histogram(const struct kvr_http_metrics *m, const struct metric *d,
                           struct kvr_sbuf *b)
{
    const struct kvr_http_histogram *h = field_of(m, d);
    uint64_t cum = 0;
    for (uint32_t i = 0; i < h->n_bounds; i++) {
        cum += h->counts[i];
        kvr_sbuf_printf(b, "kvasir:%s_bucket{le=\"%g\"} %llu\n", d->name, h->bounds[i],
                        (unsigned long long)cum);
    }
    cum += h->counts[h->n_bounds];
    kvr_sbuf_printf(b, "kvasir:%s_bucket{le=\"+Inf\"} %llu\n", d->name, (unsigned long long)cum);
    kvr_sbuf_printf(b, "kvasir:%s_sum %.9g\nkvasir:%s_count %llu\n", d->name, h->sum, d->name,
                    (unsigned long long)h->count);
}

/* Only the (endpoint, code) pairs seen so far, so the output stays short. */
static void read_responses(const struct kvr_http_metrics *m, const struct metric *d,
                           struct kvr_sbuf *b)
{
    for (int ep = 0; ep < KVR_HTTP_ENDPOINT_COUNT; ep++)
        for (int code = 0; code < 500; code++)
            if (m->responses[ep][code])
                kvr_sbuf_printf(b, "kvasir:%s{endpoint=\"%s\",code=\"%d\"} %llu\n", d->name,
                                endpoint_names[ep], code + 100,
                                (unsigned long long)m->responses[ep][code]);
}

static void read_outcomes(const struct kvr_http_metrics *m, const struct metric *d,
                          const char *label, enum kvr_http_outcome first,
                          enum kvr_http_outcome last, struct kvr_sbuf *b)
{
    for (enum kvr_http_outcome o = first; o <= last; o++)
        kvr_sbuf_printf(b, "kvasir:%s{%s=\"%s\"} %llu\n", d->name, label, outcome_labels[o],
                        (unsigned long long)m->outcomes[o]);
}

static void read_success(const struct kvr_http_metrics *m, const struct metric *d,
                         struct kvr_sbuf *b)
{
    read_outcomes(m, d, "finished_reason", KVR_HTTP_OUTCOME_STOP, KVR_HTTP_OUTCOME_LENGTH, b);
}

static void read_failure(const struct kvr_http_metrics *m, const struct metric *d,
                         struct kvr_sbuf *b)
{
    read_outcomes(m, d, "reason", KVR_HTTP_OUTCOME_ERROR, KVR_HTTP_OUTCOME_CLIENT_GONE, b);
}

static void read_refused(const struct kvr_http_metrics *m, const struct metric *d,
                         struct kvr_sbuf *b)
{
    for (int r = 0; r < KVR_HTTP_REFUSED_COUNT; r++)
        kvr_sbuf_printf(b, "kvasir:%s{reason=\"%s\"} %llu\n", d->name, refused_names[r],
                        (unsigned long long)m->refused[r]);
}

#define AT(f) offsetof(struct kvr_http_metrics, f)

static const struct metric metric_table[] = {
    {"http_requests_total", "counter", "HTTP responses by endpoint and status code.",
     read_responses, 0},
    {"request_success_total", "counter", "Generations finished, by finish reason.", read_success,
     0},
    {"request_failure_total", "counter", "Admitted generations that did not finish.", read_failure,
     0},
    {"request_refused_total", "counter", "Requests the service refused at admission, by reason.",
     read_refused, 0},
    {"prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", read_u64,
     AT(prompt_tokens)},
    {"generation_tokens_total", "counter", "Tokens generated.", read_u64, AT(generation_tokens)},
    {"http_generations_in_progress", "gauge", "Generations admitted and not yet released.",
     read_i64, AT(running)},
    {"time_to_first_token_seconds", "histogram",
     "Time from request arrival to the first generated token.", read_histogram, AT(ttft)},
    {"inter_token_latency_seconds", "histogram", "Time between consecutive generated tokens.",
     read_histogram, AT(itl)},
    {"e2e_request_latency_seconds", "histogram",
     "Time from request arrival to the last token of finished generations.", read_histogram,
     AT(e2e)},
    {"telemetry_cpu_seconds_total", "counter",
     "CPU time the threads of /v1/telemetry streams used (building and sending snapshots).",
     read_ns_as_s, AT(telemetry_cpu_ns)},
};

void kvr_http_metrics_print(struct kvr_http_metrics *m, struct kvr_sbuf *out)
{
    pthread_mutex_lock(&m->mu);
    for (size_t i = 0; i < sizeof metric_table / sizeof metric_table[0]; i++) {
        const struct metric *d = &metric_table[i];
        kvr_sbuf_printf(out, "# HELP kvasir:%s %s\n# TYPE kvasir:%s %s\n", d->name, d->help,
                        d->name, d->type);
        d->read(m, d, out);
    }
    pthread_mutex_unlock(&m->mu);
}

/* ---- the model_name label -------------------------------------------------------------- */

/* Samples about the HTTP server rather than the model it serves (vLLM's HTTP metrics have
 * no model_name either): every request including /health and unknown routes, and the
 * connections. */
static bool server_wide(const char *name, size_t len)
{
    static const char *const names[] = {"kvasir:http_requests_total",
                                        "kvasir:http_connections_open",
                                        "kvasir:http_connections_closed_total"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i]) == len && !memcmp(names[i], name, len))
            return true;
    return false;
}

void kvr_http_metrics_label_model(const char *text, size_t len, const char *model,
                                  struct kvr_sbuf *out)
{
    /* The label's value, escaped as the text format wants (\\, \", \n). */
    struct kvr_sbuf label;
    kvr_sbuf_init(&label);
    kvr_sbuf_puts(&label, "model_name=\"");
    for (const char *m = model; *m; m++)
        if (*m == '\\' || *m == '"')
            kvr_sbuf_printf(&label, "\\%c", *m);
        else if (*m == '\n')
            kvr_sbuf_puts(&label, "\\n");
        else
            kvr_sbuf_append(&label, m, 1);
    kvr_sbuf_puts(&label, "\"");
    const char *p = text, *end = text + len;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *eol = nl ? nl + 1 : end;
        size_t name_len = strcspn(p, "{ \n");
        if (name_len > (size_t)(eol - p))
            name_len = (size_t)(eol - p);
        if (strncmp(p, "kvasir:", 7) != 0 || server_wide(p, name_len) || p + name_len >= eol ||
            label.failed) {
            kvr_sbuf_append(out, p, (size_t)(eol - p));
        } else if (p[name_len] == '{') {
            kvr_sbuf_append(out, p, name_len + 1);
            kvr_sbuf_append(out, label.data, label.len);
            if (p[name_len + 1] != '}')
                kvr_sbuf_puts(out, ",");
            kvr_sbuf_append(out, p + name_len + 1, (size_t)(eol - p - (ptrdiff_t)name_len - 1));
        } else {
            kvr_sbuf_append(out, p, name_len);
            kvr_sbuf_puts(out, "{");
            kvr_sbuf_append(out, label.data, label.len);
            kvr_sbuf_puts(out, "}");
            kvr_sbuf_append(out, p + name_len, (size_t)(eol - p - (ptrdiff_t)name_len));
        }
        p = eol;
    }
    kvr_sbuf_fini(&label);
}
