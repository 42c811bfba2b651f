/* serve.c - `kvasir serve` and `kvasir bridge`.
 *
 *   kvasir serve -m MODEL [--stages N]   the one-command default: write a plan for N stages
 *                                        on 127.0.0.1, start each stage as its own process,
 *                                        run the bridge and the HTTP API
 *   kvasir bridge --plan PLAN            the bridge and HTTP API for stages started
 *                                        elsewhere (another machine, systemd, ...)
 *
 * `serve` watches its stage processes (and expert agents, --experts K): one that dies is
 * started again, and the bridge reconnects the ring when it is whole (a stage computes a
 * lost agent's experts itself meanwhile). SIGINT/SIGTERM stop everything. */
#include "cli/cmd.h"
#include "cli/common.h"
#include "cli/serve_env.h"
#include "cli/serve_procs.h"

#include "bridge/bridge.h"
#include "bridge/http.h"
#include "bridge/service_ring.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "ring/net.h"
#include "ring/plan.h"
#include "ring/propose.h"

#include <errno.h>
#include <signal.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

struct serve_opts {
    const char *model, *plan_path, *host, *plan_dir, *name;
    char *api_key; /* a copy (kvr_free) of --api-key or --api-key-file's key; NULL: the
                      HTTP layer's default (KVASIR_API_KEY) */
    const char *secret_file, *tls_cert, *tls_key, *chat_template;
    uint32_t port, stages, threads, ttft_ms, total_ms, max_waiting;
    uint32_t replan_after_s; /* bridge: re-plan a ring broken this long; 0 = never */
    bool no_admission;
    bool no_prefix_cache;
    bool no_standby;              /* serve: no warm standby per stage */
    enum kvr_spec_mode spec_mode; /* --spec (default auto) */
    struct kvr_plan_spec spec;
    struct kvr_http_config http; /* the door, CORS and metrics options (http.h) */
    char tmp_dir[512];           /* the plan directory serve made itself (removed at exit), or "" */
    char ctx_why[64];            /* which limit set the context (kvr_cli_context) */
};

static void usage(FILE *f, bool serve)
{
    if (serve)
        fprintf(f, "usage: kvasir serve [-m] MODEL [--stages N] [options]\n"
                   "  Start an N-stage ring on this machine (one process per stage) and serve\n"
                   "  the OpenAI-compatible API.\n"
                   "  -m, --model FILE      the GGUF model (or give it as the first argument)\n"
                   "  --stages N            stages (default 2; a ring needs at least 2)\n"
                   "  -t, --threads N       compute threads per stage (default: this machine's\n"
                   "                        cores divided by its stages and agents)\n"
                   "  --experts K           MoE models: K expert agents; each stage keeps the\n"
                   "                        share of its layers' experts that balances its work\n"
                   "                        with the agents' (docs/PLAN.md, docs/EXPERTS.md)\n"
                   "  --stage-experts E     every stage keeps E experts of each of its layers\n"
                   "                        instead (0: all on the agents)\n"
                   "  --plan-dir DIR        where to write plan.json (default: a new /tmp dir)\n"
                   "  --base-port P         stage i listens on P+i, the bridge on P-1 (default:\n"
                   "                        a random free range below the ephemeral ports)\n"
                   "  -c, --ctx N           positions per sequence (also --ctx-size,\n"
                   "                        --max-model-len; default: the model's trained\n"
                   "                        length, capped by the KV memory this machine has;\n"
                   "                        beyond the trained length only with RoPE scaling)\n"
                   "  --max-seqs N          sequences at once (also --parallel; default 32)\n"
                   "  --row-width N --microbatches N --kv-blocks N\n"
                   "  --kv-mem MIB (KV per stage, instead of --kv-blocks) --kv-type f32|f16|q8_0\n"
                   "  --wire f32|f16        --no-encrypt: plain frames on the ring's links\n"
                   "  --no-standby          no warm standby per stage (by default, once the\n"
                   "                        ring is up and if memory allows, each stage has a\n"
                   "                        loaded twin that takes its place when it dies)\n");
    else
        fprintf(f, "usage: kvasir bridge --plan PLAN [options]\n"
                   "  Serve the OpenAI-compatible API for a ring whose stages run elsewhere.\n");
    fprintf(f, "  --host H              HTTP address (default 127.0.0.1)\n"
               "  --port P              HTTP port (default 8080)\n"
               "  --api-key-file FILE   require 'Authorization: Bearer KEY', KEY the file's\n"
               "                        first line (or env KVASIR_API_KEY)\n"
               "  --api-key KEY         the same, KEY given inline (kept out of ps, but\n"
               "                        shell history keeps it: prefer the two above)\n"
               "  --ttft-ms MS          first-token budget of requests that give none (default\n"
               "                        60000: only hopeless queues are refused)\n"
               "  --total-ms MS         whole-answer budget of requests that give none\n"
               "                        (default 600000)\n"
               "  --no-admission        admit everything that fits (no budget check)\n"
               "  --no-prefix-cache     compute every prompt whole (no KV reuse)\n"
               "  --spec off|auto       speculation: drafted tokens (the request's prediction,\n"
               "                        prompt lookup, recent answers) ride decode rows while\n"
               "                        the ring has spare rows (default auto)\n"
               "  --max-waiting N       bounded wait queue (default 4 x max-seqs)\n"
               "  --name NAME           model name in the API (also --served-model-name;\n"
               "                        default: the file name)\n"
               "  --version             print the version\n"
               "  --chat-template NAME|FILE  format chats with a built-in template (chatml,\n"
               "                        llama2, llama3, mistral, zephyr) or a Jinja file\n"
               "                        instead of the model's tokenizer.chat_template\n"
               "  --tls-cert FILE       serve HTTPS with this PEM certificate (chain) ...\n"
               "  --tls-key FILE        ... and this PEM private key\n");
    fputs(kvr_http_config_help, f);
    if (!serve)
        fprintf(f, "  --secret-file FILE    the cluster secret (instead of the plan's)\n"
                   "  --replan-after S      once the ring has been up, re-plan it over the\n"
                   "                        stages that still answer when it has been broken\n"
                   "                        for S seconds (default 10; 0 = never; held\n"
                   "                        requests fail after 30 s)\n");
}

/* An option whose value is kept as text (--wire is checked). Returns 0, 2 after printing
 * why the value is wrong, or 1 when `a` is not one of them. */
static int parse_text_opt(struct serve_opts *o, bool serve, const char *a, const char *v)
{
    if (serve && (!strcmp(a, "-m") || !strcmp(a, "--model")))
        o->model = v;
    else if (!serve && !strcmp(a, "--plan"))
        o->plan_path = v;
    else if (!strcmp(a, "--host"))
        o->host = v;
    else if (!strcmp(a, "--name") || !strcmp(a, "--served-model-name"))
        o->name = v;
    else if (!strcmp(a, "--chat-template"))
        o->chat_template = v;
    else if (!strcmp(a, "--spec")) {
        if (kvr_sched_spec_parse(v, &o->spec_mode)) {
            fprintf(stderr, "kvasir: --spec is off or auto, not '%s'\n", v);
            return 2;
        }
    } else if (!serve && !strcmp(a, "--secret-file"))
        o->secret_file = v;
    else if (!strcmp(a, "--tls-cert"))
        o->tls_cert = v;
    else if (!strcmp(a, "--tls-key"))
        o->tls_key = v;
    else if (serve && !strcmp(a, "--plan-dir"))
        o->plan_dir = v;
    else if (serve && !strcmp(a, "--kv-type"))
        o->spec.kv_type = v;
    else if (serve && !strcmp(a, "--wire")) {
        if (strcmp(v, "f32") && strcmp(v, "f16")) {
            fprintf(stderr, "kvasir serve: --wire is f32 or f16\n");
            return 2;
        }
        o->spec.wire_dtype = strcmp(v, "f16") ? KVR_DTYPE_F32 : KVR_DTYPE_F16;
    } else
        return 1;
    return 0;
}

/* A numeric option: where its value goes and its bounds [*lo, *hi] (preset to 1 and
 * 2^30); NULL when `a` is not one. */
static uint32_t *num_opt(struct serve_opts *o, bool serve, const char *a, uint32_t *lo,
                         uint32_t *hi)
{
    if (!strcmp(a, "--port"))
        return *lo = 0, *hi = 65535, &o->port;
    if (!strcmp(a, "--ttft-ms"))
        return *lo = 0, &o->ttft_ms;
    if (!strcmp(a, "--total-ms"))
        return *lo = 0, &o->total_ms;
    if (!strcmp(a, "--max-waiting"))
        return &o->max_waiting;
    if (!serve && !strcmp(a, "--replan-after"))
        return *lo = 0, *hi = 3600, &o->replan_after_s;
    if (!serve)
        return NULL;
    if (!strcmp(a, "--stages"))
        return *lo = 0, *hi = KVR_PLAN_MAX_STAGES, &o->stages;
    if (!strcmp(a, "--experts"))
        return *lo = 0, *hi = KVR_PLAN_MAX_AGENTS, &o->spec.n_agents;
    if (!strcmp(a, "--stage-experts")) {
        o->spec.keep_fixed = true;
        return *lo = 0, &o->spec.keep;
    }
    if (!strcmp(a, "-t") || !strcmp(a, "--threads"))
        return *hi = 256, &o->threads;
    if (!strcmp(a, "--base-port"))
        return *lo = 2, *hi = 65535, &o->spec.base_port;
    if (!strcmp(a, "--row-width"))
        return &o->spec.row_width;
    if (!strcmp(a, "--microbatches"))
        return &o->spec.microbatches;
    if (!strcmp(a, "--max-seqs") || !strcmp(a, "--parallel")) /* llama.cpp: slots */
        return &o->spec.max_seqs;
    if (!strcmp(a, "-c") || !strcmp(a, "--ctx") || !strcmp(a, "--ctx-size") ||
        !strcmp(a, "--max-model-len"))
        return &o->spec.n_ctx;
    if (!strcmp(a, "--kv-blocks"))
        return &o->spec.kv_blocks;
    if (!strcmp(a, "--kv-mem"))
        return &o->spec.kv_mib;
    return NULL;
}

/* An option without a value; false when `a` is not one. */
static bool parse_flag(struct serve_opts *o, bool serve, const char *a)
{
    if (!strcmp(a, "--no-prefix-cache"))
        o->no_prefix_cache = true;
    else if (!strcmp(a, "--no-admission"))
        o->no_admission = true;
    else if (serve && !strcmp(a, "--no-standby"))
        o->no_standby = true;
    else if (serve && !strcmp(a, "--no-encrypt")) /* plain frames on the ring's links */
        o->spec.no_encrypt = true;
    else
        return false;
    return true;
}

static void set_defaults(struct serve_opts *o, bool serve)
{
    memset(o, 0, sizeof *o);
    kvr_http_config_init(&o->http);
    o->host = "127.0.0.1";
    o->port = 8080;
    o->spec_mode = KVR_SPEC_AUTO;
    o->stages = 2;
    /* Defaults for clients that send no budget: generous, so that a CPU ring under
     * ordinary load serves them; clients that care send their own. */
    o->ttft_ms = 60000;
    o->total_ms = 600000;
    /* A restarted stage is back within a few seconds; a host gone for 10 s is taken for
     * gone, which leaves held requests (30 s, sched.h) most of their time to finish. serve
     * restarts its own stages, so it never re-plans. */
    o->replan_after_s = serve ? 0 : 10;
}

/* The usage text, for kvr_cli_unknown's suggestion (kvr_free), or NULL. */
static char *usage_text(bool serve)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return NULL;
    usage(f, serve);
    fclose(f);
    return text; /* malloc'd by stdio: freed with free() */
}

static void unknown(bool serve, const char *a)
{
    char *text = usage_text(serve);
    kvr_cli_unknown(serve ? "serve" : "bridge", a, text);
    free(text);
}

/* The key: --api-key KEY (its argv bytes overwritten), --api-key-file FILE, or the
 * environment. 0, or 2 after printing why. */
static int take_key(struct serve_opts *o, const char *a, char *v)
{
    kvr_free(o->api_key);
    o->api_key = !strcmp(a, "--api-key") ? kvr_cli_take_secret(v) : kvr_cli_read_key_file(v);
    return o->api_key ? 0 : 2;
}

/* One option `a` with its value `v` (NULL if none): 0, 1 after --help or --version, or 2
 * after printing what is wrong; *used says how many words it took. */
static int parse_one(struct serve_opts *o, bool serve, const char *a, char *v, int *used)
{
    *used = 1;
    if (!strcmp(a, "-h") || !strcmp(a, "--help") || !strcmp(a, "--version")) {
        if (a[2] == 'v')
            kvr_cli_version();
        else
            usage(stdout, serve);
        return 1;
    }
    if (parse_flag(o, serve, a))
        return 0;
    if ((*used = kvr_cli_gpu_option(serve ? "serve" : "bridge", a, v)) > 0)
        return 0;
    char *pair[2] = {(char *)a, v};
    struct kvr_err herr = {0};
    *used = kvr_http_config_arg(&o->http, v ? 2 : 1, pair, &herr);
    if (*used < 0) {
        fprintf(stderr, "kvasir: %s\n", herr.msg);
        return 2;
    }
    if (*used > 0)
        return 0;
    *used = 2;
    if (serve && a[0] != '-' && !o->model) { /* kvasir serve MODEL, as vLLM and Ollama */
        o->model = a;
        *used = 1;
        return 0;
    }
    uint32_t lo = 1, hi = 1u << 30;
    bool key = !strcmp(a, "--api-key") || !strcmp(a, "--api-key-file");
    int rc = key ? 0 : parse_text_opt(o, serve, a, v ? v : "");
    uint32_t *num = rc == 1 ? num_opt(o, serve, a, &lo, &hi) : NULL;
    if (rc == 1 && !num) {
        unknown(serve, a);
        return 2;
    }
    if (!v) {
        fprintf(stderr, "kvasir: %s needs a value\n", a);
        return 2;
    }
    if (key)
        return take_key(o, a, v);
    if (rc == 2 || (num && kvr_cli_u32(a, v, lo, hi, num)))
        return 2;
    return 0;
}

/* Returns 0, 1 after --help, or 2 after printing what is wrong. */
static int parse(int argc, char **argv, bool serve, struct serve_opts *o)
{
    set_defaults(o, serve);
    for (int i = 1; i < argc; i++) {
        char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char name[64];
        char *eq = a[0] == '-' && a[1] == '-' ? strchr(a, '=') : NULL;
        if (eq && (size_t)(eq - a) < sizeof name) { /* --ctx=4096, as vLLM writes it */
            snprintf(name, sizeof name, "%.*s", (int)(eq - a), a);
            a = name;
            v = eq + 1;
        }
        int used, rc = parse_one(o, serve, a, v, &used);
        if (rc)
            return rc;
        if (eq && used != 2) {
            fprintf(stderr, "kvasir: %s takes no value\n", a);
            return 2;
        }
        i += eq ? 0 : used - 1;
    }
    if (serve ? !o->model : !o->plan_path) {
        usage(stderr, serve);
        return 2;
    }
    if (!o->tls_cert != !o->tls_key) {
        fprintf(stderr, "kvasir: --tls-cert and --tls-key go together\n");
        return 2;
    }
    return 0;
}

/* ---- stage processes (serve) -------------------------------------------------------------- */

/* A random base for `span` consecutive listening ports, below the kernel's ephemeral range
 * (ip_local_port_range; 32768 if unreadable) and from 10000 up. A port inside the
 * ephemeral range (what binding port 0 returns) can be taken, between the check and the
 * stage's own bind, as the source port of any outgoing connection on the machine, and
 * the stage then fails with "Address already in use". 0 if the range below is too
 * small. */
static uint32_t random_base_port(uint32_t span)
{
    uint32_t lo = 32768;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f) {
        unsigned a = 0, b = 0;
        if (fscanf(f, "%u %u", &a, &b) == 2 && a > 0 && a <= 65535)
            lo = a;
        fclose(f);
    }
    const uint32_t first = 10001; /* base - 1 (the bridge) >= 10000 */
    if (lo <= first + span + 1)
        return 0;
    uint32_t r;
    randombytes_buf(&r, sizeof r);
    return first + r % (lo - first - span - 1);
}

/* The plan's directory: --plan-dir, or serve-PID in the per-user runtime directory (which
 * holds the plan's key: private, and cleaned by the next start if this one is killed). */
static int plan_dir(struct serve_opts *o, char *dir, size_t cap)
{
    if (o->plan_dir) {
        snprintf(dir, cap, "%s", o->plan_dir);
        mkdir(dir, 0700);
        return 0;
    }
    char run[400];
    if (kvr_cli_runtime_dir(run, sizeof run))
        return -1;
    snprintf(dir, cap, "%s/serve-%ld", run, (long)getpid());
    if (mkdir(dir, 0700) != 0) {
        fprintf(stderr, "kvasir serve: %s: %s\n", dir, strerror(errno));
        return -1;
    }
    snprintf(o->tmp_dir, sizeof o->tmp_dir, "%s", dir);
    return 0;
}

static int write_plan(struct serve_opts *o, struct kvr_gguf *g, const struct kvr_hparams *hp,
                      struct kvr_plan *plan, char *plan_path, size_t cap)
{
    struct kvr_err err = {0};
    char dir[512];
    if (plan_dir(o, dir, sizeof dir))
        return -1;
    char model_abs[4096];
    struct stat st;
    if (!realpath(o->model, model_abs) || stat(model_abs, &st) != 0) {
        fprintf(stderr, "kvasir serve: %s: %s\n", o->model, strerror(errno));
        return -1;
    }
    o->spec.n_stages = o->stages;
    /* Each process of the ring on this machine gets its share of the cores. */
    uint32_t procs = o->stages + o->spec.n_agents, cores = kvr_cli_cores();
    o->spec.n_threads = o->threads ? o->threads : cores / procs > 1 ? cores / procs : 1;
    o->spec.model_path = model_abs;
    if (kvr_cli_context(&o->spec, hp, (uint64_t)st.st_size, o->ctx_why, sizeof o->ctx_why))
        return -1;
    /* Consecutive free ports: try a few random bases. */
    if (!o->spec.base_port) {
        for (int attempt = 0; attempt < 20 && !o->spec.base_port; attempt++) {
            uint32_t base = random_base_port(o->stages + o->spec.n_agents + 1);
            if (!base)
                break;
            bool ok = true;
            for (uint32_t i = 0; i <= o->stages + o->spec.n_agents && ok; i++) {
                int fd;
                char addr[32];
                snprintf(addr, sizeof addr, "127.0.0.1:%u", base - 1 + i);
                ok = kvr_net_listen(addr, 1, &fd, NULL, &err) == 0;
                if (ok)
                    close(fd);
            }
            if (ok)
                o->spec.base_port = base;
        }
    }
    if (kvr_plan_propose(plan, g, &o->spec, &err)) {
        fprintf(stderr, "kvasir serve: %s\n", err.msg);
        return -1;
    }
    if (plan->n_agents) {
        char line[2048];
        kvr_plan_experts_describe(plan, hp->moe.n_expert, line, sizeof line);
        KVR_INFO("experts: %s", line);
    }
    /* The secret goes to its own file (mode 0600), which the plan names; one left by an
     * earlier run in --plan-dir is used again. */
    char key_path[600];
    snprintf(key_path, sizeof key_path, "%s/plan.key", dir);
    int rc = access(key_path, F_OK) == 0
                 ? kvr_plan_use_secret_file(plan, key_path, &err)
                 : kvr_plan_write_secret_file(plan, key_path, "plan.key", &err);
    if (rc) {
        fprintf(stderr, "kvasir serve: %s\n", err.msg);
        return -1;
    }
    snprintf(plan->secret_file, sizeof plan->secret_file, "plan.key");
    snprintf(plan_path, cap, "%s/plan.json", dir);
    if (kvr_plan_write(plan, plan_path, &err)) {
        fprintf(stderr, "kvasir serve: %s\n", err.msg);
        return -1;
    }
    return 0;
}

/* ---- the common part ------------------------------------------------------------------------ */

/* Everything one `serve` or `bridge` run holds; released by shut_down in reverse order. */
struct server {
    struct serve_opts o;
    bool serve; /* serve (stages of its own) or bridge */
    struct kvr_plan *plan;
    struct kvr_gguf *g;
    struct kvr_hparams hp;
    struct kvr_tok *tok;
    struct kvr_bridge *bridge;
    struct kvr_ring_service rs; /* the HTTP layer's view of the bridge */
    struct kvr_service svc;
    struct kvr_http *http;
    char *chat_src;
    struct kvr_serve_procs procs; /* serve: its stages, agents and standbys */
    sigset_t sigs;                /* taken synchronously: SIGINT, SIGTERM, SIGCHLD */
    sigset_t run_mask;            /* the mask serve started with: its children get it back */
    char plan_path[1024];
    char model_path[KVR_PLAN_PATH_BYTES];
};

/* The plan (bridge: load it; serve: propose and write one), the model and its tokenizer.
 * Returns 0 or -1 after logging why. */
static int load(struct server *sv)
{
    struct kvr_err err = {0};
    struct serve_opts *o = &sv->o;
    if (sv->serve) {
        snprintf(sv->model_path, sizeof sv->model_path, "%s", o->model);
    } else if (kvr_plan_load_with_secret(sv->plan, o->plan_path, o->secret_file, &err) ||
               kvr_plan_validate(sv->plan, 0, &err) ||
               kvr_plan_path(sv->plan, sv->plan->model_path, sv->model_path, sizeof sv->model_path,
                             &err)) {
        KVR_ERROR("plan %s: %s", o->plan_path, err.msg);
        return -1;
    }
    if (kvr_gguf_open(&sv->g, sv->model_path, &err)) {
        KVR_ERROR("%s: %s", sv->model_path, err.msg);
        return -1;
    }
    if (kvr_hparams_read(&sv->hp, sv->g, &err) || kvr_tok_create(&sv->tok, sv->g, &err)) {
        KVR_ERROR("%s: %s", sv->model_path, err.msg);
        return -1;
    }
    if (sv->serve && write_plan(o, sv->g, &sv->hp, sv->plan, sv->plan_path, sizeof sv->plan_path))
        return -1;
    if (!sv->serve && kvr_plan_validate(sv->plan, sv->hp.n_layer, &err)) {
        KVR_ERROR("plan %s: %s", o->plan_path, err.msg);
        return -1;
    }
    return 0;
}

/* Signals are taken synchronously by this thread (sigtimedwait), never by a handler:
 * SIGINT and SIGTERM stop, SIGCHLD says a stage died. Blocked before any thread starts,
 * so every thread inherits the mask and none of them is interrupted. */
static void block_signals(struct server *sv)
{
    kvr_cli_on_stop(on_signal);
    sigemptyset(&sv->sigs);
    sigaddset(&sv->sigs, SIGINT);
    sigaddset(&sv->sigs, SIGTERM);
    sigaddset(&sv->sigs, SIGCHLD);
    sigprocmask(SIG_BLOCK, &sv->sigs, &sv->run_mask);
}

/* serve: one process per stage and per expert agent. Returns 0 or -1. */
static int start_procs(struct server *sv)
{
    return kvr_serve_procs_start(&sv->procs, sv->plan, sv->plan_path, &sv->run_mask);
}

/* The bridge, then the HTTP API over it. HTTP listens at once: while the ring forms (or
 * whenever it is broken) /health and /readyz answer 503 with each stage's state, and
 * requests are refused (ring_down). Returns 0 or -1 after logging why. */
static int start_front(struct server *sv)
{
    struct kvr_err err = {0};
    const struct serve_opts *o = &sv->o;
    struct kvr_bridge_config bc = {.plan = sv->plan,
                                   .n_embd = sv->hp.n_embd,
                                   .n_vocab = sv->hp.n_vocab,
                                   .max_waiting = o->max_waiting,
                                   .admission = !o->no_admission,
                                   .no_prefix_cache = o->no_prefix_cache,
                                   .spec = o->spec_mode,
                                   .replan_after_ms = o->replan_after_s * 1000,
                                   .gguf = sv->g};
    if (kvr_bridge_create(&sv->bridge, &bc, &err)) {
        KVR_ERROR("bridge: %s", err.msg);
        return -1;
    }
    sv->rs = (struct kvr_ring_service){.bridge = sv->bridge,
                                       .plan = sv->plan,
                                       .default_first_token_ms = o->ttft_ms,
                                       .default_total_ms = o->total_ms};
    const char *base = strrchr(sv->model_path, '/');
    struct kvr_gguf_str tmpl = {0};
    if (kvr_gguf_get_str(sv->g, "tokenizer.chat_template", &tmpl, NULL) != 0)
        tmpl.ptr = NULL, tmpl.len = 0;
    sv->svc = (struct kvr_service){.ops = &kvr_ring_service_ops,
                                   .ctx = &sv->rs,
                                   .model_name = o->name ? o->name
                                                 : base  ? base + 1
                                                         : sv->model_path,
                                   .n_ctx = sv->plan->n_ctx,
                                   .tok = sv->tok,
                                   .chat_template = tmpl.ptr,
                                   .chat_template_len = (size_t)tmpl.len};
    struct kvr_http_config hc = o->http;
    hc.host = o->host;
    hc.port = (uint16_t)o->port;
    if (o->api_key)
        hc.api_key = o->api_key;
    hc.tls_cert_file = o->tls_cert;
    hc.tls_key_file = o->tls_key;
    if (o->chat_template && kvr_cli_chat_template(o->chat_template, &hc.chat_template,
                                                  &sv->chat_src, &hc.chat_template_src_len))
        return -1;
    hc.chat_template_src = sv->chat_src;
    if (kvr_http_create(&sv->http, &hc, &sv->svc, &err)) {
        KVR_ERROR("http: %s", err.msg);
        return -1;
    }
    return 0;
}

/* Say "ready" once the ring is first up, then wait for signals until told to stop. */
static void watch(struct server *sv)
{
    const struct serve_opts *o = &sv->o;
    const char *scheme = o->tls_cert ? "https" : "http";
    KVR_INFO("listening on %s://%s:%u; waiting for the ring to come up (/health says which "
             "stage is missing)",
             scheme, o->host, kvr_http_port(sv->http));
    bool ready = false, ever_up = false;
    while (!stop_flag) {
        if (!ready && kvr_bridge_ring_up(sv->bridge)) {
            ready = ever_up = true;
            KVR_INFO("serving %s on %s://%s:%u (%u stages, %u thread%s each, context %u (%s), "
                     "admission %s)",
                     sv->svc.model_name, scheme, o->host, kvr_http_port(sv->http),
                     sv->plan->n_stages, sv->plan->n_threads, sv->plan->n_threads == 1 ? "" : "s",
                     sv->plan->n_ctx, o->ctx_why[0] ? o->ctx_why : "the plan's",
                     o->no_admission ? "off" : "on");
            printf("kvasir: ready on %s://%s:%u\n", scheme, o->host, kvr_http_port(sv->http));
            fflush(stdout);
            if (sv->serve && !o->no_standby)
                kvr_serve_procs_start_standbys(&sv->procs, sv->g);
        }
        /* Until the ring is first up, look again every second (kvr_bridge_wait_up would
         * hide the signals); after that, sleep until a signal comes or a standby is due. */
        int sig;
        uint64_t due = kvr_serve_procs_standbys_due(&sv->procs), now = kvr_now_ns();
        if (!ready || due) {
            uint64_t wait_ns = !due ? 1000000000u : due > now ? due - now : 0;
            struct timespec ts = {(time_t)(wait_ns / 1000000000u), (long)(wait_ns % 1000000000u)};
            sig = sigtimedwait(&sv->sigs, NULL, &ts);
        } else {
            sig = sigwaitinfo(&sv->sigs, NULL);
        }
        if (sig == SIGINT || sig == SIGTERM)
            stop_flag = 1;
        /* A death before the ring was ever up stops serve: the plan or the machine is wrong,
         * not the process. */
        if (!stop_flag && !kvr_serve_procs_reap(&sv->procs, ever_up))
            stop_flag = 1;
    }
    KVR_INFO("stopping");
}

/* Front to back: no new requests; the bridge stops sending but keeps its links (so it does
 * not take the ring going down for a failure to recover from, nor the tail its bridge's
 * going for a lost link); then the stages from the head on, each gone before the next is
 * told, so each sees its upstream say goodbye. */
static void shut_down(struct server *sv)
{
    kvr_http_destroy(sv->http);
    kvr_free(sv->chat_src);
    kvr_bridge_stop(sv->bridge);
    kvr_serve_procs_fini(&sv->procs);
    /* The plan holds the ring's secret: do not leave it behind in /tmp. */
    if (sv->serve && sv->o.tmp_dir[0]) {
        char key_path[600];
        snprintf(key_path, sizeof key_path, "%s/plan.key", sv->o.tmp_dir);
        unlink(key_path);
        if (sv->plan_path[0])
            unlink(sv->plan_path);
        rmdir(sv->o.tmp_dir);
    }
    kvr_bridge_destroy(sv->bridge);
    kvr_tok_destroy(sv->tok);
    kvr_gguf_close(sv->g);
    if (sv->plan) {
        kvr_plan_wipe(sv->plan);
        kvr_free(sv->plan);
    }
}

static int serve_main(int argc, char **argv, bool serve)
{
    struct server *sv = kvr_calloc(1, sizeof *sv);
    if (!sv)
        return 1;
    int rc = parse(argc, argv, serve, &sv->o);
    if (rc) {
        kvr_free(sv->o.api_key);
        kvr_free(sv);
        return rc == 1 ? 0 : rc;
    }
    sv->serve = serve;
    kvr_log_set_tag(serve ? "serve" : "bridge");
    sv->plan = kvr_calloc(1, sizeof *sv->plan);
    rc = 1;
    if (sv->plan && load(sv) == 0) {
        block_signals(sv);
        if ((!serve || start_procs(sv) == 0) && start_front(sv) == 0) {
            watch(sv);
            rc = 0;
        }
    }
    shut_down(sv);
    kvr_free(sv->o.api_key);
    kvr_free(sv);
    return rc;
}

int kvr_cmd_serve(int argc, char **argv)
{
    return serve_main(argc, argv, true);
}
int kvr_cmd_bridge(int argc, char **argv)
{
    return serve_main(argc, argv, false);
}
