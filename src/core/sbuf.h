/* sbuf.h - a growable byte string for building responses, prompts and metrics text.
 *
 * Appends never fail loudly: the first allocation failure or size overflow sets `failed`,
 * later appends become no-ops, and the owner checks `failed` once at the end. The data is
 * always NUL-terminated when non-NULL and not failed. Caller-owned struct (init/fini);
 * memory through core/alloc.h. Not thread-safe; one owner at a time. */
#ifndef KVR_CORE_SBUF_H
#define KVR_CORE_SBUF_H

#include <stdbool.h>
#include <stddef.h>

struct kvr_sbuf {
    char *data;  /* NULL until the first append */
    size_t len;  /* bytes used, excluding the NUL */
    size_t cap;  /* bytes allocated */
    bool failed; /* an append ran out of memory; contents are incomplete */
};

void kvr_sbuf_init(struct kvr_sbuf *b);
void kvr_sbuf_fini(struct kvr_sbuf *b);
/* Forget the contents but keep the memory. */
void kvr_sbuf_clear(struct kvr_sbuf *b);
void kvr_sbuf_append(struct kvr_sbuf *b, const void *p, size_t n);
void kvr_sbuf_puts(struct kvr_sbuf *b, const char *s);
void kvr_sbuf_printf(struct kvr_sbuf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Hand the buffer to the caller (free with kvr_free); the sbuf is left empty. Returns NULL if
 * an append failed (the partial data is freed) or nothing was ever appended and allocating
 * an empty string failed. */
char *kvr_sbuf_take(struct kvr_sbuf *b, size_t *out_len);

#endif
