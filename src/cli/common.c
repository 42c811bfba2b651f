#include "cli/common.h"

#include "bridge/chat.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "model/gguf.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

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
