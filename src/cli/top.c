/* top.c - `kvasir top`: a live terminal view of a running bridge, read from GET /metrics.
 *
 *   kvasir top [--url http://127.0.0.1:8080] [--interval 1]     redraws in place; q quits
 *   kvasir top --once                                             one plain snapshot
 *
 * Shows whether the ring is up, requests running / waiting, admitted and refused (with
 * rates between two polls), tokens per second, KV cache use, mean latencies over the last
 * interval, for every stage bars of the fraction of time it was busy (held), waiting for
 * work (starved) and waiting for its downstream (blocked), and for every expert agent the
 * same fractions of the last interval with its pairs and share of the load (the snapshot
 * and the frame are client/topview.h's; this file polls and redraws). */
#include "cli/cmd.h"
#include "cli/common.h"

#include "client/httpc.h"
#include "client/promtext.h"
#include "client/topview.h"
#include "core/sbuf.h"
#include "core/alloc.h"
#include "core/clock.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

struct top_opts {
    const char *url, *api_key;
    double interval_s;
    uint32_t count; /* snapshots to show; 0 = until interrupted */
    bool once;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvasir top [options]\n"
               "  A live view of a running Kvasir server's ring, from its /metrics.\n"
               "  --url URL          server (default http://127.0.0.1:8080)\n"
               "  --api-key KEY      bearer key (default: env KVASIR_API_KEY)\n"
               "  --interval S       seconds between polls (default 1)\n"
               "  --count N          stop after N snapshots\n"
               "  --once             print one snapshot without terminal escapes and exit\n"
               "  (live view: q quits, as Ctrl-C does)\n"
               "                     (exit status 1 if the server cannot be read)\n");
}

static int parse_opts(int argc, char **argv, struct top_opts *o)
{
    memset(o, 0, sizeof *o);
    o->url = "http://127.0.0.1:8080";
    o->api_key = getenv("KVASIR_API_KEY");
    o->interval_s = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--once")) {
            o->once = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "kvasir top: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--url")) {
            o->url = v;
        } else if (!strcmp(a, "--api-key")) {
            /* Copied, and wiped from argv, so that `ps` does not show it. */
            static char key[4096];
            snprintf(key, sizeof key, "%s", v);
            memset(v, 'x', strlen(v));
            o->api_key = key;
        } else if (!strcmp(a, "--interval")) {
            float f;
            if (kvr_cli_float(a, v, 0.05f, 3600.0f, &f))
                return 2;
            o->interval_s = f;
        } else if (!strcmp(a, "--count")) {
            if (kvr_cli_u32(a, v, 1, 1u << 30, &o->count))
                return 2;
        } else {
            kvr_cli_unknown_usage("top", a, usage);
            return 2;
        }
    }
    if (o->once)
        o->count = 1;
    return 0;
}

/* ---- one poll ------------------------------------------------------------------------------ */

static void poll_once(const struct top_opts *o, const struct kvr_httpc_url *u,
                      struct kvr_top_snapshot *s)
{
    memset(s, 0, sizeof *s);
    s->t_ns = kvr_now_ns();
    struct kvr_httpc_resp resp;
    struct kvr_err err = {0};
    uint32_t timeout_ms = o->interval_s * 1000 > 5000 ? (uint32_t)(o->interval_s * 1000) : 5000;
    int rc = kvr_httpc_get(u, "/metrics", o->api_key, timeout_ms, &resp, &err);
    if (rc) {
        snprintf(s->error, sizeof s->error, "%s", err.msg);
    } else if ((s->status = resp.status) == 401) {
        snprintf(s->error, sizeof s->error,
                 "unauthorized: give --api-key KEY (or set KVASIR_API_KEY) with the server's key");
    } else if (resp.status != 200) {
        snprintf(s->error, sizeof s->error, "GET /metrics answered %d", resp.status);
    } else {
        struct kvr_prom p;
        if (kvr_prom_parse(&p, resp.body ? resp.body : "", resp.body_len) == 0) {
            kvr_top_read(&p, s);
            s->ok = true;
        } else {
            snprintf(s->error, sizeof s->error, "out of memory reading the metrics");
        }
        kvr_prom_fini(&p);
    }
    kvr_httpc_resp_fini(&resp);
}

/* ---- the keyboard -------------------------------------------------------------------------- */

/* With a terminal on stdin, keys arrive one at a time and unechoed (so `q` quits without
 * Enter); the terminal's settings are restored before the command returns. */
struct keys {
    bool raw;
    struct termios saved;
};

static void keys_open(struct keys *k, bool live)
{
    k->raw = false;
    if (!live || !isatty(STDIN_FILENO) || tcgetattr(STDIN_FILENO, &k->saved) != 0)
        return;
    struct termios t = k->saved;
    t.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
    t.c_cc[VMIN] = 0;
    t.c_cc[VTIME] = 0;
    k->raw = tcsetattr(STDIN_FILENO, TCSANOW, &t) == 0;
}

static void keys_close(struct keys *k)
{
    if (k->raw)
        tcsetattr(STDIN_FILENO, TCSANOW, &k->saved);
}

/* Wait up to wait_ns for a key; true when it was q (or Q). Without a raw terminal, sleep. */
static bool keys_quit(const struct keys *k, uint64_t wait_ns)
{
    if (!k->raw) {
        kvr_sleep_ns(wait_ns);
        return false;
    }
    struct pollfd p = {.fd = STDIN_FILENO, .events = POLLIN};
    if (poll(&p, 1, (int)(wait_ns / 1000000)) <= 0)
        return false;
    char c;
    return read(STDIN_FILENO, &c, 1) == 1 && (c == 'q' || c == 'Q');
}

/* ---- the command --------------------------------------------------------------------------- */

int kvr_cmd_top(int argc, char **argv)
{
    struct top_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    struct kvr_httpc_url u;
    struct kvr_err err = {0};
    if (kvr_httpc_url_parse(&u, o.url, &err)) {
        fprintf(stderr, "kvasir top: --url: %s\n", err.msg);
        return 2;
    }
    kvr_cli_on_stop(on_signal);

    bool ansi = !o.once && isatty(STDOUT_FILENO);
    struct kvr_top_snapshot *both = kvr_calloc(2, sizeof *both);
    if (!both)
        return 1;
    struct kvr_top_snapshot *cur = &both[0], *prev = &both[1];
    uint64_t last_poll_ns = 0;
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    if (ansi) /* the alternate screen, without a cursor, restored on the way out */
        fputs("\033[?1049h\033[?25l", stdout);
    struct keys keys;
    keys_open(&keys, ansi);
    rc = 0;
    for (uint32_t n = 0; !stop_flag && (o.count == 0 || n < o.count); n++) {
        if (n > 0) {
            uint64_t until = last_poll_ns + (uint64_t)(o.interval_s * 1e9);
            for (uint64_t t = kvr_now_ns(); t < until && !stop_flag; t = kvr_now_ns())
                if (keys_quit(&keys, until - t < 50000000ull ? until - t : 50000000ull))
                    stop_flag = 1;
            if (stop_flag)
                break;
        }
        poll_once(&o, &u, cur);
        last_poll_ns = cur->t_ns;
        kvr_sbuf_clear(&b);
        if (ansi)
            kvr_sbuf_puts(&b, "\033[H");
        else if (n > 0)
            kvr_sbuf_puts(&b, "\n");
        char clock[16];
        time_t now = time(NULL);
        struct tm tm;
        localtime_r(&now, &tm);
        strftime(clock, sizeof clock, "%H:%M:%S", &tm);
        kvr_top_render(&b, ansi, o.url, clock, cur, n > 0 ? prev : NULL);
        if (ansi)
            kvr_sbuf_puts(&b, "\033[J");
        if (!b.failed)
            fwrite(b.data, 1, b.len, stdout);
        fflush(stdout);
        if (o.once && !cur->ok)
            rc = 1;
        if (cur->ok) { /* rates are taken against the last good poll */
            struct kvr_top_snapshot *t = prev;
            prev = cur;
            cur = t;
        }
    }
    keys_close(&keys);
    if (ansi)
        fputs("\033[?25h\033[?1049l", stdout);
    fflush(stdout);
    kvr_sbuf_fini(&b);
    kvr_free(both);
    return rc;
}
