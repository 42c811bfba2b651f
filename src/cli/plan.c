/* plan.c - `kvasir plan -m MODEL --stages N ...`: write a valid, balanced plan. */
#include "cli/cmd.h"
#include "cli/common.h"

#include "core/alloc.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "ring/plan.h"
#include "ring/propose.h"
#include "cli/emit.h"
#include "cli/serve_env.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvasir plan -m MODEL --stages N [options] [-o PLAN.json]\n"
            "  Split MODEL's layers over N stages, balanced by the bytes each reads per\n"
            "  token (the head also pays for the embedding, the tail for the output head).\n"
            "  --hosts H1,H2,...    stage hosts (one, or one per stage; default 127.0.0.1)\n"
            "  --base-port P        stage i listens on P+i (default 7001)\n"
            "  --bridge HOST:PORT   where the bridge listens for the tail (default host 1, P-1)\n"
            "  --speeds S1,S2,...   relative stage speeds (default all equal)\n"
            "  --experts K          MoE models: K expert agents on the first host, ports\n"
            "                       P+N..; each stage keeps the share of its layers' experts\n"
            "                       that balances its work with the agents' (docs/PLAN.md)\n"
            "  --expert-speeds S1,..  relative agent speeds, in --speeds' unit (default 1)\n"
            "  --stage-experts E    every stage keeps E experts of each of its layers instead\n"
            "                       (0: all on the agents)\n"
            "  --layers A-B,C-D,... set the split by hand instead (inclusive ranges)\n"
            "  --row-width N        token rows per micro-batch (default 64)\n"
            "  --microbatches N     micro-batches in flight (default N stages)\n"
            "  --max-seqs N         live sequences (default 32)\n"
            "  --ctx N              context per sequence (default min(2048, model))\n"
            "  --kv-block N         KV block size in tokens (default 16)\n"
            "  --kv-blocks N        KV blocks per stage (default: max-seqs x ctx)\n"
            "  --wire f32|f16       boundary dtype on the wire (default f32)\n"
            "  --threads N          compute threads per stage (default 1)\n"
            "  --secret-file FILE   the cluster secret's file: used if it exists, else made\n"
            "                       (mode 0600) with a fresh secret (default: PLAN.key\n"
            "                       beside -o PLAN.json); the plan names it, never holds it\n"
            "  --no-encrypt         plain frames on the ring's links (\"encrypt\": false)\n"
            "  --no-fingerprint     do not record the model's fingerprint (stages then do\n"
            "                       not check their model file)\n"
            "  --emit systemd|compose|kubernetes DIR\n"
            "                       also write unit / compose / manifest files to DIR\n"
            "  -o FILE              write here (default: stdout; needs --secret-file)\n");
}

/* Replace the balanced split with "A-B,C-D,..." (one range per stage) and validate. */
static int set_layers(struct kvr_plan *plan, const char *spec, const struct kvr_gguf *g,
                      struct kvr_err *err)
{
    const char *p = spec;
    for (uint32_t i = 0; i < plan->n_stages; i++) {
        char *end;
        unsigned long a = strtoul(p, &end, 10);
        if (end == p || *end != '-')
            return kvr_err_set(err, KVR_EINVAL, "want %u ranges like 0-10,11-21", plan->n_stages);
        p = end + 1;
        unsigned long b = strtoul(p, &end, 10);
        if (end == p || (*end != ',' && *end != 0) || (i + 1 < plan->n_stages) != (*end == ','))
            return kvr_err_set(err, KVR_EINVAL, "want %u ranges like 0-10,11-21", plan->n_stages);
        plan->stages[i].first_layer = (uint32_t)a;
        plan->stages[i].last_layer = (uint32_t)b;
        p = *end ? end + 1 : end;
    }
    struct kvr_hparams hp;
    int rc = kvr_hparams_read(&hp, g, err);
    return rc ? rc : kvr_plan_validate(plan, hp.n_layer, err);
}

/* Where the plan refers to its secret file: by its name alone when both are in one folder
 * (so the folder can move), else by its absolute path. */
static int secret_ref(const char *key_path, const char *plan_path, char *out, size_t cap)
{
    const char *ks = strrchr(key_path, '/'), *ps = plan_path ? strrchr(plan_path, '/') : NULL;
    size_t kd = ks ? (size_t)(ks - key_path) : 0, pd = ps ? (size_t)(ps - plan_path) : 0;
    if (plan_path && kd == pd && !strncmp(key_path, plan_path, kd)) {
        const char *name = ks ? ks + 1 : key_path;
        if (strlen(name) >= cap)
            return -1;
        memcpy(out, name, strlen(name) + 1);
        return 0;
    }
    char abs[4096];
    if (!realpath(key_path, abs))
        return -1;
    if (strlen(abs) >= cap)
        return -1;
    memcpy(out, abs, strlen(abs) + 1);
    return 0;
}

/* Give the plan its secret file: an existing one is read (and checked), a missing one is
 * made with the plan's fresh secret. */
static int setup_secret(struct kvr_plan *plan, const char *key_path, const char *plan_path,
                        struct kvr_err *err)
{
    char ref[KVR_PLAN_PATH_BYTES];
    if (access(key_path, F_OK) == 0) {
        int rc = kvr_plan_use_secret_file(plan, key_path, err);
        if (rc)
            return rc;
        if (secret_ref(key_path, plan_path, ref, sizeof ref))
            return kvr_err_set(err, KVR_EIO, "%s: %s", key_path, strerror(errno));
        snprintf(plan->secret_file, sizeof plan->secret_file, "%s", ref);
        fprintf(stderr, "kvasir plan: using the secret in %s\n", key_path);
        return 0;
    }
    /* Made first under its own name, so that secret_ref can resolve it. */
    int rc = kvr_plan_write_secret_file(plan, key_path, key_path, err);
    if (rc)
        return rc;
    if (secret_ref(key_path, plan_path, ref, sizeof ref))
        return kvr_err_set(err, KVR_EIO, "%s: %s", key_path, strerror(errno));
    snprintf(plan->secret_file, sizeof plan->secret_file, "%s", ref);
    fprintf(stderr, "kvasir plan: wrote a new cluster secret to %s (mode 0600)\n", key_path);
    return 0;
}

/* "S1,S2,...": n positive numbers. */
static int parse_speeds(const char *opt, const char *v, uint32_t n, double *out)
{
    const char *p = v;
    for (uint32_t i = 0; i < n; i++) {
        char *end;
        out[i] = strtod(p, &end);
        if (end == p || !(out[i] > 0) || (*end != ',' && *end != 0) ||
            (i + 1 < n) != (*end == ',')) {
            fprintf(stderr, "kvasir plan: %s wants %u positive numbers\n", opt, n);
            return 2;
        }
        p = *end ? end + 1 : end;
    }
    if (n == 0) {
        fprintf(stderr, "kvasir plan: %s needs --experts K first\n", opt);
        return 2;
    }
    return 0;
}

/* What the command line asked for. */
struct plan_args {
    const char *model, *out, *speeds, *layers, *key, *agent_speeds, *emit, *emit_dir;
    bool fingerprint;
    struct kvr_plan_spec spec; /* points into speed[], agent_speed[] once validated */
    char key_buf[4096];        /* the secret file's path when derived from -o */
    double speed[KVR_PLAN_MAX_STAGES], agent_speed[KVR_PLAN_MAX_AGENTS];
};

/* A numeric option: where its value goes and its bounds [*lo, *hi] (preset to 1 and
 * 2^30); NULL when `a` is not one. */
static uint32_t *num_opt(struct kvr_plan_spec *spec, const char *a, uint32_t *lo, uint32_t *hi)
{
    if (!strcmp(a, "--stage-experts")) {
        spec->keep_fixed = true;
        return *lo = 0, &spec->keep;
    }
    if (!strcmp(a, "--stages"))
        return *lo = 0, *hi = KVR_PLAN_MAX_STAGES, &spec->n_stages;
    if (!strcmp(a, "--experts"))
        return *lo = 0, *hi = KVR_PLAN_MAX_AGENTS, &spec->n_agents;
    if (!strcmp(a, "--base-port"))
        return *hi = 65535, &spec->base_port;
    if (!strcmp(a, "--row-width"))
        return &spec->row_width;
    if (!strcmp(a, "--microbatches"))
        return &spec->microbatches;
    if (!strcmp(a, "--max-seqs"))
        return &spec->max_seqs;
    if (!strcmp(a, "--ctx"))
        return &spec->n_ctx;
    if (!strcmp(a, "--kv-block"))
        return &spec->kv_block_tokens;
    if (!strcmp(a, "--kv-blocks"))
        return &spec->kv_blocks;
    if (!strcmp(a, "--kv-mem"))
        return &spec->kv_mib;
    if (!strcmp(a, "--threads"))
        return &spec->n_threads;
    return NULL;
}

/* --emit KIND DIR: argv[*i] is KIND; DIR is taken from the next argument. Returns 0 or 2. */
static int parse_emit(struct plan_args *pa, int argc, char **argv, int *i)
{
    pa->emit = argv[*i];
    if (*i + 1 >= argc) {
        fprintf(stderr, "kvasir plan: --emit needs a kind and a folder\n");
        return 2;
    }
    pa->emit_dir = argv[++*i];
    if (strcmp(pa->emit, "systemd") && strcmp(pa->emit, "compose") &&
        strcmp(pa->emit, "kubernetes")) {
        fprintf(stderr, "kvasir plan: --emit is systemd, compose or kubernetes, not '%s'\n",
                pa->emit);
        return 2;
    }
    return 0;
}

/* An option with its value argv[*i] (--emit takes one more). Returns 0, 2 after printing
 * why, or 1 when `a` is no option of plan's. */
static int parse_text_opt(struct plan_args *pa, const char *a, int argc, char **argv, int *i)
{
    const char *v = argv[*i];
    if (!strcmp(a, "-m") || !strcmp(a, "--model"))
        pa->model = v;
    else if (!strcmp(a, "-o"))
        pa->out = v;
    else if (!strcmp(a, "--hosts"))
        pa->spec.hosts = v;
    else if (!strcmp(a, "--bridge"))
        pa->spec.bridge_addr = v;
    else if (!strcmp(a, "--speeds"))
        pa->speeds = v;
    else if (!strcmp(a, "--expert-speeds"))
        pa->agent_speeds = v;
    else if (!strcmp(a, "--layers"))
        pa->layers = v;
    else if (!strcmp(a, "--secret-file"))
        pa->key = v;
    else if (!strcmp(a, "--kv-type"))
        pa->spec.kv_type = v;
    else if (!strcmp(a, "--emit"))
        return parse_emit(pa, argc, argv, i);
    else if (!strcmp(a, "--wire")) {
        if (!strcmp(v, "f32"))
            pa->spec.wire_dtype = KVR_DTYPE_F32;
        else if (!strcmp(v, "f16"))
            pa->spec.wire_dtype = KVR_DTYPE_F16;
        else {
            fprintf(stderr, "kvasir plan: --wire is f32 or f16, not '%s'\n", v);
            return 2;
        }
    } else
        return 1;
    return 0;
}

/* Returns 0, 1 after --help, or 2 after printing what is wrong. */
static int parse(int argc, char **argv, struct plan_args *pa)
{
    memset(pa, 0, sizeof *pa);
    pa->fingerprint = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--no-encrypt")) {
            pa->spec.no_encrypt = true;
            continue;
        }
        if (!strcmp(a, "--no-fingerprint")) {
            pa->fingerprint = false;
            continue;
        }
        if (!v) {
            fprintf(stderr, "kvasir plan: %s needs a value\n", a);
            return 2;
        }
        i++;
        uint32_t lo = 1, hi = 1u << 30;
        uint32_t *num = num_opt(&pa->spec, a, &lo, &hi);
        int rc = num ? 0 : parse_text_opt(pa, a, argc, argv, &i);
        if (rc == 1) {
            kvr_cli_unknown_usage("plan", a, usage);
            return 2;
        }
        if (rc || (num && kvr_cli_u32(a, v, lo, hi, num)))
            return 2;
    }
    return 0;
}

/* The options that only make sense together; derives the secret file's path from -o and
 * reads the speeds. Returns 0 or 2 after printing why. */
static int validate(struct plan_args *pa)
{
    if (!pa->model || !pa->spec.n_stages) {
        usage(stderr);
        return 2;
    }
    if (!pa->out && !pa->key) {
        fprintf(stderr, "kvasir plan: give -o PLAN.json (the secret goes to PLAN.key beside it) "
                        "or --secret-file FILE: the cluster secret is never written into the "
                        "plan\n");
        return 2;
    }
    if (pa->emit && !pa->out) {
        fprintf(stderr, "kvasir plan: --emit needs -o PLAN.json (the files refer to it)\n");
        return 2;
    }
    if (!pa->key) {
        size_t n = strlen(pa->out);
        if (n > 5 && !strcmp(pa->out + n - 5, ".json"))
            n -= 5;
        if (n + 5 > sizeof pa->key_buf) {
            fprintf(stderr, "kvasir plan: %s: path too long\n", pa->out);
            return 2;
        }
        snprintf(pa->key_buf, sizeof pa->key_buf, "%.*s.key", (int)n, pa->out);
        pa->key = pa->key_buf;
    }
    if (pa->speeds) {
        if (parse_speeds("--speeds", pa->speeds, pa->spec.n_stages, pa->speed))
            return 2;
        pa->spec.stage_speed = pa->speed;
    }
    if (pa->agent_speeds) {
        if (parse_speeds("--expert-speeds", pa->agent_speeds, pa->spec.n_agents, pa->agent_speed))
            return 2;
        pa->spec.agent_speed = pa->agent_speed;
    }
    pa->spec.model_path = pa->model;
    return 0;
}

/* Write the plan to -o (then say what it holds, and --emit), or print it. Returns 0 or -1
 * after printing why. */
static int output(const struct plan_args *pa, const struct kvr_plan *plan, const struct kvr_gguf *g)
{
    struct kvr_err err = {0};
    if (!pa->out) {
        char *json = NULL;
        if (kvr_plan_to_json(plan, &json, &err)) {
            fprintf(stderr, "kvasir plan: %s\n", err.msg);
            return -1;
        }
        fputs(json, stdout);
        kvr_free(json);
        return 0;
    }
    if (kvr_plan_write(plan, pa->out, &err)) {
        fprintf(stderr, "kvasir plan: %s\n", err.msg);
        return -1;
    }
    fprintf(stderr, "kvasir plan: wrote %s (%u stages:", pa->out, plan->n_stages);
    for (uint32_t i = 0; i < plan->n_stages; i++)
        fprintf(stderr, " %u-%u", plan->stages[i].first_layer, plan->stages[i].last_layer);
    fprintf(stderr, ")\n");
    struct kvr_hparams hp;
    char line[2048];
    if (plan->n_agents && !kvr_hparams_read(&hp, g, &err)) {
        kvr_plan_experts_describe(plan, hp.moe.n_expert, line, sizeof line);
        fprintf(stderr, "kvasir plan: experts: %s\n", line);
    }
    if (pa->emit && kvr_cli_emit(plan, pa->out, pa->emit, pa->emit_dir, &err)) {
        fprintf(stderr, "kvasir plan: --emit %s %s: %s\n", pa->emit, pa->emit_dir, err.msg);
        return -1;
    }
    return 0;
}

int kvr_cmd_plan(int argc, char **argv)
{
    struct plan_args *pa = kvr_malloc(sizeof *pa);
    if (!pa)
        return 1;
    int rc = parse(argc, argv, pa);
    if (rc == 0)
        rc = validate(pa);
    if (rc) {
        kvr_free(pa);
        return rc == 1 ? 0 : rc;
    }
    struct kvr_err err = {0};
    struct kvr_gguf *g = NULL;
    struct kvr_plan *plan = NULL;
    rc = 1;
    if (kvr_gguf_open(&g, pa->model, &err)) {
        fprintf(stderr, "kvasir plan: %s: %s\n", pa->model, err.msg);
        goto done;
    }
    /* A --ctx beyond the trained length: refused unless RoPE scaling stretches it. */
    struct kvr_hparams hp;
    if (pa->spec.n_ctx && kvr_hparams_read(&hp, g, &err)) {
        fprintf(stderr, "kvasir plan: %s\n", err.msg);
        goto done;
    }
    if (pa->spec.n_ctx && kvr_cli_ctx_check(pa->spec.n_ctx, &hp))
        goto done;
    if (pa->fingerprint)
        pa->spec.fingerprint = kvr_gguf_fingerprint(g);
    plan = kvr_malloc(sizeof *plan);
    if (!plan || kvr_plan_propose(plan, g, &pa->spec, &err)) {
        fprintf(stderr, "kvasir plan: %s\n", plan ? err.msg : "out of memory");
        goto done;
    }
    if (pa->layers && set_layers(plan, pa->layers, g, &err)) {
        fprintf(stderr, "kvasir plan: --layers %s: %s\n", pa->layers, err.msg);
        goto done;
    }
    if (setup_secret(plan, pa->key, pa->out, &err)) {
        fprintf(stderr, "kvasir plan: %s\n", err.msg);
        goto done;
    }
    if (output(pa, plan, g) == 0)
        rc = 0;
done:
    if (plan) {
        kvr_plan_wipe(plan);
        kvr_free(plan);
    }
    kvr_gguf_close(g);
    kvr_free(pa);
    return rc;
}
