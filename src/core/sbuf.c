/* sbuf.c - growable byte string (see sbuf.h). */
#include "core/sbuf.h"

#include "core/alloc.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void kvr_sbuf_init(struct kvr_sbuf *b)
{
    memset(b, 0, sizeof *b);
}

void kvr_sbuf_fini(struct kvr_sbuf *b)
{
    kvr_free(b->data);
    memset(b, 0, sizeof *b);
}

void kvr_sbuf_clear(struct kvr_sbuf *b)
{
    b->len = 0;
    b->failed = false;
    if (b->data)
        b->data[0] = 0;
}

/* Make room for `extra` more bytes plus the NUL, growing geometrically. */
static bool reserve(struct kvr_sbuf *b, size_t extra)
{
    size_t need;
    if (b->failed)
        return false;
    if (!kvr_add_size(b->len, extra, &need) || !kvr_add_size(need, 1, &need)) {
        b->failed = true;
        return false;
    }
    if (need <= b->cap)
        return true;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) {
        if (!kvr_mul_size(cap, 2, &cap)) {
            cap = need;
            break;
        }
    }
    char *p = kvr_realloc(b->data, cap);
    if (!p) {
        b->failed = true;
        return false;
    }
    b->data = p;
    b->cap = cap;
    return true;
}

void kvr_sbuf_append(struct kvr_sbuf *b, const void *p, size_t n)
{
    if (!reserve(b, n))
        return;
    if (n)
        memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
}

void kvr_sbuf_puts(struct kvr_sbuf *b, const char *s)
{
    kvr_sbuf_append(b, s, strlen(s));
}

void kvr_sbuf_printf(struct kvr_sbuf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->failed = true;
        return;
    }
    if (!reserve(b, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

char *kvr_sbuf_take(struct kvr_sbuf *b, size_t *out_len)
{
    if (!b->failed && !b->data)
        reserve(b, 0);
    if (b->failed) {
        kvr_sbuf_fini(b);
        return NULL;
    }
    b->data[b->len] = 0;
    char *p = b->data;
    if (out_len)
        *out_len = b->len;
    memset(b, 0, sizeof *b);
    return p;
}
