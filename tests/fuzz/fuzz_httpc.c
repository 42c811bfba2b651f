/* fuzz_httpc.c - libFuzzer target for the parsers `kvasir bench` and `kvasir top` run on what
 * a server sends back: the SSE event parser, the chunked transfer decoder, the Prometheus
 * text reader and the URL parser.
 *
 * Input: one byte choosing a split step (1..256), then the bytes. The bytes go through each
 * parser twice, whole and in pieces of that step, and the two must agree:
 *   SSE: the same events (count and concatenated data);
 *   chunked: the same status, the same decoded bytes and consumed count;
 * the Prometheus reader must not crash and every sample it keeps has a valid name; the URL
 * parser gets the bytes up to the first NUL. A violated invariant traps. */
#include "client/httpc.h"
#include "client/promtext.h"
#include "core/sbuf.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "fuzz_httpc: %s failed at line %d\n", #c, __LINE__);                   \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

struct events {
    struct kvr_sbuf all;
    size_t n;
};

static int on_event(void *ud, const char *d, size_t len, uint64_t t_ns)
{
    (void)t_ns;
    struct events *e = ud;
    CHECK(d[len] == 0);
    kvr_sbuf_append(&e->all, d, len);
    kvr_sbuf_append(&e->all, "\x1e", 1); /* a separator no event can fake in one piece */
    e->n++;
    return 0;
}

static int sse_run(const char *p, size_t n, size_t step, struct events *e)
{
    struct kvr_sse s;
    kvr_sse_init(&s);
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i += step)
        rc = kvr_sse_feed(&s, p + i, n - i < step ? n - i : step, on_event, e, 0);
    kvr_sse_fini(&s);
    return rc;
}

static int sink(void *ud, const char *p, size_t n)
{
    kvr_sbuf_append(ud, p, n);
    return 0;
}

static int chunked_run(const char *p, size_t n, size_t step, struct kvr_sbuf *out, size_t *consumed,
                       bool *done)
{
    struct kvr_chunked c;
    kvr_chunked_init(&c);
    *consumed = 0;
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0 && !c.done; i += step) {
        size_t used = 0, len = n - i < step ? n - i : step;
        rc = kvr_chunked_feed(&c, p + i, len, &used, sink, out);
        CHECK(used <= len);
        *consumed += used;
        if (rc == 0 && !c.done)
            CHECK(used == len);
    }
    *done = c.done;
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    size_t step = (size_t)data[0] + 1;
    const char *p = (const char *)data + 1;
    size_t n = size - 1;

    struct events whole = {0}, pieces = {0};
    kvr_sbuf_init(&whole.all);
    kvr_sbuf_init(&pieces.all);
    int rc1 = sse_run(p, n, n ? n : 1, &whole), rc2 = sse_run(p, n, step, &pieces);
    CHECK(rc1 == rc2);
    if (rc1 == 0) {
        CHECK(whole.n == pieces.n);
        CHECK(whole.all.len == pieces.all.len);
        CHECK(!whole.all.len || !memcmp(whole.all.data, pieces.all.data, whole.all.len));
    }
    kvr_sbuf_fini(&whole.all);
    kvr_sbuf_fini(&pieces.all);

    struct kvr_sbuf a, b;
    kvr_sbuf_init(&a);
    kvr_sbuf_init(&b);
    size_t ca, cb;
    bool da, db;
    rc1 = chunked_run(p, n, n ? n : 1, &a, &ca, &da);
    rc2 = chunked_run(p, n, step, &b, &cb, &db);
    CHECK(rc1 == rc2);
    if (rc1 == 0) {
        CHECK(da == db && ca == cb);
        CHECK(a.len == b.len && (!a.len || !memcmp(a.data, b.data, a.len)));
        CHECK(a.len <= ca);
    }
    kvr_sbuf_fini(&a);
    kvr_sbuf_fini(&b);

    struct kvr_prom prom;
    if (kvr_prom_parse(&prom, p, n) == 0)
        for (size_t i = 0; i < prom.n_samples; i++) {
            const char *name = prom.samples[i].name;
            CHECK(name[0] && strlen(name) <= n);
            for (size_t k = 0; k < prom.samples[i].n_labels; k++)
                CHECK(kvr_prom_label(&prom.samples[i], prom.samples[i].labels[k].key));
        }
    kvr_prom_fini(&prom);

    char url[600];
    size_t ul = strnlen(p, n < sizeof url - 1 ? n : sizeof url - 1);
    memcpy(url, p, ul);
    url[ul] = 0;
    struct kvr_httpc_url u;
    if (kvr_httpc_url_parse(&u, url, NULL) == 0) {
        CHECK(u.host[0] && u.port[0]);
        CHECK(!strpbrk(u.host, "/@?#"));
    }
    return 0;
}
