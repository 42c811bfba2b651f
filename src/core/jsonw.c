/* jsonw.c - the streaming JSON writer (jsonw.h). */
#include "core/jsonw.h"

#include "core/utf8.h"

#include <stdint.h>
#include <string.h>

void kvr_jsonw_init(struct kvr_jsonw *w, struct kvr_sbuf *out)
{
    memset(w, 0, sizeof *w);
    w->out = out;
}

void kvr_jsonw_flush(struct kvr_jsonw *w)
{
    kvr_sbuf_append(w->out, w->buf, w->n);
    w->n = 0;
}

/* Room for `n` (<= KVR_JSONW_BUF_BYTES) more bytes in the staging buffer: values are built
 * there and reach the sbuf a few KiB at a time, since a snapshot has thousands of them. */
static char *room(struct kvr_jsonw *w, size_t n)
{
    if (w->n + n > sizeof w->buf)
        kvr_jsonw_flush(w);
    return w->buf + w->n;
}

static void put_char(struct kvr_jsonw *w, char c)
{
    *room(w, 1) = c;
    w->n++;
}

static void put(struct kvr_jsonw *w, const char *p, size_t n)
{
    if (n > sizeof w->buf) {
        kvr_jsonw_flush(w);
        kvr_sbuf_append(w->out, p, n);
        return;
    }
    memcpy(room(w, n), p, n);
    w->n += n;
}

/* Before any value: the comma that separates it from the previous value at this level. */
static void value_start(struct kvr_jsonw *w)
{
    if (w->after_key) {
        w->after_key = false;
        return;
    }
    if (w->has_item[w->depth])
        put_char(w, ',');
    w->has_item[w->depth] = true;
}

static void open_level(struct kvr_jsonw *w, char open, char close)
{
    value_start(w);
    if (w->depth == KVR_JSONW_MAX_DEPTH) {
        w->out->failed = true;
        return;
    }
    put_char(w, open);
    w->depth++;
    w->has_item[w->depth] = false;
    w->closer[w->depth] = close;
}

void kvr_jsonw_obj(struct kvr_jsonw *w)
{
    open_level(w, '{', '}');
}

void kvr_jsonw_arr(struct kvr_jsonw *w)
{
    open_level(w, '[', ']');
}

void kvr_jsonw_end(struct kvr_jsonw *w)
{
    if (w->depth == 0) {
        w->out->failed = true;
        return;
    }
    put_char(w, w->closer[w->depth]);
    w->depth--;
    w->after_key = false;
    if (w->depth == 0)
        kvr_jsonw_flush(w);
}

/* A JSON string: escapes for the quote, the backslash and control characters, and each
 * invalid UTF-8 subpart as U+FFFD, so the text is always valid JSON. */
static void put_string(struct kvr_jsonw *w, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    put(w, "\"", 1);
    size_t len = strlen(s);
    size_t i = 0;
    while (i < len) {
        size_t run = i;
        while (run < len && (unsigned char)s[run] >= 0x20 && s[run] != '"' && s[run] != '\\' &&
               (unsigned char)s[run] < 0x80)
            run++;
        put(w, s + i, run - i);
        i = run;
        if (i == len)
            break;
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x80) {
            /* Decode and re-encode: a valid character comes out as it was, an invalid
             * subpart as U+FFFD. */
            uint32_t cp;
            char enc[4];
            size_t n = kvr_utf8_decode(s + i, len - i, &cp, KVR_UTF8_REPLACE_SUBPART);
            put(w, enc, kvr_utf8_encode(cp, enc));
            i += n ? n : 1;
            continue;
        }
        char esc[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
        if (c == '"' || c == '\\') {
            esc[1] = (char)c;
            put(w, esc, 2);
        } else if (c == '\n') {
            put(w, "\\n", 2);
        } else {
            put(w, esc, 6);
        }
        i++;
    }
    put(w, "\"", 1);
}

void kvr_jsonw_key(struct kvr_jsonw *w, const char *key)
{
    value_start(w);
    put_string(w, key);
    put(w, ":", 1);
    w->after_key = true;
}

/* Two digits at a time: a snapshot writes thousands of numbers. */
static const char digit_pairs[] = "00010203040506070809101112131415161718192021222324252627282930"
                                  "31323334353637383940414243444546474849505152535455565758596061"
                                  "62636465666768697071727374757677787980818283848586878889909192"
                                  "93949596979899";

char *kvr_jsonw_uint_text(char *p, uint64_t v)
{
    unsigned n = 1;
    for (uint64_t x = v; x >= 10; x /= 10)
        n++;
    char *end = p + n;
    char *q = end;
    while (v >= 100) {
        unsigned d = (unsigned)(v % 100) * 2;
        v /= 100;
        *--q = digit_pairs[d + 1];
        *--q = digit_pairs[d];
    }
    if (v >= 10) {
        *--q = digit_pairs[v * 2 + 1];
        *--q = digit_pairs[v * 2];
    } else {
        *--q = (char)('0' + v);
    }
    return end;
}

char *kvr_jsonw_fixed_text(char *p, int64_t v, unsigned decimals)
{
    static const uint64_t pow10[10] = {1,      10,      100,      1000,      10000,
                                       100000, 1000000, 10000000, 100000000, 1000000000};
    if (decimals > 9)
        decimals = 9;
    uint64_t mag = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    uint64_t whole = mag / pow10[decimals], frac = mag % pow10[decimals];
    if (v < 0)
        *p++ = '-';
    p = kvr_jsonw_uint_text(p, whole);
    *p++ = '.';
    if (!frac) {
        *p++ = '0';
        return p;
    }
    unsigned n = decimals;
    while (frac % 10 == 0) { /* drop trailing zeros */
        frac /= 10;
        n--;
    }
    for (unsigned i = n; i-- > 0; frac /= 10)
        p[i] = (char)('0' + frac % 10);
    return p + n;
}

void kvr_jsonw_uint(struct kvr_jsonw *w, uint64_t v)
{
    char buf[24];
    value_start(w);
    put(w, buf, (size_t)(kvr_jsonw_uint_text(buf, v) - buf));
}

void kvr_jsonw_int(struct kvr_jsonw *w, int64_t v)
{
    char buf[24];
    char *p = buf;
    if (v < 0)
        *p++ = '-';
    p = kvr_jsonw_uint_text(p, v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v);
    value_start(w);
    put(w, buf, (size_t)(p - buf));
}

void kvr_jsonw_fixed(struct kvr_jsonw *w, int64_t v, unsigned decimals)
{
    if (decimals > 9) {
        w->out->failed = true;
        return;
    }
    char buf[40];
    value_start(w);
    put(w, buf, (size_t)(kvr_jsonw_fixed_text(buf, v, decimals) - buf));
}

void kvr_jsonw_key_plain(struct kvr_jsonw *w, const char *text, size_t n)
{
    value_start(w);
    put(w, text, n);
    w->after_key = true;
}

void kvr_jsonw_raw(struct kvr_jsonw *w, const char *json, size_t n)
{
    value_start(w);
    put(w, json, n);
}

void kvr_jsonw_str(struct kvr_jsonw *w, const char *s)
{
    value_start(w);
    put_string(w, s ? s : "");
}

void kvr_jsonw_bool(struct kvr_jsonw *w, bool v)
{
    value_start(w);
    put(w, v ? "true" : "false", v ? 4 : 5);
}

void kvr_jsonw_null(struct kvr_jsonw *w)
{
    value_start(w);
    put(w, "null", 4);
}
