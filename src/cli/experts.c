/* experts.c - `kvasir experts --plan PLAN --index J`: run one expert agent (docs/EXPERTS.md)
 * until SIGINT or SIGTERM (the runner is ringproc.h's). */
#include "cli/cmd.h"
#include "cli/ringproc.h"

#include "ring/experts.h"

static int run(const struct kvr_plan *plan, uint32_t index, uint32_t n_threads, atomic_int *stop,
               struct kvr_err *err)
{
    struct kvr_expert_agent_options opt = {.index = index, .n_threads = n_threads};
    return kvr_expert_agent_run(plan, &opt, stop, err);
}

int kvr_cmd_experts(int argc, char **argv)
{
    static const struct kvr_cli_ringproc rp = {
        .cmd = "experts",
        .usage = "usage: kvasir experts --plan PLAN --index J [--threads N] [--secret-file FILE]\n"
                 "  Serve expert agent J of PLAN's \"experts\" (see docs/EXPERTS.md): the\n"
                 "  experts it places there, for the stages that own their layers.\n"
                 "  --secret-file FILE   the cluster secret (mode 0600) instead of the plan's\n",
        .n_index = KVR_PLAN_MAX_AGENTS,
        .run = run,
        .signal_stop = kvr_expert_agent_signal_stop,
    };
    return kvr_cli_ringproc_main(&rp, argc, argv);
}
