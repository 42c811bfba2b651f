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
#include "ring/stage.h"

#include <errno.h>
#include <signal.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

struct serve_opts {
    const char *model, *plan_path, *host, *api_key, *plan_dir, *name;
    const char *secret_file, *tls_cert, *tls_key, *chat_template;
    uint32_t port, stages, threads, ttft_ms, total_ms, max_waiting;
    uint32_t replan_after_s; /* bridge: re-plan a ring broken this long; 0 = never */
    bool no_admission;
    bool no_prefix_cache;
    bool no_standby; /* serve: no warm standby per stage */
    struct kvr_plan_spec spec;
    char tmp_dir[512]; /* the plan directory serve made itself (removed at exit), or "" */
};

static void usage(FILE *f, bool serve)
{
    if (serve)
        fprintf(f, "usage: kvasir serve -m MODEL [--stages N] [options]\n"
                   "  Start an N-stage ring on this machine (one process per stage) and serve\n"
                   "  the OpenAI-compatible API.\n"
                   "  --stages N            stages (default 2; a ring needs at least 2)\n"
                   "  --threads N           compute threads per stage (default 1)\n"
                   "  --experts K           MoE models: K expert agents; each stage keeps the\n"
                   "                        share of its layers' experts that balances its work\n"
                   "                        with the agents' (docs/PLAN.md, docs/EXPERTS.md)\n"
                   "  --stage-experts E     every stage keeps E experts of each of its layers\n"
                   "                        instead (0: all on the agents)\n"
                   "  --plan-dir DIR        where to write plan.json (default: a new /tmp dir)\n"
                   "  --base-port P         stage i listens on P+i, the bridge on P-1 (default:\n"
                   "                        a random free range below the ephemeral ports)\n"
                   "  --row-width N --microbatches N --max-seqs N --ctx N --kv-blocks N\n"
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
               "  --api-key KEY         require 'Authorization: Bearer KEY' (or env\n"
               "                        KVASIR_API_KEY)\n"
               "  --ttft-ms MS          first-token budget of requests that give none (default\n"
               "                        60000: only hopeless queues are refused)\n"
               "  --total-ms MS         whole-answer budget of requests that give none\n"
               "                        (default 600000)\n"
               "  --no-admission        admit everything that fits (no budget check)\n"
               "  --no-prefix-cache     compute every prompt whole (no KV reuse)\n"
               "  --max-waiting N       bounded wait queue (default 4 x max-seqs)\n"
               "  --name NAME           model name in the API (default: the file name)\n"
               "  --chat-template NAME|FILE  format chats with a built-in template (chatml,\n"
               "                        llama2, llama3, mistral, zephyr) or a Jinja file\n"
               "                        instead of the model's tokenizer.chat_template\n"
               "  --tls-cert FILE       serve HTTPS with this PEM certificate (chain) ...\n"
               "  --tls-key FILE        ... and this PEM private key\n");
    if (!serve)
        fprintf(f, "  --secret-file FILE    the cluster secret (instead of the plan's)\n"
                   "  --replan-after S      once the ring has been up, re-plan it over the\n"
                   "                        stages that still answer when it has been broken\n"
                   "                        for S seconds (default 10; 0 = never; held\n"
                   "                        requests fail after 30 s)\n");
}

static int parse(int argc, char **argv, bool serve, struct serve_opts *o)
{
    memset(o, 0, sizeof *o);
    o->host = "127.0.0.1";
    o->port = 8080;
    o->stages = 2;
    o->threads = 1;
    /* Defaults for clients that send no budget: generous, so that a CPU ring under
     * ordinary load serves them (a 16-client load on TinyLlama-1.1B Q4_0 waits ~10 s for a
     * first token here); clients that care send their own. */
    o->ttft_ms = 60000;
    o->total_ms = 600000;
    /* A restarted stage is back within a few seconds; a host gone for 10 s is taken for
     * gone, which leaves held requests (30 s, sched.h) most of their time to finish. serve
     * restarts its own stages, so it never re-plans. */
    o->replan_after_s = serve ? 0 : 10;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout, serve);
            return 1;
        }
        if (!strcmp(a, "--no-prefix-cache")) {
            o->no_prefix_cache = true;
            continue;
        }
        if (serve && !strcmp(a, "--no-standby")) {
            o->no_standby = true;
            continue;
        }
        if (!strcmp(a, "--no-admission")) {
            o->no_admission = true;
            continue;
        }
        if (serve && !strcmp(a, "--no-encrypt")) { /* plain frames on the ring's links */
            o->spec.no_encrypt = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "kvasir: %s needs a value\n", a);
            return 2;
        }
        i++;
        uint32_t *num = NULL, lo = 1, hi = 1u << 30;
        if (serve && (!strcmp(a, "-m") || !strcmp(a, "--model")))
            o->model = v;
        else if (!serve && !strcmp(a, "--plan"))
            o->plan_path = v;
        else if (!strcmp(a, "--host"))
            o->host = v;
        else if (!strcmp(a, "--api-key"))
            o->api_key = v;
        else if (!strcmp(a, "--name"))
            o->name = v;
        else if (!strcmp(a, "--chat-template"))
            o->chat_template = v;
        else if (!serve && !strcmp(a, "--secret-file"))
            o->secret_file = v;
        else if (!strcmp(a, "--tls-cert"))
            o->tls_cert = v;
        else if (!strcmp(a, "--tls-key"))
            o->tls_key = v;
        else if (serve && !strcmp(a, "--plan-dir"))
            o->plan_dir = v;
        else if (!strcmp(a, "--port"))
            num = &o->port, lo = 0, hi = 65535;
        else if (!strcmp(a, "--ttft-ms"))
            num = &o->ttft_ms, lo = 0;
        else if (!strcmp(a, "--total-ms"))
            num = &o->total_ms, lo = 0;
        else if (!strcmp(a, "--max-waiting"))
            num = &o->max_waiting;
        else if (!serve && !strcmp(a, "--replan-after"))
            num = &o->replan_after_s, lo = 0, hi = 3600;
        else if (serve && !strcmp(a, "--stages"))
            num = &o->stages, lo = 0, hi = KVR_PLAN_MAX_STAGES;
        else if (serve && !strcmp(a, "--experts"))
            num = &o->spec.n_agents, lo = 0, hi = KVR_PLAN_MAX_AGENTS;
        else if (serve && !strcmp(a, "--stage-experts")) {
            num = &o->spec.keep, lo = 0;
            o->spec.keep_fixed = true;
        } else if (serve && !strcmp(a, "--threads"))
            num = &o->threads, hi = 256;
        else if (serve && !strcmp(a, "--base-port"))
            num = &o->spec.base_port, lo = 2, hi = 65535;
        else if (serve && !strcmp(a, "--row-width"))
            num = &o->spec.row_width;
        else if (serve && !strcmp(a, "--microbatches"))
            num = &o->spec.microbatches;
        else if (serve && !strcmp(a, "--max-seqs"))
            num = &o->spec.max_seqs;
        else if (serve && !strcmp(a, "--ctx"))
            num = &o->spec.n_ctx;
        else if (serve && !strcmp(a, "--kv-blocks"))
            num = &o->spec.kv_blocks;
        else if (serve && !strcmp(a, "--kv-mem"))
            num = &o->spec.kv_mib;
        else if (serve && !strcmp(a, "--kv-type"))
            o->spec.kv_type = v;
        else if (serve && !strcmp(a, "--wire")) {
            if (strcmp(v, "f32") && strcmp(v, "f16")) {
                fprintf(stderr, "kvasir serve: --wire is f32 or f16\n");
                return 2;
            }
            o->spec.wire_dtype = strcmp(v, "f16") ? KVR_DTYPE_F32 : KVR_DTYPE_F16;
        } else {
            fprintf(stderr, "kvasir: unknown option '%s'\n", a);
            usage(stderr, serve);
            return 2;
        }
        if (num && kvr_cli_u32(a, v, lo, hi, num))
            return 2;
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

/* A stage runs in a process group of its own, so a terminal's Ctrl-C (or a signal to
 * serve's group) reaches serve alone, which then stops the ring in order; and it is killed
 * if serve dies without stopping it. */
static sigset_t run_mask; /* the signal mask serve started with: its stages get it back */

/* `kvasir stage` for process i < n_stages (with --standby: its warm standby), else
 * `kvasir experts` for agent i - n_stages. */
static pid_t spawn_stage(const char *self, const char *plan_path, uint32_t i, uint32_t n_stages,
                         bool standby)
{
    uint32_t index = i < n_stages ? i : i - n_stages;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    sigprocmask(SIG_SETMASK, &run_mask, NULL);
    setpgid(0, 0);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
        _exit(127); /* serve is already gone */
    char idx[16];
    snprintf(idx, sizeof idx, "%u", index);
    char *args[] = {(char *)"kvasir",
                    (char *)(i < n_stages ? "stage" : "experts"),
                    (char *)"--plan",
                    (char *)plan_path,
                    (char *)"--index",
                    idx,
                    standby ? (char *)"--standby" : NULL,
                    NULL};
    execv(self, args);
    fprintf(stderr, "kvasir serve: cannot start %s %u: %s\n", args[1], index, strerror(errno));
    _exit(127);
}

/* Warm standbys (ring/stage.h) double the resident weights: they are started only when
 * the memory available, with every stage loaded, holds all the slices once more and a
 * quarter to spare, and not for expert rings (a standby would meet the agents twice). */
static bool standby_fits(const struct kvr_gguf *g, const struct kvr_plan *plan)
{
    if (plan->n_agents)
        return false;
    size_t weights = 0;
    for (uint32_t i = 0; i < plan->n_stages; i++) {
        struct kvr_engine_config cfg;
        struct kvr_engine_bytes b;
        kvr_stage_engine_config(plan, i, &cfg);
        if (kvr_engine_expected_bytes(g, &cfg, &b, NULL))
            return false;
        weights += b.weights;
    }
    unsigned long long avail_kib = 0;
    char line[256];
    FILE *f = fopen("/proc/meminfo", "r");
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &avail_kib) == 1)
            break;
    if (f)
        fclose(f);
    return avail_kib * 1024 >= weights + weights / 4;
}

/* A random base for `span` consecutive listening ports, below the kernel's ephemeral range
 * (ip_local_port_range; 32768 if unreadable) and from 10000 up. A port inside the
 * ephemeral range (what binding port 0 returns) can be taken, between the check and the
 * stage's own bind, as the source port of any outgoing connection on the machine:
 * experts_recover's stage 0 failed that way under a loaded ctest ("Address already in
 * use"). 0 if the range below is too small. */
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

static int write_plan(struct serve_opts *o, struct kvr_gguf *g, struct kvr_plan *plan,
                      char *plan_path, size_t cap)
{
    struct kvr_err err = {0};
    char dir[512];
    if (o->plan_dir) {
        snprintf(dir, sizeof dir, "%s", o->plan_dir);
        mkdir(dir, 0700);
    } else {
        snprintf(dir, sizeof dir, "/tmp/kvasir-serve-XXXXXX");
        if (!mkdtemp(dir)) {
            fprintf(stderr, "kvasir serve: mkdtemp: %s\n", strerror(errno));
            return -1;
        }
        snprintf(o->tmp_dir, sizeof o->tmp_dir, "%s", dir);
    }
    char model_abs[4096];
    if (!realpath(o->model, model_abs)) {
        fprintf(stderr, "kvasir serve: %s: %s\n", o->model, strerror(errno));
        return -1;
    }
    o->spec.n_stages = o->stages;
    o->spec.n_threads = o->threads;
    o->spec.model_path = model_abs;
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
    struct kvr_hparams hp;
    if (plan->n_agents && !kvr_hparams_read(&hp, g, &err)) {
        char line[2048];
        kvr_plan_experts_describe(plan, hp.moe.n_expert, line, sizeof line);
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

/* serve's stage processes (stages, then expert agents) and the stages' warm standbys. */
struct procs {
    char self[4096]; /* this executable */
    const char *plan_path;
    const struct kvr_plan *plan;
    pid_t *pids;                            /* n: stages, then agents; 0 = none */
    pid_t standby[KVR_PLAN_MAX_STAGES + 1]; /* per stage; 0 = none */
    uint64_t standby_due_ns[KVR_PLAN_MAX_STAGES + 1]; /* a new one starts then; 0 = none */
    uint32_t n;
};

/* A standby that took a stage's place is replaced STANDBY_DELAY_MS later: loading one
 * (hundreds of milliseconds of CPU) at once would slow the ring re-computing its held
 * sequences, which is what the client is waiting for. */
enum { STANDBY_DELAY_MS = 3000 };

/* Start the standbys that are due; the time the next one is due (0: none). */
static uint64_t standbys_due(struct procs *p)
{
    uint64_t now = kvr_now_ns(), next = 0;
    for (uint32_t i = 0; i < p->plan->n_stages; i++) {
        uint64_t due = p->standby_due_ns[i];
        if (due && due <= now) {
            p->standby[i] = spawn_stage(p->self, p->plan_path, i, p->plan->n_stages, true);
            p->standby_due_ns[i] = 0;
        } else if (due && (!next || due < next)) {
            next = due;
        }
    }
    return next;
}

/* Reap the processes that died and replace them: a stage by its standby when it has one
 * (already loaded: it takes the address at once) and a new standby behind it, else by a
 * new stage. A standby that dies is not replaced (its stage is restarted if it dies).
 * False when a stage died before the ring was ever up (a start-up failure: stop). */
static bool reap_procs(struct procs *p, bool ever_up)
{
    uint32_t n_stages = p->plan->n_stages;
    int status;
    for (uint32_t i = 0; i < n_stages; i++)
        if (p->standby[i] > 0 && waitpid(p->standby[i], &status, WNOHANG) == p->standby[i]) {
            KVR_WARN("the standby of stage %u exited (status %d)", i, status);
            p->standby[i] = 0;
        }
    for (uint32_t i = 0; i < p->n; i++) {
        if (p->pids[i] <= 0 || waitpid(p->pids[i], &status, WNOHANG) != p->pids[i])
            continue;
        const char *what = i < n_stages ? "stage" : "expert agent";
        uint32_t idx = i < n_stages ? i : i - n_stages;
        if (!ever_up) {
            KVR_ERROR("%s %u exited before the ring came up (status %d)", what, idx, status);
            p->pids[i] = 0;
            return false;
        }
        if (i < n_stages && p->standby[i] > 0) {
            KVR_WARN("stage %u died (status %d): its standby takes over; a new standby starts "
                     "in %d ms",
                     i, status, STANDBY_DELAY_MS);
            p->pids[i] = p->standby[i];
            p->standby[i] = 0;
            p->standby_due_ns[i] = kvr_now_ns() + (uint64_t)STANDBY_DELAY_MS * 1000000u;
        } else {
            KVR_WARN("%s %u died (status %d): starting it again", what, idx, status);
            p->pids[i] = spawn_stage(p->self, p->plan_path, i, n_stages, false);
        }
    }
    return true;
}

/* Once the ring is first up (so they never slow its start): a standby per stage. */
static void start_standbys(struct procs *p, const struct kvr_gguf *g)
{
    if (!standby_fits(g, p->plan)) {
        KVR_INFO("no warm standbys (%s): a stage that dies is restarted and reloads its layers",
                 p->plan->n_agents ? "expert agents" : "not enough memory available");
        return;
    }
    for (uint32_t i = 0; i < p->plan->n_stages; i++)
        p->standby[i] = spawn_stage(p->self, p->plan_path, i, p->plan->n_stages, true);
    KVR_INFO("a warm standby per stage started: it takes the stage's place when it dies "
             "(--no-standby: none)");
}

/* ---- the common part ------------------------------------------------------------------------ */

static int serve_main(int argc, char **argv, bool serve)
{
    struct serve_opts o;
    int rc = parse(argc, argv, serve, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    kvr_log_set_tag(serve ? "serve" : "bridge");
    struct kvr_err err = {0};
    struct kvr_plan *plan = kvr_calloc(1, sizeof *plan);
    struct kvr_gguf *g = NULL;
    struct kvr_tok *tok = NULL;
    struct kvr_bridge *bridge = NULL;
    struct kvr_http *http = NULL;
    char *chat_src = NULL;
    struct procs *procs = NULL;
    char plan_path[1024] = "";
    char model_path[KVR_PLAN_PATH_BYTES];
    rc = 1;
    if (!plan)
        goto out;
    if (serve) {
        snprintf(model_path, sizeof model_path, "%s", o.model);
    } else if (kvr_plan_load_with_secret(plan, o.plan_path, o.secret_file, &err) ||
               kvr_plan_validate(plan, 0, &err) ||
               kvr_plan_path(plan, plan->model_path, model_path, sizeof model_path, &err)) {
        KVR_ERROR("plan %s: %s", o.plan_path, err.msg);
        goto out;
    }
    if (kvr_gguf_open(&g, model_path, &err)) {
        KVR_ERROR("%s: %s", model_path, err.msg);
        goto out;
    }
    struct kvr_hparams hp;
    if (kvr_hparams_read(&hp, g, &err) || kvr_tok_create(&tok, g, &err)) {
        KVR_ERROR("%s: %s", model_path, err.msg);
        goto out;
    }
    if (serve && write_plan(&o, g, plan, plan_path, sizeof plan_path))
        goto out;
    if (!serve && kvr_plan_validate(plan, hp.n_layer, &err)) {
        KVR_ERROR("plan %s: %s", o.plan_path, err.msg);
        goto out;
    }

    /* Signals are taken synchronously by this thread (sigtimedwait), never by a handler:
     * SIGINT and SIGTERM stop, SIGCHLD says a stage died. Blocked before any thread
     * starts, so every thread inherits the mask and none of them is interrupted. */
    kvr_cli_on_stop(on_signal);
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGCHLD);
    sigprocmask(SIG_BLOCK, &sigs, &run_mask);

    if (serve) {
        procs = kvr_calloc(1, sizeof *procs);
        if (!procs)
            goto out;
        char *self = procs->self;
        ssize_t n = readlink("/proc/self/exe", self, sizeof procs->self - 1);
        if (n <= 0) {
            KVR_ERROR("cannot find my own executable");
            goto out;
        }
        self[n] = 0;
        procs->plan_path = plan_path;
        procs->plan = plan;
        procs->n = plan->n_stages + plan->n_agents;
        procs->pids = kvr_calloc(procs->n, sizeof *procs->pids);
        if (!procs->pids)
            goto out;
        for (uint32_t i = 0; i < procs->n; i++)
            procs->pids[i] = spawn_stage(self, plan_path, i, plan->n_stages, false);
        KVR_INFO("plan %s: %u stages and %u expert agents started", plan_path, plan->n_stages,
                 plan->n_agents);
    }

    struct kvr_bridge_config bc = {.plan = plan,
                                   .n_embd = hp.n_embd,
                                   .n_vocab = hp.n_vocab,
                                   .max_waiting = o.max_waiting,
                                   .admission = !o.no_admission,
                                   .no_prefix_cache = o.no_prefix_cache,
                                   .replan_after_ms = o.replan_after_s * 1000,
                                   .gguf = g};
    if (kvr_bridge_create(&bridge, &bc, &err)) {
        KVR_ERROR("bridge: %s", err.msg);
        goto out;
    }

    /* HTTP listens at once: while the ring forms (or whenever it is broken) /health and
     * /readyz answer 503 with each stage's state, and requests are refused (ring_down). */
    struct kvr_ring_service rs = {.bridge = bridge,
                                  .plan = plan,
                                  .default_first_token_ms = o.ttft_ms,
                                  .default_total_ms = o.total_ms};
    const char *base = strrchr(model_path, '/');
    struct kvr_gguf_str tmpl = {0};
    if (kvr_gguf_get_str(g, "tokenizer.chat_template", &tmpl, NULL) != 0)
        tmpl.ptr = NULL, tmpl.len = 0;
    struct kvr_service svc = {.ops = &kvr_ring_service_ops,
                              .ctx = &rs,
                              .model_name = o.name ? o.name
                                            : base ? base + 1
                                                   : model_path,
                              .n_ctx = plan->n_ctx,
                              .tok = tok,
                              .chat_template = tmpl.ptr,
                              .chat_template_len = (size_t)tmpl.len};
    struct kvr_http_config hc;
    kvr_http_config_init(&hc);
    hc.host = o.host;
    hc.port = (uint16_t)o.port;
    /* A stream sends nothing until its first token: the connection must outlive the
     * first-token budget (libmicrohttpd closes one that is quiet for idle_timeout_s). */
    if (o.ttft_ms / 1000 + 5 > hc.idle_timeout_s)
        hc.idle_timeout_s = o.ttft_ms / 1000 + 5;
    if (o.api_key)
        hc.api_key = o.api_key;
    hc.tls_cert_file = o.tls_cert;
    hc.tls_key_file = o.tls_key;
    if (o.chat_template && kvr_cli_chat_template(o.chat_template, &hc.chat_template, &chat_src,
                                                 &hc.chat_template_src_len))
        goto out;
    hc.chat_template_src = chat_src;
    if (kvr_http_create(&http, &hc, &svc, &err)) {
        KVR_ERROR("http: %s", err.msg);
        goto out;
    }
    const char *scheme = o.tls_cert ? "https" : "http";
    KVR_INFO("listening on %s://%s:%u; waiting for the ring to come up (/health says which "
             "stage is missing)",
             scheme, o.host, kvr_http_port(http));

    bool ready = false, ever_up = false;
    while (!stop_flag) {
        if (!ready && kvr_bridge_ring_up(bridge)) {
            ready = ever_up = true;
            KVR_INFO("serving %s on %s://%s:%u (%u stages, admission %s)", svc.model_name, scheme,
                     o.host, kvr_http_port(http), plan->n_stages, o.no_admission ? "off" : "on");
            printf("kvasir: ready on %s://%s:%u\n", scheme, o.host, kvr_http_port(http));
            fflush(stdout);
            if (procs && !o.no_standby)
                start_standbys(procs, g);
        }
        /* Until the ring is first up, look again every second (kvr_bridge_wait_up would
         * hide the signals); after that, sleep until a signal comes or a standby is due. */
        int sig;
        uint64_t due = procs ? standbys_due(procs) : 0, now = kvr_now_ns();
        if (!ready || due) {
            uint64_t wait_ns = !due ? 1000000000u : due > now ? due - now : 0;
            struct timespec ts = {(time_t)(wait_ns / 1000000000u), (long)(wait_ns % 1000000000u)};
            sig = sigtimedwait(&sigs, NULL, &ts);
        } else {
            sig = sigwaitinfo(&sigs, NULL);
        }
        if (sig == SIGINT || sig == SIGTERM)
            stop_flag = 1;
        if (procs && !stop_flag && !reap_procs(procs, ever_up))
            stop_flag = 1;
    }
    KVR_INFO("stopping");
    rc = 0;
out:
    /* Front to back: no new requests; the bridge stops sending but keeps its links (so it
     * does not take the ring going down for a failure to recover from, nor the tail its
     * bridge's going for a lost link); then the stages from the head on, each gone before
     * the next is told, so each sees its upstream say goodbye. */
    kvr_http_destroy(http);
    kvr_free(chat_src);
    kvr_bridge_stop(bridge);
    for (uint32_t i = 0; procs && i < plan->n_stages; i++)
        if (procs->standby[i] > 0) { /* first: a standby would take a stopped stage's place */
            kill(procs->standby[i], SIGTERM);
            waitpid(procs->standby[i], NULL, 0);
        }
    for (uint32_t i = 0; procs && procs->pids && i < procs->n; i++)
        if (procs->pids[i] > 0) {
            kill(procs->pids[i], SIGTERM);
            waitpid(procs->pids[i], NULL, 0);
        }
    /* The plan holds the ring's secret: do not leave it behind in /tmp. */
    if (serve && o.tmp_dir[0]) {
        char key_path[600];
        snprintf(key_path, sizeof key_path, "%s/plan.key", o.tmp_dir);
        unlink(key_path);
        if (plan_path[0])
            unlink(plan_path);
        rmdir(o.tmp_dir);
    }
    kvr_bridge_destroy(bridge);
    if (procs)
        kvr_free(procs->pids);
    kvr_free(procs);
    kvr_tok_destroy(tok);
    kvr_gguf_close(g);
    if (plan) {
        kvr_plan_wipe(plan);
        kvr_free(plan);
    }
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
