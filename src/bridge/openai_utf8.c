/* openai_utf8.c - UTF-8 validation and repair for request and response text (see openai.h,
 * "UTF-8"): request bodies must be valid UTF-8, generated text is repaired before it goes
 * into JSON. */
#include "bridge/openai.h"

/* Length of the well-formed sequence at p (Unicode table 3-7), or 0 with *bad set to the
 * length of the maximal invalid subpart (>= 1) to replace with one U+FFFD.
 *
 *   lead      2nd byte    3rd/4th   code points
 *   00..7F    -           -         U+0000..U+007F
 *   C2..DF    80..BF      -         U+0080..U+07FF
 *   E0        A0..BF      80..BF    U+0800..U+0FFF  (80..9F would be overlong)
 *   E1..EC    80..BF      80..BF
 *   ED        80..9F      80..BF    (A0..BF would be surrogates)
 *   EE..EF    80..BF      80..BF
 *   F0        90..BF      80..BF    (80..8F would be overlong)
 *   F1..F3    80..BF      80..BF
 *   F4        80..8F      80..BF    (90..BF would exceed U+10FFFF) */
static size_t utf8_seq(const unsigned char *p, size_t avail, size_t *bad)
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

size_t kvr_utf8_check(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, bad;
    while (i < len) {
        size_t n = utf8_seq(p + i, len - i, &bad);
        if (!n)
            return i;
        i += n;
    }
    return len;
}

void kvr_utf8_sanitize(struct kvr_sbuf *out, const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, run = 0, bad = 0;
    while (i < len) {
        size_t n = utf8_seq(p + i, len - i, &bad);
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
