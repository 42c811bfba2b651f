/* serve_env.c - the context and the runtime directory of `kvasir serve` (serve_env.h). */
#include "cli/serve_env.h"

#include "core/log.h"
#include "core/procfs.h"
#include "model/kv.h"
#include "ring/plan.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* MemAvailable, in bytes; 0 when unknown. */
static uint64_t mem_available(void)
{
    return kvr_procfs_bytes("/proc/meminfo", "MemAvailable");
}

/* Tokens the KV cache can hold for one sequence: what --kv-blocks or --kv-mem gives, or
 * half of MemAvailable after the weights (the rest stays for activations, the page cache
 * and everything else on the machine). */
static uint64_t kv_tokens(const struct kvr_plan_spec *spec, const struct kvr_hparams *hp,
                          uint64_t weight_bytes, uint32_t block)
{
    enum kvr_dtype t = KVR_PLAN_DEFAULT_KV_TYPE;
    if (spec->kv_type)
        kvr_plan_kv_type_parse(spec->kv_type, &t);     /* a bad name is propose's to refuse */
    uint64_t row = 2ull * kvr_kv_bytes(t, hp->kv_dim); /* K and V of one layer, one token */
    if (!row)
        return UINT32_MAX;
    if (spec->kv_blocks)
        return (uint64_t)spec->kv_blocks * block;
    uint32_t stages = spec->n_stages ? spec->n_stages : 1;
    if (spec->kv_mib) /* per stage: the stage with the most layers holds the fewest tokens */
        return ((uint64_t)spec->kv_mib << 20) / (row * ((hp->n_layer + stages - 1) / stages));
    uint64_t avail = mem_available();
    if (!avail)
        return UINT32_MAX;
    uint64_t budget = avail > weight_bytes ? (avail - weight_bytes) / 2 : 0;
    return budget / (row * hp->n_layer);
}

int kvr_cli_ctx_check(uint32_t n_ctx, const struct kvr_hparams *hp)
{
    uint32_t trained = hp->n_ctx_train;
    /* Linear RoPE scaling stretches the positions the model was trained on. */
    double factor =
        hp->rope_freq_scale > 0 && hp->rope_freq_scale < 1 ? 1.0 / hp->rope_freq_scale : 1.0;
    if (n_ctx <= trained)
        return 0;
    /* As vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: whoever compares with a peer that runs any
     * context (llama.cpp's -c) may ask for it knowingly. */
    const char *allow = getenv("KVASIR_ALLOW_LONG_CONTEXT");
    bool allowed = allow && !strcmp(allow, "1");
    if (n_ctx > trained * factor && !allowed) {
        KVR_ERROR("--ctx %u is beyond the %u positions this model was trained for, and it has "
                  "no RoPE scaling to stretch them%s; give --ctx %u or less (or set "
                  "KVASIR_ALLOW_LONG_CONTEXT=1 to run it anyway)",
                  n_ctx, trained, factor > 1 ? " that far" : "", (uint32_t)(trained * factor));
        return -1;
    }
    if (n_ctx > trained * factor)
        KVR_WARN("--ctx %u is beyond the %u positions this model was trained for "
                 "(KVASIR_ALLOW_LONG_CONTEXT=1): positions past them are untrained",
                 n_ctx, trained);
    else
        KVR_WARN("--ctx %u is beyond the %u positions this model was trained for; its RoPE "
                 "scaling (factor %.3g) stretches them, at some cost in quality",
                 n_ctx, trained, factor);
    return 0;
}

int kvr_cli_context(struct kvr_plan_spec *spec, const struct kvr_hparams *hp, uint64_t weight_bytes,
                    char *why, size_t why_cap)
{
    uint32_t trained = hp->n_ctx_train;
    if (spec->n_ctx) {
        if (kvr_cli_ctx_check(spec->n_ctx, hp))
            return -1;
        snprintf(why, why_cap, "--ctx; trained %u", trained);
        return 0;
    }
    uint32_t block =
        spec->kv_block_tokens ? spec->kv_block_tokens : KVR_PLAN_DEFAULT_KV_BLOCK_TOKENS;
    uint64_t tokens = kv_tokens(spec, hp, weight_bytes, block) / block * block;
    if (tokens < block)
        tokens = block;
    if (trained <= tokens) {
        spec->n_ctx = trained;
        snprintf(why, why_cap, "trained length");
    } else {
        spec->n_ctx = (uint32_t)tokens;
        snprintf(why, why_cap, "KV memory; trained %u", trained);
    }
    /* Default KV: a full context for every sequence, unless the machine cannot hold it. */
    uint32_t seqs = spec->max_seqs ? spec->max_seqs : 32;
    uint64_t full = (uint64_t)(spec->n_ctx + block - 1) / block * seqs;
    if (!spec->kv_blocks && !spec->kv_mib && full * block > tokens)
        spec->kv_blocks = (uint32_t)(tokens / block);
    return 0;
}

/* ---- the runtime directory ------------------------------------------------------------ */

/* The command name of process `pid` ("self" for this one) into out; false if none. */
static bool comm_of(const char *pid, char *out, size_t cap)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%s/comm", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    bool ok = fgets(out, (int)cap, f) != NULL;
    fclose(f);
    return ok;
}

/* Whether process `pid` runs this program (the same command name as this process): a PID
 * reused by another program does not keep a dead server's directory. */
static bool server_runs(long pid)
{
    char id[32], mine[64], theirs[64];
    snprintf(id, sizeof id, "%ld", pid);
    return comm_of(id, theirs, sizeof theirs) &&
           (!comm_of("self", mine, sizeof mine) || !strcmp(mine, theirs));
}

/* Remove dir/serve-PID for every PID that no longer runs this program: its files, then
 * itself. */
static void clean(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        if (strncmp(e->d_name, "serve-", 6))
            continue;
        long pid = strtol(e->d_name + 6, &end, 10);
        if (*end || pid <= 0 || pid == (long)getpid() || server_runs(pid))
            continue;
        char sub[1024];
        snprintf(sub, sizeof sub, "%s/%s", dir, e->d_name);
        DIR *s = opendir(sub);
        struct dirent *f;
        while (s && (f = readdir(s))) {
            char file[1400];
            snprintf(file, sizeof file, "%s/%s", sub, f->d_name);
            if (strcmp(f->d_name, ".") && strcmp(f->d_name, ".."))
                unlink(file);
        }
        if (s)
            closedir(s);
        if (rmdir(sub) == 0)
            KVR_INFO("removed %s, left by a server that no longer runs", sub);
    }
    closedir(d);
}

int kvr_cli_runtime_dir(char *out, size_t cap)
{
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (xdg && xdg[0] == '/')
        snprintf(out, cap, "%s/kvasir", xdg);
    else
        snprintf(out, cap, "/tmp/kvasir-%u", (unsigned)getuid());
    struct stat st;
    if (mkdir(out, 0700) != 0 && errno != EEXIST) {
        KVR_ERROR("cannot make the runtime directory %s: %s", out, strerror(errno));
        return -1;
    }
    /* lstat: a symlink planted by another user is refused, not followed. */
    if (lstat(out, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != getuid() ||
        (st.st_mode & 077)) {
        KVR_ERROR("the runtime directory %s is not a directory of this user's alone (mode "
                  "0700); remove it or set XDG_RUNTIME_DIR",
                  out);
        return -1;
    }
    clean(out);
    return 0;
}
