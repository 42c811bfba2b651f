/* serve_procs.c - serve's stage processes and their warm standbys (see serve_procs.h). */
#include "cli/serve_procs.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"
#include "core/procfs.h"
#include "model/engine.h"
#include "ring/stage.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

/* A standby that took a stage's place is replaced this much later: loading one (hundreds of
 * milliseconds of CPU) at once would slow the ring re-computing its held sequences, which
 * is what the clients are waiting for. */
enum { STANDBY_DELAY_MS = 3000 };

/* `kvasir stage` for process i < n_stages (with --standby: its warm standby), else `kvasir
 * experts` for agent i - n_stages. A child runs in a process group of its own, so a
 * terminal's Ctrl-C reaches serve alone, which then stops the ring in order; and it is
 * killed if serve dies without stopping it. */
static pid_t spawn(const struct kvr_serve_procs *p, uint32_t i, bool standby)
{
    uint32_t n_stages = p->plan->n_stages;
    uint32_t index = i < n_stages ? i : i - n_stages;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    sigprocmask(SIG_SETMASK, &p->run_mask, NULL);
    setpgid(0, 0);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
        _exit(127); /* serve is already gone */
    char idx[16];
    snprintf(idx, sizeof idx, "%u", index);
    char *args[] = {(char *)"kvasir",
                    (char *)(i < n_stages ? "stage" : "experts"),
                    (char *)"--plan",
                    (char *)p->plan_path,
                    (char *)"--index",
                    idx,
                    standby ? (char *)"--standby" : NULL,
                    NULL};
    execv(p->self, args);
    fprintf(stderr, "kvasir serve: cannot start %s %u: %s\n", args[1], index, strerror(errno));
    _exit(127);
}

int kvr_serve_procs_start(struct kvr_serve_procs *p, const struct kvr_plan *plan,
                          const char *plan_path, const sigset_t *run_mask)
{
    memset(p, 0, sizeof *p);
    ssize_t n = readlink("/proc/self/exe", p->self, sizeof p->self - 1);
    if (n <= 0) {
        KVR_ERROR("cannot find my own executable");
        return -1;
    }
    p->self[n] = 0;
    p->plan = plan;
    p->plan_path = plan_path;
    p->run_mask = *run_mask;
    p->n = plan->n_stages + plan->n_agents;
    p->pids = kvr_calloc(p->n, sizeof *p->pids);
    if (!p->pids)
        return -1;
    for (uint32_t i = 0; i < p->n; i++)
        p->pids[i] = spawn(p, i, false);
    KVR_INFO("plan %s: %u stages and %u expert agents started", plan_path, plan->n_stages,
             plan->n_agents);
    return 0;
}

/* Whether every slice fits in the available memory once more, with a quarter to spare. */
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
    return kvr_procfs_bytes("/proc/meminfo", "MemAvailable") >= weights + weights / 4;
}

void kvr_serve_procs_start_standbys(struct kvr_serve_procs *p, const struct kvr_gguf *g)
{
    if (!standby_fits(g, p->plan)) {
        KVR_INFO("no warm standbys (%s): a stage that dies is restarted and reloads its layers",
                 p->plan->n_agents ? "expert agents" : "not enough memory available");
        return;
    }
    for (uint32_t i = 0; i < p->plan->n_stages; i++)
        p->standby[i] = spawn(p, i, true);
    KVR_INFO("a warm standby per stage started: it takes the stage's place when it dies "
             "(--no-standby: none)");
}

uint64_t kvr_serve_procs_standbys_due(struct kvr_serve_procs *p)
{
    uint64_t now = kvr_now_ns(), next = 0;
    for (uint32_t i = 0; p->pids && i < p->plan->n_stages; i++) {
        uint64_t due = p->standby_due_ns[i];
        if (due && due <= now) {
            p->standby[i] = spawn(p, i, true);
            p->standby_due_ns[i] = 0;
        } else if (due && (!next || due < next)) {
            next = due;
        }
    }
    return next;
}

bool kvr_serve_procs_reap(struct kvr_serve_procs *p, bool ever_up)
{
    uint32_t n_stages = p->plan ? p->plan->n_stages : 0;
    int status;
    for (uint32_t i = 0; i < n_stages; i++)
        if (p->standby[i] > 0 && waitpid(p->standby[i], &status, WNOHANG) == p->standby[i]) {
            KVR_WARN("the standby of stage %u exited (status %d)", i, status);
            p->standby[i] = 0;
        }
    for (uint32_t i = 0; p->pids && i < p->n; i++) {
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
            p->pids[i] = spawn(p, i, false);
        }
    }
    return true;
}

static void stop_one(pid_t pid)
{
    if (pid > 0) {
        kill(pid, SIGTERM);
        waitpid(pid, NULL, 0);
    }
}

void kvr_serve_procs_fini(struct kvr_serve_procs *p)
{
    for (uint32_t i = 0; p->plan && i < p->plan->n_stages; i++)
        stop_one(p->standby[i]);
    for (uint32_t i = 0; p->pids && i < p->n; i++)
        stop_one(p->pids[i]);
    kvr_free(p->pids);
    p->pids = NULL;
}
