/* plan.c - `kvasir plan -m MODEL --stages N ...`: write a valid, balanced plan. */
#include "cli/cmd.h"
#include "cli/common.h"

#include "core/alloc.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "ring/plan.h"
#include "ring/propose.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
            "  --layers A-B,C-D,... set the split by hand instead (inclusive ranges)\n"
            "  --row-width N        token rows per micro-batch (default 64)\n"
            "  --microbatches N     micro-batches in flight (default N stages)\n"
            "  --max-seqs N         live sequences (default 32)\n"
            "  --ctx N              context per sequence (default min(2048, model))\n"
            "  --kv-block N         KV block size in tokens (default 16)\n"
            "  --kv-blocks N        KV blocks per stage (default: max-seqs x ctx)\n"
            "  --wire f32|f16       boundary dtype on the wire (default f32)\n"
            "  --threads N          compute threads per stage (default 1)\n"
            "  -o FILE              write here (default: stdout); the file is made 0600\n"
            "                       because it holds the cluster secret\n");
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
            return kvr_err_set(err, KVR_EINVAL, "want %u ranges like 0-10,11-21",
                               plan->n_stages);
        p = end + 1;
        unsigned long b = strtoul(p, &end, 10);
        if (end == p || (*end != ',' && *end != 0) || (i + 1 < plan->n_stages) != (*end == ','))
            return kvr_err_set(err, KVR_EINVAL, "want %u ranges like 0-10,11-21",
                               plan->n_stages);
        plan->stages[i].first_layer = (uint32_t)a;
        plan->stages[i].last_layer = (uint32_t)b;
        p = *end ? end + 1 : end;
    }
    struct kvr_hparams hp;
    int rc = kvr_hparams_read(&hp, g, err);
    return rc ? rc : kvr_plan_validate(plan, hp.n_layer, err);
}

int kvr_cmd_plan(int argc, char **argv)
{
    const char *model = NULL, *out = NULL, *speeds = NULL, *layers = NULL;
    struct kvr_plan_spec spec = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint32_t *num = NULL;
        uint32_t lo = 1, hi = 1u << 30;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "kvasir plan: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "-m") || !strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "-o"))
            out = v;
        else if (!strcmp(a, "--hosts"))
            spec.hosts = v;
        else if (!strcmp(a, "--bridge"))
            spec.bridge_addr = v;
        else if (!strcmp(a, "--speeds"))
            speeds = v;
        else if (!strcmp(a, "--layers"))
            layers = v;
        else if (!strcmp(a, "--wire")) {
            if (!strcmp(v, "f32"))
                spec.wire_dtype = KVR_DTYPE_F32;
            else if (!strcmp(v, "f16"))
                spec.wire_dtype = KVR_DTYPE_F16;
            else {
                fprintf(stderr, "kvasir plan: --wire is f32 or f16, not '%s'\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--stages"))
            num = &spec.n_stages, lo = 0, hi = KVR_PLAN_MAX_STAGES;
        else if (!strcmp(a, "--base-port"))
            num = &spec.base_port, hi = 65535;
        else if (!strcmp(a, "--row-width"))
            num = &spec.row_width;
        else if (!strcmp(a, "--microbatches"))
            num = &spec.microbatches;
        else if (!strcmp(a, "--max-seqs"))
            num = &spec.max_seqs;
        else if (!strcmp(a, "--ctx"))
            num = &spec.n_ctx;
        else if (!strcmp(a, "--kv-block"))
            num = &spec.kv_block_tokens;
        else if (!strcmp(a, "--kv-blocks"))
            num = &spec.kv_blocks;
        else if (!strcmp(a, "--threads"))
            num = &spec.n_threads;
        else {
            fprintf(stderr, "kvasir plan: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
        if (num && kvr_cli_u32(a, v, lo, hi, num))
            return 2;
    }
    if (!model || !spec.n_stages) {
        usage(stderr);
        return 2;
    }
    double speed[KVR_PLAN_MAX_STAGES];
    if (speeds) {
        const char *p = speeds;
        for (uint32_t i = 0; i < spec.n_stages; i++) {
            char *end;
            speed[i] = strtod(p, &end);
            if (end == p || speed[i] <= 0 || (*end != ',' && *end != 0)) {
                fprintf(stderr, "kvasir plan: --speeds wants %u positive numbers\n",
                        spec.n_stages);
                return 2;
            }
            p = *end ? end + 1 : end;
        }
        spec.stage_speed = speed;
    }
    spec.model_path = model;
    struct kvr_err err = {0};
    struct kvr_gguf *g = NULL;
    if (kvr_gguf_open(&g, model, &err)) {
        fprintf(stderr, "kvasir plan: %s: %s\n", model, err.msg);
        return 1;
    }
    struct kvr_plan *plan = kvr_malloc(sizeof *plan);
    int rc = 1;
    if (!plan || kvr_plan_propose(plan, g, &spec, &err)) {
        fprintf(stderr, "kvasir plan: %s\n", plan ? err.msg : "out of memory");
        goto done;
    }
    if (layers && set_layers(plan, layers, g, &err)) {
        fprintf(stderr, "kvasir plan: --layers %s: %s\n", layers, err.msg);
        goto done;
    }
    if (out) {
        if (kvr_plan_write(plan, out, &err)) {
            fprintf(stderr, "kvasir plan: %s\n", err.msg);
            goto done;
        }
        fprintf(stderr, "kvasir plan: wrote %s (%u stages:", out, plan->n_stages);
        for (uint32_t i = 0; i < plan->n_stages; i++)
            fprintf(stderr, " %u-%u", plan->stages[i].first_layer, plan->stages[i].last_layer);
        fprintf(stderr, ")\n");
    } else {
        char *json = NULL;
        if (kvr_plan_to_json(plan, &json, &err)) {
            fprintf(stderr, "kvasir plan: %s\n", err.msg);
            goto done;
        }
        fputs(json, stdout);
        kvr_free(json);
    }
    rc = 0;
done:
    if (plan) {
        kvr_plan_wipe(plan);
        kvr_free(plan);
    }
    kvr_gguf_close(g);
    return rc;
}
