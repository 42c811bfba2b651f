#define _GNU_SOURCE /* sched_getaffinity */
#include "cli/common.h"

#include "bridge/chat.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "model/gguf.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int kvr_cli_u32(const char *opt, const char *v, uint32_t lo, uint32_t hi, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || v[0] == '-' || x < lo || x > hi) {
        fprintf(stderr, "kvasir: %s wants a whole number in [%u, %u], not '%s'\n", opt, lo, hi, v);
        return -1;
    }
    *out = (uint32_t)x;
    return 0;
}

int kvr_cli_float(const char *opt, const char *v, float lo, float hi, float *out)
{
    char *end;
    errno = 0;
    float x = strtof(v, &end);
    if (errno || end == v || *end || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "kvasir: %s wants a number in [%g, %g], not '%s'\n", opt, lo, hi, v);
        return -1;
    }
    *out = x;
    return 0;
}

void kvr_cli_load_weights(struct kvr_gguf *g)
{
    bool tty = isatty(2);
    double total = 0, done = 0;
    for (int64_t i = 0; i < kvr_gguf_n_tensors(g); i++)
        total += (double)kvr_gguf_tensor(g, i)->n_bytes;
    uint64_t last = 0;
    volatile unsigned char sink = 0;
    for (int64_t i = 0; i < kvr_gguf_n_tensors(g); i++) {
        const struct kvr_gguf_tensor *t = kvr_gguf_tensor(g, i);
        const unsigned char *p = t->data;
        for (size_t off = 0; off < t->n_bytes; off += 4096)
            sink ^= p[off];
        done += (double)t->n_bytes;
        uint64_t now = kvr_now_ns();
        if (tty && now - last > 100000000ull) {
            fprintf(stderr, "\rloading weights: %5.1f%% of %.0f MB", 100.0 * done / total,
                    total / 1e6);
            last = now;
        }
    }
    if (tty && last)
        fprintf(stderr, "\rloading weights: done, %.0f MB%20s\n", total / 1e6, "");
    (void)sink;
}

void kvr_cli_on_stop(void (*handler)(int))
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

int kvr_cli_chat_template(const char *arg, const char **builtin, char **src, size_t *src_len)
{
    enum kvr_chat_tmpl t;
    *builtin = NULL;
    *src = NULL;
    *src_len = 0;
    if (kvr_chat_tmpl_from_name(arg, &t) == 0) {
        *builtin = arg;
        return 0;
    }
    FILE *f = fopen(arg, "rb");
    if (!f) {
        fprintf(stderr,
                "kvasir: --chat-template: '%s' is neither a built-in template "
                "(chatml, llama2, llama3, mistral, zephyr) nor a readable file: %s\n",
                arg, strerror(errno));
        return -1;
    }
    size_t cap = (size_t)1 << 20;
    char *buf = kvr_malloc(cap + 1);
    size_t n = buf ? fread(buf, 1, cap + 1, f) : 0;
    bool bad = !buf || ferror(f) || n > cap;
    fclose(f);
    if (bad) {
        fprintf(stderr, "kvasir: --chat-template: cannot read %s (or larger than 1 MiB)\n", arg);
        kvr_free(buf);
        return -1;
    }
    buf[n] = 0;
    *src = buf;
    *src_len = n;
    return 0;
}

void kvr_cli_version(void)
{
    printf("kvasir %s (CPU build)\n", KVR_VERSION);
}

/* Levenshtein distance of two option names (each cut at 63 bytes). */
static size_t edit_distance(const char *a, const char *b)
{
    size_t na = strnlen(a, 63), nb = strnlen(b, 63);
    size_t row[64];
    for (size_t j = 0; j <= nb; j++)
        row[j] = j;
    for (size_t i = 1; i <= na; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= nb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[nb];
}

void kvr_cli_unknown(const char *cmd, const char *opt, const char *help)
{
    /* Every word of the help that starts with '-' and a letter is an option. */
    char best[64] = "";
    size_t best_d = SIZE_MAX;
    for (const char *p = help ? help : ""; *p; p++) {
        if (*p != '-' ||
            (p > help && !isspace((unsigned char)p[-1]) && p[-1] != '(' && p[-1] != ','))
            continue;
        size_t n = 0;
        while (p[n] == '-' || isalnum((unsigned char)p[n]) || p[n] == '_')
            n++;
        if (n < 2 || n >= sizeof best || !isalpha((unsigned char)p[n - 1])) {
            p += n ? n - 1 : 0;
            continue;
        }
        char word[64];
        memcpy(word, p, n);
        word[n] = 0;
        size_t d = edit_distance(opt, word);
        if (d < best_d) {
            best_d = d;
            snprintf(best, sizeof best, "%s", word);
        }
        p += n - 1;
    }
    /* Close enough to be a slip: a third of the name, at least 2 edits. */
    size_t len = strlen(opt), limit = len / 3 > 2 ? len / 3 : 2;
    if (best[0] && best_d <= limit && best_d < len)
        fprintf(stderr, "kvasir %s: unknown option '%s'; did you mean '%s'? (kvasir %s --help)\n",
                cmd, opt, best, cmd);
    else
        fprintf(stderr, "kvasir %s: unknown option '%s' (kvasir %s --help lists the options)\n",
                cmd, opt, cmd);
}

void kvr_cli_unknown_usage(const char *cmd, const char *opt, void (*usage)(FILE *))
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (f) {
        usage(f);
        fclose(f);
    }
    kvr_cli_unknown(cmd, opt, text);
    free(text); /* stdio's own allocation */
}

int kvr_cli_gpu_option(const char *cmd, const char *a, const char *v)
{
    /* Each takes a value, except those listed after the NULL. */
    static const char *const with_value[] = {"-ngl",
                                             "--n-gpu-layers",
                                             "--gpu-layers",
                                             "-ngld",
                                             "--n-gpu-layers-draft",
                                             "--device",
                                             "-dev",
                                             "--main-gpu",
                                             "-mg",
                                             "--split-mode",
                                             "-sm",
                                             "--tensor-split",
                                             "-ts",
                                             "--tensor-parallel-size",
                                             "-tp",
                                             "--pipeline-parallel-size",
                                             "-pp",
                                             "--gpu-memory-utilization",
                                             NULL};
    static const char *const flags[] = {"--enforce-eager", "--no-kv-offload", "-nkvo", NULL};
    for (size_t i = 0; with_value[i]; i++)
        if (!strcmp(a, with_value[i])) {
            fprintf(stderr, "kvasir %s: this build runs on the CPU; %s %s is ignored\n", cmd, a,
                    v ? v : "");
            return v ? 2 : 1;
        }
    for (size_t i = 0; flags[i]; i++)
        if (!strcmp(a, flags[i])) {
            fprintf(stderr, "kvasir %s: this build runs on the CPU; %s is ignored\n", cmd, a);
            return 1;
        }
    return 0;
}

uint32_t kvr_cli_cores(void)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0)
        return 1;
    int n = CPU_COUNT(&set);
    return n > 0 ? (uint32_t)n : 1;
}

char *kvr_cli_read_key_file(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "kvasir: --api-key-file %s: %s\n", path, strerror(errno));
        return NULL;
    }
    char *key = kvr_malloc(4097);
    size_t n = key && fgets(key, 4097, f) ? strlen(key) : 0;
    fclose(f);
    while (n && (key[n - 1] == '\n' || key[n - 1] == '\r' || key[n - 1] == ' '))
        key[--n] = 0;
    if (!n || n >= 4096) {
        fprintf(stderr, "kvasir: --api-key-file %s: %s\n", path,
                n ? "a key longer than 4 KiB" : "no key on its first line");
        kvr_free(key);
        return NULL;
    }
    return key;
}

char *kvr_cli_take_secret(char *arg)
{
    size_t n = strlen(arg);
    char *copy = kvr_malloc(n + 1);
    if (!copy)
        return NULL;
    memcpy(copy, arg, n + 1);
    /* /proc/PID/cmdline (what ps reads) is this memory: the key leaves it. */
    memset(arg, 'x', n);
    return copy;
}
