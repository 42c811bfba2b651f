/* test_utf8.c - the UTF-8 codec (core/utf8.h) against the decoders it replaces, copied
 * here as they were: each named mode must consume the same bytes and give the same code
 * point as its original on every 1-, 2- and 3-byte input, and on every 4-byte input whose
 * last byte is one of the bytes the decoders tell apart. The span functions must agree
 * with the HTTP layer's originals on random, mostly UTF-8-shaped strings. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "core/rng.h"
#include "core/sbuf.h"
#include "core/utf8.h"

#include <stdbool.h>
#include <string.h>

/* ---- The originals ------------------------------------------------------------------
 * The private decoders core/utf8.h replaced, kept verbatim as references: jinja_utf8.c
 * ju_decode and ju_encode; openai.c utf8_seq, kvr_utf8_check and
 * kvr_utf8_sanitize; tokenizer.c utf8_get, cp_lenient, utf8_len and utf8_put; cli
 * tokenize.c utf8_char. */

static size_t ref_ju_decode(const char *str, size_t len, size_t i, uint32_t *cp)
{
    const unsigned char *s = (const unsigned char *)str;
    unsigned char c0 = s[i];
    if (c0 < 0x80) {
        *cp = c0;
        return 1;
    }
    size_t n = c0 >= 0xf0 ? 4 : c0 >= 0xe0 ? 3 : c0 >= 0xc0 ? 2 : 0;
    if (!n || c0 > 0xf4 || i + n > len)
        goto bad;
    uint32_t v = c0 & (0x7f >> n);
    for (size_t k = 1; k < n; k++) {
        if ((s[i + k] & 0xc0) != 0x80)
            goto bad;
        v = (v << 6) | (s[i + k] & 0x3f);
    }
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min[n] || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff))
        goto bad;
    *cp = v;
    return n;
bad:
    *cp = 0xfffd;
    return 1;
}

static size_t ref_ju_encode(uint32_t cp, char *out)
{
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xc0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xe0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (unsigned char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (unsigned char)(0xf0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
    o[3] = (unsigned char)(0x80 | (cp & 0x3f));
    return 4;
}

static size_t ref_utf8_seq(const unsigned char *p, size_t avail, size_t *bad)
{
    unsigned c = p[0];
    size_t n;
    unsigned lo = 0x80, hi = 0xBF;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        n = 2;
    else if (c == 0xE0)
        n = 3, lo = 0xA0;
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF)
        n = 3;
    else if (c == 0xED)
        n = 3, hi = 0x9F;
    else if (c == 0xF0)
        n = 4, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3)
        n = 4;
    else if (c == 0xF4)
        n = 4, hi = 0x8F;
    else {
        *bad = 1;
        return 0;
    }
    if (avail < 2 || p[1] < lo || p[1] > hi) {
        *bad = 1;
        return 0;
    }
    for (size_t k = 2; k < n; k++) {
        if (avail <= k || (p[k] & 0xC0) != 0x80) {
            *bad = k;
            return 0;
        }
    }
    return n;
}

static size_t ref_utf8_check(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, bad;
    while (i < len) {
        size_t n = ref_utf8_seq(p + i, len - i, &bad);
        if (!n)
            return i;
        i += n;
    }
    return len;
}

static void ref_utf8_sanitize(struct kvr_sbuf *out, const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, run = 0, bad = 0;
    while (i < len) {
        size_t n = ref_utf8_seq(p + i, len - i, &bad);
        if (n) {
            i += n;
            continue;
        }
        kvr_sbuf_append(out, s + run, i - run);
        kvr_sbuf_append(out, "\xEF\xBF\xBD", 3);
        i += bad;
        run = i;
    }
    kvr_sbuf_append(out, s + run, len - run);
}

static size_t ref_utf8_get(const uint8_t *p, size_t n, uint32_t *cp)
{
    uint8_t c = p[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t len;
    uint32_t v, min;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2, v = c & 0x1F, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, v = c & 0x0F, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, v = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0;
        v = v << 6 | (p[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    *cp = v;
    return len;
}

static uint32_t ref_cp_lenient(const uint8_t *p, size_t n, size_t *len)
{
    uint8_t c = p[0];
    size_t k = c < 0x80 ? 1 : c < 0xC0 ? 0 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : c < 0xF8 ? 4 : 0;
    *len = 1;
    if (k == 0 || k > n)
        return 0xFFFD;
    if (k == 1)
        return c;
    uint32_t v = c & (0x7F >> k);
    for (size_t i = 1; i < k; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0xFFFD;
        v = v << 6 | (p[i] & 0x3F);
    }
    if (v > 0x10FFFF)
        return 0xFFFD;
    *len = k;
    return v;
}

static size_t ref_utf8_len(uint8_t c)
{
    static const uint8_t len_by_high_nibble[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len_by_high_nibble[c >> 4];
}

static size_t ref_utf8_char(const unsigned char *p, size_t n)
{
    unsigned char c = p[0];
    size_t k = c >= 0xC2 && c <= 0xDF   ? 2
               : c >= 0xE0 && c <= 0xEF ? 3
               : c >= 0xF0 && c <= 0xF4 ? 4
                                        : 0;
    if (k == 0 || k > n)
        return 0;
    unsigned char lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
    unsigned char hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
    if (p[1] < lo || p[1] > hi)
        return 0;
    for (size_t i = 2; i < k; i++)
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    return k;
}

/* ---- Decoding, input by input ------------------------------------------------------- */

/* Every mode on s[0..n) against its original; returns false at the first difference. */
static bool same_on(const unsigned char *s, size_t n)
{
    const char *c = (const char *)s;
    uint32_t cp = 0, want = 0;
    size_t got, len;

    got = kvr_utf8_decode(c, n, &cp, KVR_UTF8_REPLACE_BYTE);
    len = ref_ju_decode(c, n, 0, &want);
    if (got != len || cp != want)
        return false;

    size_t bad = 0;
    len = ref_utf8_seq(s, n, &bad);
    got = kvr_utf8_decode(c, n, &cp, KVR_UTF8_REPLACE_SUBPART);
    if (got != (len ? len : bad) || (!len && cp != 0xFFFD))
        return false;

    uint32_t strict = 0x12345678;
    len = ref_utf8_get(s, n, &want);
    got = kvr_utf8_decode(c, n, &strict, KVR_UTF8_STRICT);
    if (got != len || (len && strict != want) || (!len && strict != 0x12345678))
        return false;
    if (s[0] >= 0x80 && ref_utf8_char(s, n) != got)
        return false;

    want = ref_cp_lenient(s, n, &len);
    got = kvr_utf8_decode(c, n, &cp, KVR_UTF8_LLAMA);
    if (got != len || cp != want)
        return false;

    if (kvr_utf8_llama_len(s[0]) != ref_utf8_len(s[0]))
        return false;
    return kvr_utf8_valid_len(c, n) == ref_utf8_check(c, n);
}

static void test_decode_every_short_input(void **state)
{
    (void)state;
    unsigned char s[3];
    for (unsigned a = 0; a < 256; a++) {
        s[0] = (unsigned char)a;
        assert_true(same_on(s, 1));
        for (unsigned b = 0; b < 256; b++) {
            s[1] = (unsigned char)b;
            assert_true(same_on(s, 2));
            for (unsigned d = 0; d < 256; d++) {
                s[2] = (unsigned char)d;
                if (!same_on(s, 3))
                    fail_msg("differs on %02x %02x %02x", a, b, d);
            }
        }
    }
}

/* Four bytes matter only after a lead of a four-byte form; the last byte is one of the
 * values at the edges of the ranges in the table of utf8.h. */
static void test_decode_four_byte_inputs(void **state)
{
    (void)state;
    static const unsigned char last[] = {0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0,
                                         0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xF0, 0xF4, 0xFF};
    unsigned char s[4];
    for (unsigned a = 0xE0; a < 256; a++)
        for (unsigned b = 0; b < 256; b++)
            for (unsigned d = 0; d < 256; d++)
                for (size_t k = 0; k < sizeof last; k++) {
                    s[0] = (unsigned char)a, s[1] = (unsigned char)b, s[2] = (unsigned char)d;
                    s[3] = last[k];
                    if (!same_on(s, 4))
                        fail_msg("differs on %02x %02x %02x %02x", a, b, d, last[k]);
                }
}

static void test_encode_every_code_point(void **state)
{
    (void)state;
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        char got[4], want[4];
        size_t n = kvr_utf8_encode(cp, got);
        assert_int_equal(n, ref_ju_encode(cp, want));
        assert_memory_equal(got, want, n);
        if (cp < 0xD800 || cp > 0xDFFF) { /* and it decodes back, in every mode */
            for (int m = 0; m < KVR_UTF8_MODE_COUNT; m++) {
                uint32_t back = 0;
                assert_int_equal(kvr_utf8_decode(got, n, &back, (enum kvr_utf8_mode)m), n);
                assert_int_equal(back, cp);
            }
        }
    }
}

static void test_lead_tables(void **state)
{
    (void)state;
    for (unsigned c = 0; c < 256; c++) {
        unsigned char s[2] = {(unsigned char)c, 0};
        size_t n = kvr_utf8_lead_len((unsigned char)c);
        size_t bad = 0;
        if (c < 0x80)
            assert_int_equal(n, 1);
        else if (n == 0) /* no second byte makes a character of it */
            for (unsigned b = 0; b < 256; b++) {
                s[1] = (unsigned char)b;
                assert_int_equal(ref_utf8_seq(s, 2, &bad), 0);
            }
        else {
            unsigned char lo, hi;
            kvr_utf8_second_range((unsigned char)c, &lo, &hi);
            for (unsigned b = 0; b < 256; b++) { /* the second byte passes iff in range */
                s[1] = (unsigned char)b;
                bool pass = ref_utf8_seq(s, 2, &bad) == 2 || (n > 2 && bad > 1);
                assert_int_equal(pass, b >= lo && b <= hi);
            }
        }
    }
}

/* ---- Spans -------------------------------------------------------------------------- */

/* A random byte string, mostly pieces of characters so that valid and broken sequences
 * both come up often. */
static uint32_t next_u32(uint64_t *r)
{
    return (uint32_t)(kvr_splitmix64(r) >> 32);
}

static size_t random_span(uint64_t *r, unsigned char *s, size_t cap)
{
    static const unsigned char bytes[] = {'a',  ' ',  0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0,
                                          0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEE,
                                          0xEF, 0xF0, 0xF1, 0xF4, 0xF5, 0xF8, 0xFF};
    size_t n = next_u32(r) % (cap + 1);
    for (size_t i = 0; i < n; i++)
        s[i] = (next_u32(r) & 3) ? bytes[next_u32(r) % sizeof bytes] : (unsigned char)next_u32(r);
    return n;
}

static void test_spans_match_the_http_originals(void **state)
{
    (void)state;
    uint64_t r = 33;
    unsigned char s[24];
    struct kvr_sbuf got, want;
    kvr_sbuf_init(&got);
    kvr_sbuf_init(&want);
    for (int it = 0; it < 300000; it++) {
        size_t n = random_span(&r, s, sizeof s);
        const char *c = (const char *)s;
        assert_int_equal(kvr_utf8_valid_len(c, n), ref_utf8_check(c, n));
        kvr_sbuf_clear(&got);
        kvr_sbuf_clear(&want);
        kvr_utf8_sanitize_to(&got, c, n);
        ref_utf8_sanitize(&want, c, n);
        assert_false(got.failed);
        assert_int_equal(got.len, want.len);
        if (got.len)
            assert_memory_equal(got.data, want.data, got.len);
        /* Sanitized text is valid. */
        assert_int_equal(kvr_utf8_valid_len(got.data ? got.data : "", got.len), got.len);
    }
    kvr_sbuf_fini(&got);
    kvr_sbuf_fini(&want);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_every_short_input),
        cmocka_unit_test(test_decode_four_byte_inputs),
        cmocka_unit_test(test_encode_every_code_point),
        cmocka_unit_test(test_lead_tables),
        cmocka_unit_test(test_spans_match_the_http_originals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
