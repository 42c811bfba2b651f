/* ringproc.h - the runner shared by the subcommands that serve one process of a ring's
 * plan (`kvasir stage`, `kvasir experts`): the options --plan, --index, --threads and
 * --secret-file, the log tag, loading and validating the plan, SIGINT/SIGTERM, and the
 * process's own run function until it stops. Main thread only (one runner per process). */
#ifndef KVR_CLI_RINGPROC_H
#define KVR_CLI_RINGPROC_H

#include "core/err.h"
#include "ring/plan.h"

#include <stdatomic.h>
#include <stdint.h>

struct kvr_cli_ringproc {
    const char *cmd;   /* "stage": the subcommand, in messages and the log tag */
    const char *usage; /* the full usage text */
    uint32_t n_index;  /* --index is below this */
    /* Serve process `index` of the valid plan until *stop is set; 0 after an orderly stop,
     * or a negative status with err set. n_threads: --threads, 0 when not given. */
    int (*run)(const struct kvr_plan *plan, uint32_t index, uint32_t n_threads, atomic_int *stop,
               struct kvr_err *err);
    /* Optional: `--spare J` (J < n_spare) instead of --index runs run_spare (a stage's
     * spare, docs/PLAN.md "Spare stages"); NULL = no such option. */
    uint32_t n_spare;
    int (*run_spare)(const struct kvr_plan *plan, uint32_t index, uint32_t n_threads,
                     atomic_int *stop, struct kvr_err *err);
    /* Optional: `--standby` with --index runs run_standby (a warm standby of the stage,
     * ring/stage.h); NULL = no such option. */
    int (*run_standby)(const struct kvr_plan *plan, uint32_t index, uint32_t n_threads,
                       atomic_int *stop, struct kvr_err *err);
    void (*signal_stop)(void); /* async-signal-safe: wakes run's event loop */
};

/* Parse argv, load the plan and run; the subcommand's exit status (0, 1 on failure, 2 on
 * bad usage). */
int kvr_cli_ringproc_main(const struct kvr_cli_ringproc *rp, int argc, char **argv);

#endif
