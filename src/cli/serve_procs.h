/* serve_procs.h - `kvasir serve`'s own processes: one per stage and per expert agent, and a
 * warm standby per stage (ring/stage.h `--standby`), restarted or replaced when they die.
 *
 * A standby has its slice loaded and takes its stage's address the moment the stage dies,
 * so the ring is whole again without waiting for a process to start and load; a new
 * standby is started behind it later. Standbys double the resident weights, so they run
 * only when the machine's available memory holds every slice once more with a quarter to
 * spare, and not for rings with expert agents.
 *
 * Single-threaded: serve's main thread calls everything. Caller-owned struct (init/fini). */
#ifndef KVR_CLI_SERVE_PROCS_H
#define KVR_CLI_SERVE_PROCS_H

#include "model/gguf.h"
#include "ring/plan.h"

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct kvr_serve_procs {
    char self[4096];       /* this executable */
    const char *plan_path; /* borrowed, outlives the struct */
    const struct kvr_plan *plan;
    sigset_t run_mask; /* the signal mask serve started with: its children get it back */
    pid_t *pids;       /* [n]: stages, then agents; 0 = not running */
    uint32_t n;
    pid_t standby[KVR_PLAN_MAX_STAGES + 1];           /* per stage; 0 = none */
    uint64_t standby_due_ns[KVR_PLAN_MAX_STAGES + 1]; /* a new one starts then; 0 = none */
};

/* Start one process per stage and agent. Returns 0 or -1 after logging why. */
int kvr_serve_procs_start(struct kvr_serve_procs *p, const struct kvr_plan *plan,
                          const char *plan_path, const sigset_t *run_mask);
/* Once the ring is first up (so they never slow its start): a standby per stage, if they
 * fit (see above); logs which. */
void kvr_serve_procs_start_standbys(struct kvr_serve_procs *p, const struct kvr_gguf *g);
/* Start the standbys that are due; returns when the next one is due (ns, kvr_now_ns's
 * clock), or 0 when none is. */
uint64_t kvr_serve_procs_standbys_due(struct kvr_serve_procs *p);
/* Reap the processes that died and replace them: a stage by its standby when it has one
 * (and a new standby later), else by a new process. False when one died before the ring
 * was ever up (a start-up failure: serve stops). */
bool kvr_serve_procs_reap(struct kvr_serve_procs *p, bool ever_up);
/* Stop everything, standbys first (a standby would take a stopped stage's place), then the
 * stages from the head on, each gone before the next is told; frees the struct's memory. */
void kvr_serve_procs_fini(struct kvr_serve_procs *p);

#endif
