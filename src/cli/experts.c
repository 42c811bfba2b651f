/* experts.c - `kvasir experts --plan PLAN --index J`: run one expert agent (docs/EXPERTS.md) until
 * SIGINT or SIGTERM. */
#include "cli/cmd.h"
#include "cli/common.h"

#include "core/alloc.h"
#include "core/log.h"
#include "ring/plan.h"
#include "ring/experts.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

static atomic_int stop_flag; /* lock-free, so the signal handler may store to it */

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
    kvr_expert_agent_signal_stop();
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvasir experts --plan PLAN --index J [--threads N] [--secret-file FILE]\n"
               "  Serve expert agent J of PLAN's \"experts\" (see docs/EXPERTS.md): the\n"
               "  experts it places there, for the stages that own their layers.\n"
               "  --secret-file FILE   the cluster secret (mode 0600) instead of the plan's\n");
}

int kvr_cmd_experts(int argc, char **argv)
{
    const char *plan_path = NULL, *secret_file = NULL;
    struct kvr_expert_agent_options opt = {0};
    bool have_index = false;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--plan") && v) {
            plan_path = v;
            i++;
        } else if (!strcmp(argv[i], "--index") && v) {
            if (kvr_cli_u32("--index", v, 0, KVR_PLAN_MAX_AGENTS - 1, &opt.index))
                return 2;
            have_index = true;
            i++;
        } else if (!strcmp(argv[i], "--secret-file") && v) {
            secret_file = v;
            i++;
        } else if (!strcmp(argv[i], "--threads") && v) {
            if (kvr_cli_u32("--threads", v, 1, 256, &opt.n_threads))
                return 2;
            i++;
        } else {
            fprintf(stderr, "kvasir experts: unknown or incomplete option '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (!plan_path || !have_index) {
        usage(stderr);
        return 2;
    }
    char tag[32];
    snprintf(tag, sizeof tag, "experts%u", opt.index);
    kvr_log_set_tag(tag);
    struct kvr_err err = {0};
    struct kvr_plan *plan = kvr_malloc(sizeof *plan);
    if (!plan || kvr_plan_load_with_secret(plan, plan_path, secret_file, &err) ||
        kvr_plan_validate(plan, 0, &err)) {
        KVR_ERROR("plan %s: %s", plan_path, plan ? err.msg : "out of memory");
        kvr_free(plan);
        return 1;
    }
    kvr_cli_on_stop(on_signal);
    int rc = kvr_expert_agent_run(plan, &opt, &stop_flag, &err);
    if (rc)
        KVR_ERROR("%s", err.msg);
    kvr_plan_wipe(plan);
    kvr_free(plan);
    return rc ? 1 : 0;
}
