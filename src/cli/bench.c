/* bench.c - `kvasir bench`: load a running Kvasir (or any OpenAI-compatible) server and
 * measure what its clients see, in the manner of vLLM's benchmark_serving.
 *
 *   kvasir bench --rate 5 --duration 30 --prompt-len 128 --output-len 64
 *   kvasir bench --concurrency 8 --num-requests 200 --json out.json
 *   kvasir bench --sweep 1,2,4,8 --duration 20 --ttft-budget-ms 500 --svg sweep.svg
 *
 * Every request streams (SSE), so time to first token (TTFT), every inter-token gap (ITL),
 * time per output token (TPOT) and end-to-end latency (E2E) are measured at the client.
 *
 * Load: open loop (--rate: arrival times drawn up front from --seed, Poisson or gamma with
 * --burstiness) or closed loop (--concurrency C: C requests always in flight). In the open
 * loop a request that arrives while every worker thread is busy gets a new thread, so a slow
 * request never delays the schedule. Every socket wait is bounded and every request has a
 * deadline (--timeout-s), so a run always ends by itself; Ctrl-C ends it early and still
 * reports what finished.
 *
 * This file is the command: options, the tokenizer of -m, the levels to run, and the report
 * (text, --json, --svg). client/bench_run.c sends the requests and fills one struct
 * kvr_lg_record per request; client/loadgen.c turns records into percentiles, throughput
 * and goodput; bench_svg.c draws the sweep plot (with client/svg.c). docs/BENCH.md explains
 * the output. */
#include "cli/bench_multiturn.h"
#include "cli/bench_svg.h"
#include "cli/cmd.h"
#include "cli/common.h"

#include "client/bench_run.h"
#include "client/httpc.h"
#include "client/loadgen.h"
#include "core/alloc.h"
#include "core/sbuf.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_SWEEP 16
#define MAX_TOKENS_LIMIT (1u << 20)

static volatile int stop_flag; /* raised by SIGINT/SIGTERM: stop sending, cancel in flight */

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

/* ---- options ----------------------------------------------------------------------------- */

struct opts {
    const char *url, *api_key, *model, *gguf, *json_path, *svg_path;
    enum kvr_bench_endpoint endpoint;
    double rate; /* > 0 open loop; INFINITY = all at once; 0 = closed loop */
    double burstiness;
    uint32_t concurrency;     /* closed loop */
    uint32_t max_concurrency; /* open loop cap on requests in flight; 0 = none */
    double duration_s;
    uint32_t num_requests;
    struct kvr_lg_range prompt_len, output_len;
    double temperature;                       /* NAN: the server's default */
    uint32_t ttft_budget_ms, total_budget_ms; /* 0: not sent, not checked */
    uint64_t seed;
    uint32_t timeout_s;
    double sweep[MAX_SWEEP];
    int n_sweep;
    bool sweep_auto, quiet;
    bool multi_turn; /* bench_multiturn.h; its own shape options below */
    uint32_t mt_conversations, mt_turns, mt_system_words;
    struct kvr_lg_range mt_turn_words;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvasir bench [options]\n"
               "  Load an OpenAI-compatible server with streaming requests and report TTFT, TPOT,\n"
               "  ITL and E2E latency percentiles, throughput, goodput and refusals.\n"
               "target:\n"
               "  --url URL               server (default http://127.0.0.1:8080)\n"
               "  --api-key KEY           bearer key (default: env KVASIR_API_KEY)\n"
               "  --model NAME            model name to send (default: the first of /v1/models)\n"
               "  --endpoint E            completions (default) or chat\n"
               "load (one of --rate, --concurrency, --sweep, --sweep-auto):\n"
               "  --rate R                open loop: R requests/s on average; 'inf' = all at once\n"
               "  --burstiness B          gamma shape of the gaps: 1 = Poisson (default), <1\n"
               "                          burstier, >1 more even\n"
               "  --max-concurrency C     open loop: at most C in flight (later arrivals wait)\n"
               "  --concurrency C         closed loop: keep C requests in flight\n"
               "  --duration S            send for S seconds\n"
               "  --num-requests N        send N requests (default 100 unless --duration)\n"
               "  --sweep R1,R2,...       one open-loop run per rate, then a table (and --svg)\n"
               "  --sweep-auto            rates found by doubling from a probe until goodput\n"
               "                          falls below half the offered rate\n"
               "requests:\n"
               "  --prompt-len N|LO:HI    prompt tokens (default 128)\n"
               "  --output-len N|LO:HI    max_tokens (default 64; ignore_eos is asked for)\n"
               "  -m, --gguf FILE         the model's GGUF: exact prompt token counts\n"
               "  --temperature T         sampling temperature (default: the server's)\n"
               "  --ttft-budget-ms MS     first-token budget sent with each request and checked\n"
               "  --total-budget-ms MS    whole-answer budget, likewise\n"
               "  --seed S                schedule and prompt seed (default 0)\n"
               "  --timeout-s S           per request deadline and socket timeout (default 300)\n"
               "output:\n"
               "  --json FILE             everything, including every request\n"
               "  --svg FILE              sweep plot (latency and goodput against offered rate)\n"
               "  --quiet                 no progress line\n"
               "multi-turn chat (a prefix cache's case; --output-len gives the answer length):\n"
               "  --multi-turn            conversations of turns, each prompt the previous one\n"
               "                          + its answer + a new turn; TTFT per turn\n"
               "  --conversations N       at once (default 32)   --turns N (default 6)\n"
               "  --system-words N        shared system prompt (default 400)\n"
               "  --turn-words LO:HI      words a turn adds (default 50:150)\n");
}

static int parse_double(const char *opt, const char *v, double lo, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!strcmp(v, "inf")) {
        *out = INFINITY;
        return 0;
    }
    if (errno || end == v || *end || !isfinite(x) || x < lo) {
        fprintf(stderr, "kvasir bench: %s wants a number >= %g, not '%s'\n", opt, lo, v);
        return -1;
    }
    *out = x;
    return 0;
}

/* Options that shape the load (--rate ... --sweep, and the multi-turn shape). Returns 0, 2
 * after printing why the value is wrong, or 1 when `a` is not one of them. */
static int parse_load_opt(struct opts *o, const char *a, const char *v, bool *have_rate)
{
    struct kvr_err err = {0};
    int rc = 0;
    if (!strcmp(a, "--rate")) {
        rc = parse_double(a, v, 0, &o->rate);
        if (!rc && o->rate <= 0) {
            fprintf(stderr, "kvasir bench: --rate must be > 0\n");
            return 2;
        }
        *have_rate = true;
    } else if (!strcmp(a, "--burstiness")) {
        rc = parse_double(a, v, 0, &o->burstiness);
        if (!rc && (o->burstiness <= 0 || isinf(o->burstiness))) {
            fprintf(stderr, "kvasir bench: --burstiness must be a number > 0\n");
            return 2;
        }
    } else if (!strcmp(a, "--concurrency"))
        rc = kvr_cli_u32(a, v, 1, 100000, &o->concurrency);
    else if (!strcmp(a, "--max-concurrency"))
        rc = kvr_cli_u32(a, v, 1, 100000, &o->max_concurrency);
    else if (!strcmp(a, "--duration")) {
        rc = parse_double(a, v, 0, &o->duration_s);
        if (!rc && (o->duration_s <= 0 || isinf(o->duration_s))) {
            fprintf(stderr, "kvasir bench: --duration must be a number of seconds > 0\n");
            return 2;
        }
    } else if (!strcmp(a, "--num-requests"))
        rc = kvr_cli_u32(a, v, 1, KVR_LG_MAX_REQUESTS, &o->num_requests);
    else if (!strcmp(a, "--sweep")) {
        o->n_sweep = kvr_lg_parse_rates(v, o->sweep, MAX_SWEEP, &err);
        if (o->n_sweep < 0) {
            fprintf(stderr, "kvasir bench: --sweep: %s\n", err.msg);
            return 2;
        }
    } else if (!strcmp(a, "--conversations"))
        rc = kvr_cli_u32(a, v, 1, 1024, &o->mt_conversations);
    else if (!strcmp(a, "--turns"))
        rc = kvr_cli_u32(a, v, 1, 64, &o->mt_turns);
    else if (!strcmp(a, "--system-words"))
        rc = kvr_cli_u32(a, v, 0, 100000, &o->mt_system_words);
    else if (!strcmp(a, "--turn-words")) {
        if (kvr_lg_range_parse(&o->mt_turn_words, v, 100000, &err))
            rc = -1, fprintf(stderr, "kvasir bench: --turn-words: %s\n", err.msg);
    } else
        return 1;
    return rc ? 2 : 0;
}

/* Options of the target, the requests and the output. Returns as parse_load_opt. */
static int parse_request_opt(struct opts *o, const char *a, const char *v)
{
    struct kvr_err err = {0};
    int rc = 0;
    double d;
    if (!strcmp(a, "--url"))
        o->url = v;
    else if (!strcmp(a, "--api-key"))
        o->api_key = v;
    else if (!strcmp(a, "--model"))
        o->model = v;
    else if (!strcmp(a, "-m") || !strcmp(a, "--gguf"))
        o->gguf = v;
    else if (!strcmp(a, "--json"))
        o->json_path = v;
    else if (!strcmp(a, "--svg"))
        o->svg_path = v;
    else if (!strcmp(a, "--endpoint")) {
        if (!strcmp(v, "completions"))
            o->endpoint = KVR_BENCH_COMPLETIONS;
        else if (!strcmp(v, "chat"))
            o->endpoint = KVR_BENCH_CHAT;
        else {
            fprintf(stderr, "kvasir bench: --endpoint is completions or chat\n");
            return 2;
        }
    } else if (!strcmp(a, "--prompt-len") || !strcmp(a, "--output-len")) {
        struct kvr_lg_range *r = a[2] == 'p' ? &o->prompt_len : &o->output_len;
        if (kvr_lg_range_parse(r, v, MAX_TOKENS_LIMIT, &err)) {
            fprintf(stderr, "kvasir bench: %s: %s\n", a, err.msg);
            return 2;
        }
    } else if (!strcmp(a, "--temperature")) {
        rc = parse_double(a, v, 0, &o->temperature);
        if (!rc && o->temperature > 2)
            rc = -1, fprintf(stderr, "kvasir bench: --temperature is at most 2\n");
    } else if (!strcmp(a, "--ttft-budget-ms"))
        rc = kvr_cli_u32(a, v, 1, 3600000, &o->ttft_budget_ms);
    else if (!strcmp(a, "--total-budget-ms"))
        rc = kvr_cli_u32(a, v, 1, 3600000, &o->total_budget_ms);
    else if (!strcmp(a, "--seed")) {
        rc = parse_double(a, v, 0, &d);
        if (!rc && (d != floor(d) || d > 1e18))
            rc = -1, fprintf(stderr, "kvasir bench: --seed wants a whole number\n");
        o->seed = (uint64_t)d;
    } else if (!strcmp(a, "--timeout-s"))
        rc = kvr_cli_u32(a, v, 1, 86400, &o->timeout_s);
    else
        return 1;
    return rc ? 2 : 0;
}

/* The options that only make sense together; fills the default request count. Returns 0
 * or 2 after printing why. */
static int validate_opts(struct opts *o, bool have_rate)
{
    int modes = have_rate + (o->concurrency > 0) + (o->n_sweep > 0) + o->sweep_auto;
    if (o->multi_turn && modes == 0)
        return 0;
    if (modes != 1 || o->multi_turn) {
        fprintf(stderr, "kvasir bench: give exactly one of --rate, --concurrency, --sweep, "
                        "--sweep-auto and --multi-turn\n");
        return 2;
    }
    if (o->max_concurrency && o->concurrency) {
        fprintf(stderr, "kvasir bench: --max-concurrency goes with --rate or --sweep\n");
        return 2;
    }
    if (!o->num_requests && o->duration_s == 0)
        o->num_requests = 100;
    if (have_rate && isinf(o->rate) && !o->num_requests) {
        fprintf(stderr, "kvasir bench: --rate inf needs --num-requests\n");
        return 2;
    }
    if (o->sweep_auto && o->duration_s == 0 && !o->num_requests) {
        fprintf(stderr, "kvasir bench: --sweep-auto needs --duration or --num-requests\n");
        return 2;
    }
    if (o->svg_path && !o->n_sweep && !o->sweep_auto) {
        fprintf(stderr, "kvasir bench: --svg plots a sweep: add --sweep or --sweep-auto\n");
        return 2;
    }
    if (o->ttft_budget_ms && o->total_budget_ms && o->ttft_budget_ms > o->total_budget_ms) {
        fprintf(stderr, "kvasir bench: --ttft-budget-ms exceeds --total-budget-ms\n");
        return 2;
    }
    return 0;
}

/* Returns 0, 1 after --help, or 2 after printing what is wrong. */
static int parse_opts(int argc, char **argv, struct opts *o)
{
    memset(o, 0, sizeof *o);
    o->url = "http://127.0.0.1:8080";
    o->api_key = getenv("KVASIR_API_KEY");
    o->burstiness = 1;
    o->prompt_len = (struct kvr_lg_range){128, 128};
    o->output_len = (struct kvr_lg_range){64, 64};
    o->temperature = NAN;
    o->timeout_s = 300;
    o->mt_conversations = 32;
    o->mt_turns = 6;
    o->mt_system_words = 400;
    o->mt_turn_words = (struct kvr_lg_range){50, 150};
    bool have_rate = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--sweep-auto")) {
            o->sweep_auto = true;
            continue;
        }
        if (!strcmp(a, "--quiet")) {
            o->quiet = true;
            continue;
        }
        if (!strcmp(a, "--multi-turn")) {
            o->multi_turn = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "kvasir bench: %s needs a value\n", a);
            return 2;
        }
        i++;
        int rc = parse_load_opt(o, a, v, &have_rate);
        if (rc == 1)
            rc = parse_request_opt(o, a, v);
        if (rc == 1) {
            kvr_cli_unknown_usage("bench", a, usage);
            return 2;
        }
        if (rc)
            return 2;
    }
    return validate_opts(o, have_rate);
}

/* ---- the runner's hooks ---------------------------------------------------------------------- */

/* The tokenizer hook of client/bench_run.h over the model's tokenizer (-m). */
static int tok_encode(void *ud, const char *text, size_t len, bool add_special, int32_t *ids,
                      size_t cap)
{
    const struct kvr_tok *tok = ud;
    struct kvr_tok_scratch *sc = NULL;
    int n = kvr_tok_scratch_create(&sc, tok, len ? len : 1);
    if (n == 0)
        n = kvr_tok_encode(tok, sc, text, len, add_special, false, ids, cap);
    kvr_tok_scratch_destroy(sc);
    return n;
}

struct progress_line {
    const char *label;
    double duration_s; /* the level's length when it has no request count */
};

/* One progress line on stderr, redrawn in place and cleared at the end. */
static void show_progress(void *ud, const struct kvr_bench_progress *p, bool final)
{
    const struct progress_line *pl = ud;
    double frac;
    if (p->total)
        frac = (double)p->done / (double)p->total;
    else
        frac = pl->duration_s > 0 ? p->elapsed_s / pl->duration_s : 0;
    frac = frac < 0 ? 0 : frac > 1 ? 1 : frac;
    char bar[25];
    int fill = (int)(frac * 24 + 0.5);
    for (int i = 0; i < 24; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[24] = 0;
    char count[48];
    if (p->total)
        snprintf(count, sizeof count, "%zu/%zu", p->done, p->total);
    else
        snprintf(count, sizeof count, "%zu", p->done);
    fprintf(stderr,
            "\r%s[%s] %s done  %.1f s  ok %zu  refused %zu  failed %zu  in flight %zu\033[K",
            pl->label, bar, count, p->elapsed_s, p->ok, p->refused, p->failed, p->inflight);
    if (final)
        fprintf(stderr, "\r\033[K");
    fflush(stderr);
}

/* What every level of one command shares. */
struct env {
    const struct opts *o;
    struct kvr_httpc_url url;
    const char *model;
    const struct kvr_tok *tok;           /* -m: exact prompt token counts; or NULL */
    struct kvr_bench_tokenizer tok_hook; /* over tok */
    const char *path;
    bool tty;
};

/* Run one level with the runner of client/bench_run.h; prints the runner's error. */
static int run_level(const struct env *env, struct kvr_bench_level *lv, const char *label)
{
    const struct opts *o = env->o;
    struct progress_line pl = {.label = label, .duration_s = o->duration_s};
    struct kvr_bench_spec s = {.url = &env->url,
                               .path = env->path,
                               .api_key = o->api_key,
                               .model = env->model,
                               .endpoint = o->endpoint,
                               .tok = env->tok ? &env->tok_hook : NULL,
                               .burstiness = o->burstiness,
                               .max_concurrency = o->max_concurrency,
                               .duration_s = o->duration_s,
                               .num_requests = o->num_requests,
                               .prompt_len = o->prompt_len,
                               .output_len = o->output_len,
                               .temperature = o->temperature,
                               .ttft_budget_ms = o->ttft_budget_ms,
                               .total_budget_ms = o->total_budget_ms,
                               .seed = o->seed,
                               .timeout_s = o->timeout_s,
                               .cancel = &stop_flag};
    if (env->tty && !o->quiet) {
        s.on_progress = show_progress;
        s.progress_ud = &pl;
    }
    struct kvr_err err = {0};
    int rc = kvr_bench_run_level(&s, lv, &err);
    if (rc && err.msg[0])
        fprintf(stderr, "kvasir bench: %s\n", err.msg);
    return rc;
}

/* ---- reporting ------------------------------------------------------------------------------- */

static void describe_load(char *buf, size_t cap, const struct opts *o,
                          const struct kvr_bench_level *lv)
{
    char limit[96] = "";
    if (o->num_requests && o->duration_s > 0)
        snprintf(limit, sizeof limit, "up to %u requests within %.4g s", o->num_requests,
                 o->duration_s);
    else if (o->num_requests)
        snprintf(limit, sizeof limit, "%u requests", o->num_requests);
    else
        snprintf(limit, sizeof limit, "for %.4g s", o->duration_s);
    if (lv->concurrency)
        snprintf(buf, cap, "closed loop, %u in flight, %s", lv->concurrency, limit);
    else if (isinf(lv->rate))
        snprintf(buf, cap, "all at once, %s", limit);
    else if (o->burstiness == 1)
        snprintf(buf, cap, "Poisson arrivals at %.4g req/s, %s", lv->rate, limit);
    else
        snprintf(buf, cap, "gamma arrivals (burstiness %.3g) at %.4g req/s, %s", o->burstiness,
                 lv->rate, limit);
    if (o->max_concurrency && !lv->concurrency) {
        size_t used = strlen(buf);
        snprintf(buf + used, cap - used, ", at most %u in flight", o->max_concurrency);
    }
}

static void fmt_range(char *buf, size_t cap, const struct kvr_lg_range *r)
{
    if (r->lo == r->hi)
        snprintf(buf, cap, "%u", r->lo);
    else
        snprintf(buf, cap, "%u..%u (uniform)", r->lo, r->hi);
}

static void print_ms_row(const char *name, const struct kvr_lg_summary *s)
{
    if (s->n == 0) {
        printf("  %-8s %7zu %9s %9s %9s %9s %9s\n", name, s->n, "-", "-", "-", "-", "-");
        return;
    }
    printf("  %-8s %7zu %9.2f %9.2f %9.2f %9.2f %9.2f\n", name, s->n, s->mean * 1e3, s->p50 * 1e3,
           s->p90 * 1e3, s->p99 * 1e3, s->max * 1e3);
}

static void print_reasons(const char *what, const struct kvr_lg_reason_count *t, size_t n)
{
    if (n == 0)
        return;
    printf("  %-14s", what);
    for (size_t i = 0; i < n; i++) {
        if (t[i].http_status)
            printf("%s %d %s x%zu", i ? "," : "", t[i].http_status, t[i].reason, t[i].n);
        else
            printf("%s %s x%zu", i ? "," : "", t[i].reason, t[i].n);
    }
    printf("\n");
}

static void print_level(const struct env *env, const struct kvr_bench_level *lv)
{
    const struct opts *o = env->o;
    const struct kvr_lg_result *res = &lv->res;
    char load[192], pl[48], ol[48];
    describe_load(load, sizeof load, o, lv);
    fmt_range(pl, sizeof pl, &o->prompt_len);
    fmt_range(ol, sizeof ol, &o->output_len);
    printf("==================== kvasir bench ====================\n");
    printf("  target        http://%s:%s%s%s (model %s)\n", env->url.host, env->url.port,
           env->url.base_path, env->path, env->model);
    printf("  load          %s\n", load);
    printf("  lengths       prompt %s tokens%s, output %s tokens\n", pl,
           env->tok ? "" : " (as words)", ol);
    if (o->ttft_budget_ms || o->total_budget_ms) {
        printf("  budget        ");
        if (o->ttft_budget_ms)
            printf("first token %u ms%s", o->ttft_budget_ms, o->total_budget_ms ? ", " : "");
        if (o->total_budget_ms)
            printf("total %u ms", o->total_budget_ms);
        printf("\n");
    } else {
        printf("  budget        none sent (the server's defaults apply; goodput = ok)\n");
    }
    printf("  duration      %.2f s (first send to last response)\n", lv->wall_s);
    printf("------------------------------------------------------\n");
    printf("  requests      %zu: %zu ok, %zu refused, %zu errors, %zu timeouts\n", res->n_total,
           res->n_outcome[KVR_LG_OK], res->n_outcome[KVR_LG_REFUSED], res->n_outcome[KVR_LG_ERROR],
           res->n_outcome[KVR_LG_TIMEOUT]);
    print_reasons("refused", res->refused, res->n_refused_reasons);
    print_reasons("errors", res->errors, res->n_error_reasons);
    printf("  throughput    %.2f req/s, %.1f output tok/s, %.1f total tok/s\n", res->req_per_s,
           res->output_tok_per_s, res->total_tok_per_s);
    printf("  goodput       %.2f req/s (%zu of %zu met the budget)\n", res->goodput_req_per_s,
           res->n_met_budget, res->n_total);
    printf("  tokens        %llu prompt, %llu output (ok requests)\n",
           (unsigned long long)res->prompt_tokens, (unsigned long long)res->output_tokens);
    printf("------------------------------------------------------\n");
    printf("  %-8s %7s %9s %9s %9s %9s %9s\n", "ms", "n", "mean", "p50", "p90", "p99", "max");
    print_ms_row("TTFT", &res->ttft_s);
    print_ms_row("TPOT", &res->tpot_s);
    print_ms_row("ITL", &res->itl_s);
    print_ms_row("E2E", &res->e2e_s);
    print_ms_row("refusal", &res->refusal_s);
    if (res->refusal_s.n)
        printf("  refusals within %.0f ms: %s (%zu slower)\n", KVR_LG_REFUSAL_LIMIT_S * 1e3,
               res->n_refusal_over_limit ? "NO" : "all", res->n_refusal_over_limit);
    printf("======================================================\n");
}

static void print_sweep_table(const struct kvr_bench_level *lv, size_t n)
{
    printf("\n%8s %6s %6s %7s %6s %9s %9s %9s %9s %8s %8s\n", "rate", "sent", "ok", "refused",
           "failed", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99", "tput", "goodput");
    printf("%8s %6s %6s %7s %6s %9s %9s %9s %9s %8s %8s\n", "req/s", "", "", "", "", "ms", "ms",
           "ms", "ms", "req/s", "req/s");
    for (size_t i = 0; i < n; i++) {
        const struct kvr_lg_result *r = &lv[i].res;
        printf("%8.4g %6zu %6zu %7zu %6zu %9.1f %9.1f %9.1f %9.1f %8.2f %8.2f\n", lv[i].rate,
               r->n_total, r->n_outcome[KVR_LG_OK], r->n_outcome[KVR_LG_REFUSED],
               r->n_outcome[KVR_LG_ERROR] + r->n_outcome[KVR_LG_TIMEOUT], r->ttft_s.p50 * 1e3,
               r->ttft_s.p99 * 1e3, r->e2e_s.p50 * 1e3, r->e2e_s.p99 * 1e3, r->req_per_s,
               r->goodput_req_per_s);
    }
}

/* ---- JSON ------------------------------------------------------------------------------------ */

/* Seconds as milliseconds rounded to the microsecond; NaN (no data) as null. */
static json_t *ms(double s)
{
    return isfinite(s) ? json_real(round(s * 1e6) / 1e3) : json_null();
}

static json_t *secs(double s)
{
    return isfinite(s) ? json_real(round(s * 1e6) / 1e6) : json_null();
}

static json_t *summary_json(const struct kvr_lg_summary *s)
{
    return json_pack("{s:I, s:o, s:o, s:o, s:o, s:o, s:o}", "n", (json_int_t)s->n, "mean",
                     ms(s->mean), "min", ms(s->min), "p50", ms(s->p50), "p90", ms(s->p90), "p99",
                     ms(s->p99), "max", ms(s->max));
}

static json_t *reasons_json(const struct kvr_lg_reason_count *t, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_pack("{s:i, s:s, s:I}", "status", t[i].http_status, "reason",
                                           t[i].reason, "n", (json_int_t)t[i].n));
    return a;
}

static json_t *level_json(const struct kvr_bench_level *lv)
{
    const struct kvr_lg_result *r = &lv->res;
    json_t *refusal = summary_json(&r->refusal_s);
    json_object_set_new(refusal, "over_limit", json_integer((json_int_t)r->n_refusal_over_limit));
    json_object_set_new(refusal, "limit_ms", json_real(KVR_LG_REFUSAL_LIMIT_S * 1e3));
    json_t *summary = json_pack(
        "{s:o, s:{s:I, s:I, s:I, s:I, s:I, s:I}, s:o, s:o, s:{s:o, s:o, s:o, s:o}, "
        "s:{s:I, s:I}, s:o, s:o, s:o, s:o, s:o}",
        "duration_s", secs(lv->wall_s), "requests", "total", (json_int_t)r->n_total, "ok",
        (json_int_t)r->n_outcome[KVR_LG_OK], "refused", (json_int_t)r->n_outcome[KVR_LG_REFUSED],
        "error", (json_int_t)r->n_outcome[KVR_LG_ERROR], "timeout",
        (json_int_t)r->n_outcome[KVR_LG_TIMEOUT], "met_budget", (json_int_t)r->n_met_budget,
        "refused_by", reasons_json(r->refused, r->n_refused_reasons), "errors_by",
        reasons_json(r->errors, r->n_error_reasons), "throughput", "requests_per_s",
        json_real(r->req_per_s), "output_tokens_per_s", json_real(r->output_tok_per_s),
        "total_tokens_per_s", json_real(r->total_tok_per_s), "goodput_requests_per_s",
        json_real(r->goodput_req_per_s), "tokens", "prompt", (json_int_t)r->prompt_tokens, "output",
        (json_int_t)r->output_tokens, "ttft_ms", summary_json(&r->ttft_s), "tpot_ms",
        summary_json(&r->tpot_s), "itl_ms", summary_json(&r->itl_s), "e2e_ms",
        summary_json(&r->e2e_s), "refusal_ms", refusal);
    json_t *reqs = json_array();
    for (size_t i = 0; i < lv->n_rec; i++) {
        const struct kvr_lg_record *q = &lv->rec[i];
        json_t *itl = json_array();
        for (uint32_t k = 0; k < q->n_itl; k++)
            json_array_append_new(itl, ms(q->itl_s[k]));
        json_array_append_new(
            reqs, json_pack("{s:I, s:o, s:o, s:s, s:i, s:s, s:s, s:I, s:I, s:I, s:o, s:o, s:o, "
                            "s:b, s:o}",
                            "index", (json_int_t)q->index, "scheduled_s", secs(q->scheduled_s),
                            "start_s", secs(q->start_s), "outcome", kvr_lg_outcome_name(q->outcome),
                            "status", q->http_status, "reason", q->reason, "message", q->message,
                            "prompt_tokens", (json_int_t)q->prompt_tokens, "output_tokens",
                            (json_int_t)q->output_tokens, "max_tokens", (json_int_t)q->max_tokens,
                            "ttft_ms", ms(q->ttft_s), "e2e_ms", ms(q->e2e_s), "response_ms",
                            ms(q->response_s), "met_budget", q->met_budget, "itl_ms", itl));
    }
    json_t *l = json_object();
    json_object_set_new(l, "offered_rate",
                        lv->concurrency || isinf(lv->rate) ? json_null() : json_real(lv->rate));
    json_object_set_new(l, "concurrency",
                        lv->concurrency ? json_integer(lv->concurrency) : json_null());
    json_object_set_new(l, "t0_unix_s", json_real(lv->t0_unix_s));
    json_object_set_new(l, "summary", summary);
    json_object_set_new(l, "requests", reqs);
    return l;
}

static int write_json(const struct env *env, const struct kvr_bench_level *lv, size_t n)
{
    const struct opts *o = env->o;
    json_t *cfg = json_pack(
        "{s:s, s:s, s:s, s:s, s:o, s:f, s:o, s:o, s:o, s:o, s:[i,i], s:[i,i], s:o, s:o, s:I, "
        "s:i, s:o, s:b}",
        "url", o->url, "endpoint", env->path, "model", env->model, "mode",
        o->concurrency                    ? "closed"
        : o->n_sweep > 0 || o->sweep_auto ? "sweep"
                                          : "open",
        "rate",
        o->concurrency || o->n_sweep || o->sweep_auto || isinf(o->rate) ? json_null()
                                                                        : json_real(o->rate),
        "burstiness", o->burstiness, "concurrency",
        o->concurrency ? json_integer(o->concurrency) : json_null(), "max_concurrency",
        o->max_concurrency ? json_integer(o->max_concurrency) : json_null(), "num_requests",
        o->num_requests ? json_integer(o->num_requests) : json_null(), "duration_s",
        o->duration_s > 0 ? json_real(o->duration_s) : json_null(), "prompt_len",
        (int)o->prompt_len.lo, (int)o->prompt_len.hi, "output_len", (int)o->output_len.lo,
        (int)o->output_len.hi, "ttft_budget_ms",
        o->ttft_budget_ms ? json_integer(o->ttft_budget_ms) : json_null(), "total_budget_ms",
        o->total_budget_ms ? json_integer(o->total_budget_ms) : json_null(), "seed",
        (json_int_t)o->seed, "timeout_s", (int)o->timeout_s, "tokenizer",
        o->gguf ? json_string(o->gguf) : json_null(), "exact_prompt_tokens",
        o->gguf != NULL && o->endpoint == KVR_BENCH_COMPLETIONS);
    json_t *runs = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(runs, level_json(&lv[i]));
    json_t *root = json_pack("{s:s, s:i, s:o, s:o}", "tool", "kvasir bench", "version", 1, "config",
                             cfg, "runs", runs);
    int rc = root ? json_dump_file(root, o->json_path, JSON_COMPACT | JSON_REAL_PRECISION(12)) : -1;
    json_decref(root);
    if (rc) {
        fprintf(stderr, "kvasir bench: cannot write %s\n", o->json_path);
        return -1;
    }
    return 0;
}

/* ---- SVG ------------------------------------------------------------------------------------- */

static int write_svg(const struct env *env, const struct kvr_bench_level *lv, size_t n)
{
    const struct opts *o = env->o;
    struct kvr_bench_point *pts = kvr_calloc(n, sizeof *pts);
    if (!pts)
        return -1;
    for (size_t i = 0; i < n; i++)
        pts[i] =
            (struct kvr_bench_point){.rate = lv[i].rate, .wall_s = lv[i].wall_s, .res = &lv[i].res};
    char budget[128] = "no latency budget", pl[48], ol[48], load[160];
    if (o->ttft_budget_ms || o->total_budget_ms)
        snprintf(budget, sizeof budget, "budget: first token %u ms, total %u ms", o->ttft_budget_ms,
                 o->total_budget_ms);
    fmt_range(pl, sizeof pl, &o->prompt_len);
    fmt_range(ol, sizeof ol, &o->output_len);
    if (o->num_requests && o->duration_s > 0)
        snprintf(load, sizeof load, "up to %u requests in %.4g s per rate", o->num_requests,
                 o->duration_s);
    else if (o->num_requests)
        snprintf(load, sizeof load, "%u requests per rate", o->num_requests);
    else
        snprintf(load, sizeof load, "%.4g s per rate", o->duration_s);
    struct kvr_sbuf title;
    kvr_sbuf_init(&title);
    kvr_sbuf_printf(&title,
                    "kvasir bench: %s at %s%s\n%s arrivals, %s; prompt %s, output %s tokens; %s",
                    env->model, env->url.host, env->path, o->burstiness == 1 ? "Poisson" : "gamma",
                    load, pl, ol, budget);
    int rc = kvr_bench_svg_write(o->svg_path, title.failed ? "kvasir bench" : title.data,
                                 o->ttft_budget_ms, o->total_budget_ms, pts, n);
    kvr_sbuf_fini(&title);
    kvr_free(pts);
    return rc;
}

/* ---- the command ----------------------------------------------------------------------------- */

/* The served model's name from GET /v1/models (data[0].id). */
static char *fetch_model(const struct env *env, uint32_t timeout_ms)
{
    struct kvr_httpc_resp resp;
    struct kvr_err err = {0};
    char *name = NULL;
    int rc = kvr_httpc_get(&env->url, "/v1/models", env->o->api_key, timeout_ms, &resp, &err);
    if (rc) {
        fprintf(stderr, "kvasir bench: cannot reach %s: %s\n", env->o->url, err.msg);
    } else if (resp.status != 200) {
        fprintf(stderr, "kvasir bench: GET /v1/models answered %d%s%.200s\n", resp.status,
                resp.body ? ": " : "", resp.body ? resp.body : "");
    } else {
        json_t *j = resp.body ? json_loadb(resp.body, resp.body_len, 0, NULL) : NULL;
        json_t *id = json_object_get(json_array_get(json_object_get(j, "data"), 0), "id");
        if (json_is_string(id))
            name = kvr_strdup(json_string_value(id));
        else
            fprintf(stderr, "kvasir bench: GET /v1/models names no model; use --model\n");
        json_decref(j);
    }
    kvr_httpc_resp_fini(&resp);
    return name;
}

static double round3(double x)
{
    if (!(x > 0) || !isfinite(x))
        return x;
    double mag = pow(10, floor(log10(x)) - 2);
    return round(x / mag) * mag;
}

/* --sweep-auto: a short sequential probe gives one request's E2E; rates then double from
 * half of what one stream alone could carry until goodput falls below half the offered
 * rate, or after 8 levels. */
static int auto_rates(const struct env *env, double *rates, int cap)
{
    struct opts po = *env->o;
    po.num_requests = 3;
    po.duration_s = 0;
    po.quiet = true;
    struct env pe = *env;
    pe.o = &po;
    struct kvr_bench_level probe = {.concurrency = 1};
    int rc = run_level(&pe, &probe, "probe ");
    double e2e = probe.res.e2e_s.mean;
    size_t ok = probe.res.n_outcome[KVR_LG_OK];
    kvr_bench_level_fini(&probe);
    if (rc || ok == 0 || !(e2e > 0)) {
        fprintf(stderr, "kvasir bench: the probe for --sweep-auto got no answer (%zu ok)\n", ok);
        return -1;
    }
    double r0 = round3(0.5 / e2e);
    printf("sweep-auto: one request takes %.1f ms end to end; rates from %.3g req/s\n", e2e * 1e3,
           r0);
    for (int i = 0; i < cap; i++)
        rates[i] = round3(r0 * pow(2, i));
    return cap;
}

/* Open the tokenizer of -m and find the model's name: 0, or 1 after printing why not. */
static int prepare(struct env *env, struct kvr_tok **tok, char **model)
{
    const struct opts *o = env->o;
    struct kvr_err err = {0};
    if (o->gguf) {
        struct kvr_gguf *g = NULL;
        if (kvr_gguf_open(&g, o->gguf, &err) || kvr_tok_create(tok, g, &err)) {
            fprintf(stderr, "kvasir bench: %s: %s\n", o->gguf, err.msg);
            kvr_gguf_close(g);
            return 1;
        }
        kvr_gguf_close(g);
        env->tok = *tok;
        env->tok_hook = (struct kvr_bench_tokenizer){.encode = tok_encode, .ud = *tok};
    }
    uint32_t probe_ms = o->timeout_s < 30 ? o->timeout_s * 1000 : 30000;
    *model = o->model ? kvr_strdup(o->model) : fetch_model(env, probe_ms);
    if (!*model)
        return 1;
    env->model = *model;
    return 0;
}

static int run_multiturn(const struct env *env)
{
    const struct opts *o = env->o;
    struct kvr_multiturn_spec mt = {.url = &env->url,
                                    .api_key = o->api_key,
                                    .model = env->model,
                                    .n_conversations = o->mt_conversations,
                                    .n_turns = o->mt_turns,
                                    .system_words = o->mt_system_words,
                                    .turn_lo = o->mt_turn_words.lo,
                                    .turn_hi = o->mt_turn_words.hi,
                                    .output_tokens = o->output_len.lo,
                                    .seed = o->seed,
                                    .timeout_s = o->timeout_s};
    return kvr_bench_multiturn(&mt);
}

/* One level per rate, each summarised in a line, then the table; stops early when the
 * server saturates under --sweep-auto. Returns the number of levels run. */
static size_t run_sweep(const struct env *env, struct kvr_bench_level *lv, const double *rates,
                        int n_rates)
{
    const struct opts *o = env->o;
    size_t n_lv = 0;
    for (int i = 0; i < n_rates && !stop_flag; i++) {
        lv[i].rate = rates[i];
        if (o->duration_s > 0 && rates[i] * o->duration_s > KVR_LG_MAX_REQUESTS / 2) {
            fprintf(stderr, "kvasir bench: rate %.3g req/s would need too many requests\n",
                    rates[i]);
            break;
        }
        char label[48];
        snprintf(label, sizeof label, "%.3g req/s ", rates[i]);
        if (run_level(env, &lv[i], label))
            break;
        n_lv++;
        const struct kvr_lg_result *r = &lv[i].res;
        printf("rate %8.4g req/s: %zu sent, %zu ok, %zu refused, %zu failed; TTFT p50 %.1f "
               "ms, E2E p99 %.1f ms, goodput %.2f req/s\n",
               rates[i], r->n_total, r->n_outcome[KVR_LG_OK], r->n_outcome[KVR_LG_REFUSED],
               r->n_outcome[KVR_LG_ERROR] + r->n_outcome[KVR_LG_TIMEOUT], r->ttft_s.p50 * 1e3,
               r->e2e_s.p99 * 1e3, r->goodput_req_per_s);
        fflush(stdout);
        if (o->sweep_auto && r->goodput_req_per_s < 0.5 * rates[i])
            break; /* saturated: more load only shows more refusals */
    }
    if (n_lv)
        print_sweep_table(lv, n_lv);
    return n_lv;
}

/* After the levels: the interrupt note, --json, --svg, and whether anything answered.
 * Returns the command's exit status. */
static int finish(const struct env *env, const struct kvr_bench_level *lv, size_t n_lv)
{
    const struct opts *o = env->o;
    int rc = 0;
    if (stop_flag) {
        fprintf(stderr, "kvasir bench: interrupted; the results cover what had finished\n");
        rc = 130; /* as a shell reports SIGINT: the run is not complete */
    }
    if (o->json_path && write_json(env, lv, n_lv))
        rc = rc ? rc : 1;
    if (o->svg_path && write_svg(env, lv, n_lv))
        rc = rc ? rc : 1;
    /* A run where no request got any HTTP answer measured nothing about the server. */
    bool any_answer = false;
    for (size_t i = 0; i < n_lv && !any_answer; i++)
        for (size_t k = 0; k < lv[i].n_rec && !any_answer; k++)
            any_answer = lv[i].rec[k].http_status != 0;
    if (!any_answer) {
        fprintf(stderr, "kvasir bench: no request got an answer from %s\n", o->url);
        rc = 1;
    }
    return rc;
}

int kvr_cmd_bench(int argc, char **argv)
{
    struct opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    struct env env = {.o = &o,
                      .tty = isatty(STDERR_FILENO) != 0,
                      .path = o.endpoint == KVR_BENCH_CHAT ? "/v1/chat/completions"
                                                           : "/v1/completions"};
    struct kvr_err err = {0};
    if (kvr_httpc_url_parse(&env.url, o.url, &err)) {
        fprintf(stderr, "kvasir bench: --url: %s\n", err.msg);
        return 2;
    }
    kvr_cli_on_stop(on_signal);

    struct kvr_tok *tok = NULL;
    char *model = NULL;
    struct kvr_bench_level *lv = NULL;
    size_t n_lv = 0, want = 0;
    rc = 1;
    if (prepare(&env, &tok, &model))
        goto out;
    if (o.multi_turn) {
        rc = run_multiturn(&env);
        goto out;
    }
    double rates[MAX_SWEEP];
    int n_rates = 0;
    if (o.n_sweep) {
        memcpy(rates, o.sweep, sizeof rates);
        n_rates = o.n_sweep;
    } else if (o.sweep_auto) {
        if ((n_rates = auto_rates(&env, rates, 8)) < 0)
            goto out;
    }
    want = n_rates ? (size_t)n_rates : 1;
    lv = kvr_calloc(want, sizeof *lv);
    if (!lv)
        goto out;
    if (!n_rates) {
        lv[0].rate = o.concurrency ? 0 : o.rate;
        lv[0].concurrency = o.concurrency;
        if (run_level(&env, &lv[0], "") == 0)
            n_lv = 1;
        if (n_lv)
            print_level(&env, &lv[0]);
    } else {
        n_lv = run_sweep(&env, lv, rates, n_rates);
    }
    if (n_lv)
        rc = finish(&env, lv, n_lv);
out:
    for (size_t i = 0; lv && i < want; i++)
        kvr_bench_level_fini(&lv[i]);
    kvr_free(lv);
    kvr_free(model);
    kvr_tok_destroy(tok);
    return rc;
}
