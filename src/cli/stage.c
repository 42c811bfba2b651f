/* stage.c - `kvasir stage --plan PLAN --index I`: run one stage agent of a ring until
 * SIGINT or SIGTERM (the runner is ringproc.h's). */
#include "cli/cmd.h"
#include "cli/ringproc.h"

#include "ring/stage.h"

static int run(const struct kvr_plan *plan, uint32_t index, uint32_t n_threads, atomic_int *stop,
               struct kvr_err *err)
{
    struct kvr_stage_options opt = {.index = index, .n_threads = n_threads};
    return kvr_stage_run(plan, &opt, stop, err);
}

int kvr_cmd_stage(int argc, char **argv)
{
    static const struct kvr_cli_ringproc rp = {
        .cmd = "stage",
        .usage = "usage: kvasir stage --plan PLAN --index I [--threads N] [--secret-file FILE]\n"
                 "  Serve stage I of the ring described by PLAN (see docs/PLAN.md).\n"
                 "  --secret-file FILE   the cluster secret (mode 0600) instead of the plan's\n",
        .n_index = KVR_PLAN_MAX_STAGES,
        .run = run,
        .signal_stop = kvr_stage_signal_stop,
    };
    return kvr_cli_ringproc_main(&rp, argc, argv);
}
