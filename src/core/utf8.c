/* utf8.c - the UTF-8 codec (see utf8.h). */
#include "core/utf8.h"

size_t kvr_utf8_lead_len(unsigned char lead)
{
    if (lead < 0x80)
        return 1;
    if (lead >= 0xC2 && lead <= 0xDF)
        return 2;
    if (lead >= 0xE0 && lead <= 0xEF)
        return 3;
    if (lead >= 0xF0 && lead <= 0xF4)
        return 4;
    return 0;
}

void kvr_utf8_second_range(unsigned char lead, unsigned char *lo, unsigned char *hi)
{
    *lo = lead == 0xE0 ? 0xA0 : lead == 0xF0 ? 0x90 : 0x80;
    *hi = lead == 0xED ? 0x9F : lead == 0xF4 ? 0x8F : 0xBF;
}

size_t kvr_utf8_llama_len(unsigned char lead)
{
    static const unsigned char len_by_high_nibble[16] = {1, 1, 1, 1, 1, 1, 1, 1,
                                                         1, 1, 1, 1, 2, 2, 3, 4};
    return len_by_high_nibble[lead >> 4];
}

/* The well-formed character at p[0..n): its length with its value in *cp, or 0 with *bad
 * set to the length of the maximal invalid subpart there (>= 1). */
static size_t well_formed(const unsigned char *p, size_t n, uint32_t *cp, size_t *bad)
{
    size_t len = kvr_utf8_lead_len(p[0]);
    if (len == 1) {
        *cp = p[0];
        return 1;
    }
    unsigned char lo, hi;
    kvr_utf8_second_range(p[0], &lo, &hi);
    if (len == 0 || n < 2 || p[1] < lo || p[1] > hi) {
        *bad = 1;
        return 0;
    }
    uint32_t v = p[0] & (0x7Fu >> len);
    v = v << 6 | (p[1] & 0x3Fu);
    for (size_t k = 2; k < len; k++) {
        if (n <= k || (p[k] & 0xC0) != 0x80) {
            *bad = k;
            return 0;
        }
        v = v << 6 | (p[k] & 0x3Fu);
    }
    *cp = v;
    return len;
}

static size_t decode_llama(const unsigned char *p, size_t n, uint32_t *cp)
{
    unsigned char c = p[0];
    size_t k = c < 0x80 ? 1 : c < 0xC0 ? 0 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : c < 0xF8 ? 4 : 0;
    *cp = 0xFFFD;
    if (k == 0 || k > n)
        return 1;
    if (k == 1) {
        *cp = c;
        return 1;
    }
    uint32_t v = c & (0x7Fu >> k);
    for (size_t i = 1; i < k; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 1;
        v = v << 6 | (p[i] & 0x3Fu);
    }
    if (v > 0x10FFFF)
        return 1;
    *cp = v;
    return k;
}

size_t kvr_utf8_decode(const char *s, size_t n, uint32_t *cp, enum kvr_utf8_mode mode)
{
    const unsigned char *p = (const unsigned char *)s;
    if (mode == KVR_UTF8_LLAMA)
        return decode_llama(p, n, cp);
    size_t bad = 1;
    size_t len = well_formed(p, n, cp, &bad);
    if (len || mode == KVR_UTF8_STRICT)
        return len;
    *cp = 0xFFFD;
    return mode == KVR_UTF8_REPLACE_SUBPART ? bad : 1;
}

size_t kvr_utf8_encode(uint32_t cp, char *out)
{
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

size_t kvr_utf8_valid_len(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, bad;
    uint32_t cp;
    while (i < len) {
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        size_t n = well_formed(p + i, len - i, &cp, &bad);
        if (!n)
            return i;
        i += n;
    }
    return len;
}

void kvr_utf8_sanitize_to(struct kvr_sbuf *out, const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, run = 0, bad = 0;
    uint32_t cp;
    while (i < len) {
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        size_t n = well_formed(p + i, len - i, &cp, &bad);
        if (n) {
            i += n;
            continue;
        }
        kvr_sbuf_append(out, s + run, i - run);
        kvr_sbuf_append(out, KVR_UTF8_FFFD, KVR_UTF8_FFFD_BYTES);
        i += bad;
        run = i;
    }
    kvr_sbuf_append(out, s + run, len - run);
}
