/* stage.c - `kvasir stage --plan PLAN --index I` (or `--spare J`): run one stage agent of a
 * ring, or one of its spares, until SIGINT or SIGTERM (the runner is ringproc.h's). */
#include "cli/cmd.h"
#include "cli/ringproc.h"

#include "ring/stage.h"

static int run(const struct kvr_plan *plan, uint32_t index, uint32_t n_threads, atomic_int *stop,
               struct kvr_err *err)
{
    struct kvr_stage_options opt = {.index = index, .n_threads = n_threads};
    return kvr_stage_run(plan, &opt, stop, err);
}

static int run_spare(const struct kvr_plan *plan, uint32_t index, uint32_t n_threads,
                     atomic_int *stop, struct kvr_err *err)
{
    struct kvr_stage_options opt = {.index = index, .spare = true, .n_threads = n_threads};
    return kvr_stage_run(plan, &opt, stop, err);
}

static int run_standby(const struct kvr_plan *plan, uint32_t index, uint32_t n_threads,
                       atomic_int *stop, struct kvr_err *err)
{
    struct kvr_stage_options opt = {.index = index, .standby = true, .n_threads = n_threads};
    return kvr_stage_run(plan, &opt, stop, err);
}

int kvr_cmd_stage(int argc, char **argv)
{
    static const struct kvr_cli_ringproc rp = {
        .cmd = "stage",
        .usage = "usage: kvasir stage --plan PLAN (--index I [--standby] | --spare J)\n"
                 "                    [--threads N] [--secret-file FILE]\n"
                 "  Serve stage I of the ring described by PLAN (see docs/PLAN.md), or wait as\n"
                 "  its spare J until the bridge gives it the layers of a stage lost for good.\n"
                 "  --standby            load stage I's layers, then wait on this host and\n"
                 "                       take the stage's place as soon as it dies\n"
                 "  --secret-file FILE   the cluster secret (mode 0600) instead of the plan's\n",
        .n_index = KVR_PLAN_MAX_STAGES,
        .run = run,
        .n_spare = KVR_PLAN_MAX_SPARES,
        .run_spare = run_spare,
        .run_standby = run_standby,
        .signal_stop = kvr_stage_signal_stop,
    };
    return kvr_cli_ringproc_main(&rp, argc, argv);
}
