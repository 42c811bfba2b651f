/* jsonw.h - a streaming JSON writer into a struct kvr_sbuf, for replies built many times a
 * second where a DOM (jansson) would cost an allocation per value.
 *
 * The writer only places commas and colons; the caller writes values in document order:
 *
 *     kvr_jsonw_obj(&w);  kvr_jsonw_key(&w, "n");  kvr_jsonw_uint(&w, 3);
 *     kvr_jsonw_key(&w, "ids");  kvr_jsonw_arr(&w);  kvr_jsonw_uint(&w, 1);  kvr_jsonw_end(&w);
 *     kvr_jsonw_end(&w);                                       -> {"n":3,"ids":[1]}
 *
 * Text is staged in the writer and reaches the sbuf a few KiB at a time: it is all there
 * once the outermost object or array is closed, or after kvr_jsonw_flush (for a top-level
 * scalar, or to read a partial document).
 *
 * Strings are escaped (quote, backslash, control characters) and invalid UTF-8 is replaced
 * by U+FFFD, so any C string yields valid JSON. Decimal numbers are written from a fixed
 * point (kvr_jsonw_fixed), never through printf's %g, so the text is exact and short.
 * Nesting deeper than KVR_JSONW_MAX_DEPTH, an end without a begin or a failed append marks
 * the buffer failed (out->failed); the owner checks it once at the end, as for any sbuf.
 *
 * Caller-owned struct (init, no fini: the sbuf is the caller's). Not thread-safe. */
#ifndef KVR_CORE_JSONW_H
#define KVR_CORE_JSONW_H

#include "core/sbuf.h"

#include <stdbool.h>
#include <stdint.h>

#define KVR_JSONW_MAX_DEPTH 32
#define KVR_JSONW_BUF_BYTES 4096

struct kvr_jsonw {
    struct kvr_sbuf *out;
    uint32_t depth;
    bool after_key;                         /* the next value follows "key": (no comma) */
    bool has_item[KVR_JSONW_MAX_DEPTH + 1]; /* level d has a value already: comma first */
    char closer[KVR_JSONW_MAX_DEPTH + 1];   /* '}' or ']' for each open level 1..depth */
    size_t n;                               /* bytes staged in buf, not yet in out */
    char buf[KVR_JSONW_BUF_BYTES];
};

void kvr_jsonw_init(struct kvr_jsonw *w, struct kvr_sbuf *out);
/* Move the staged text to the sbuf (closing the outermost container does it too). */
void kvr_jsonw_flush(struct kvr_jsonw *w);

void kvr_jsonw_obj(struct kvr_jsonw *w); /* { */
void kvr_jsonw_arr(struct kvr_jsonw *w); /* [ */
void kvr_jsonw_end(struct kvr_jsonw *w); /* } or ], whichever is open */
void kvr_jsonw_key(struct kvr_jsonw *w, const char *key);

void kvr_jsonw_int(struct kvr_jsonw *w, int64_t v);
void kvr_jsonw_uint(struct kvr_jsonw *w, uint64_t v);
/* v / 10^decimals, written with at most `decimals` (<= 9) digits after the point, no
 * trailing zeros, but always a point, so a reader types it as a real: fixed(12340, 3) is
 * 12.34, fixed(-5, 1) is -0.5, fixed(7000, 3) is 7.0. */
void kvr_jsonw_fixed(struct kvr_jsonw *w, int64_t v, unsigned decimals);
void kvr_jsonw_str(struct kvr_jsonw *w, const char *s);
void kvr_jsonw_bool(struct kvr_jsonw *w, bool v);
void kvr_jsonw_null(struct kvr_jsonw *w);

/* ---- for text written many thousands of times a second --------------------------------- */

/* A key given as a C string literal that needs no escaping (plain printable ASCII, no quote
 * or backslash): copied as it is, without the scan kvr_jsonw_key makes. */
#define KVR_JSONW_KEY(w, lit) kvr_jsonw_key_plain((w), "\"" lit "\":", sizeof(lit) + 2)
/* `text` is `"key":` already quoted; KVR_JSONW_KEY builds it. */
void kvr_jsonw_key_plain(struct kvr_jsonw *w, const char *text, size_t n);

/* A value the caller has already written as valid JSON (say an object built with the
 * *_text helpers below), placed with the comma before it like any value; at most
 * KVR_JSONW_BUF_BYTES. */
void kvr_jsonw_raw(struct kvr_jsonw *w, const char *json, size_t n);

/* The text kvr_jsonw_uint / kvr_jsonw_fixed would write, at `p` (room for 24 / 40 bytes);
 * each returns the end of what it wrote. */
char *kvr_jsonw_uint_text(char *p, uint64_t v);
char *kvr_jsonw_fixed_text(char *p, int64_t v, unsigned decimals);

#endif
