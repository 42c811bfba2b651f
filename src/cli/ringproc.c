/* ringproc.c - the runner of `kvasir stage` and `kvasir experts` (see ringproc.h). */
#include "cli/ringproc.h"

#include "cli/common.h"
#include "core/alloc.h"
#include "core/log.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

static atomic_int stop_flag;      /* lock-free, so the signal handler may store to it */
static void (*signal_stop)(void); /* set before the handler is installed */

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
    signal_stop();
}

int kvr_cli_ringproc_main(const struct kvr_cli_ringproc *rp, int argc, char **argv)
{
    const char *plan_path = NULL, *secret_file = NULL;
    uint32_t index = 0, n_threads = 0;
    bool have_index = false, spare = false, standby = false;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            fputs(rp->usage, stdout);
            return 0;
        } else if (!strcmp(argv[i], "--plan") && v) {
            plan_path = v;
            i++;
        } else if (!strcmp(argv[i], "--index") && v) {
            if (kvr_cli_u32("--index", v, 0, rp->n_index - 1, &index))
                return 2;
            have_index = true;
            i++;
        } else if (rp->run_spare && !strcmp(argv[i], "--spare") && v) {
            if (kvr_cli_u32("--spare", v, 0, rp->n_spare - 1, &index))
                return 2;
            have_index = spare = true;
            i++;
        } else if (rp->run_standby && !strcmp(argv[i], "--standby")) {
            standby = true;
        } else if (!strcmp(argv[i], "--secret-file") && v) {
            secret_file = v;
            i++;
        } else if (!strcmp(argv[i], "--threads") && v) {
            if (kvr_cli_u32("--threads", v, 1, 256, &n_threads))
                return 2;
            i++;
        } else {
            if (v || !strstr(rp->usage, argv[i]))
                kvr_cli_unknown(rp->cmd, argv[i], rp->usage);
            else
                fprintf(stderr, "kvasir %s: %s needs a value\n", rp->cmd, argv[i]);
            return 2;
        }
    }
    if (!plan_path || !have_index || (standby && spare)) {
        fputs(rp->usage, stderr);
        return 2;
    }
    char tag[32];
    snprintf(tag, sizeof tag, "%s%u", spare ? "spare" : standby ? "standby" : rp->cmd, index);
    kvr_log_set_tag(tag);
    struct kvr_err err = {0};
    struct kvr_plan *plan = kvr_malloc(sizeof *plan);
    if (!plan || kvr_plan_load_with_secret(plan, plan_path, secret_file, &err) ||
        kvr_plan_validate(plan, 0, &err)) {
        KVR_ERROR("plan %s: %s", plan_path, plan ? err.msg : "out of memory");
        kvr_free(plan);
        return 1;
    }
    signal_stop = rp->signal_stop;
    kvr_cli_on_stop(on_signal);
    int rc = (spare     ? rp->run_spare
              : standby ? rp->run_standby
                        : rp->run)(plan, index, n_threads, &stop_flag, &err);
    if (rc)
        KVR_ERROR("%s", err.msg);
    kvr_plan_wipe(plan);
    kvr_free(plan);
    return rc ? 1 : 0;
}
