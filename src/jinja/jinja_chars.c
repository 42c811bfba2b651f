/* jinja_chars.c - code points for the Jinja interpreter: counting, Python's isspace, and
 * case mapping for ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic (other scripts
 * are left unchanged; see jinja.h). Decoding and encoding are core/utf8.h's. */
#include "jinja/jinja_int.h"

size_t ju_count(const char *s, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len; n++) {
        uint32_t cp;
        i += ju_decode(s, len, i, &cp);
    }
    return n;
}

/* Python's str.isspace(): the Unicode White_Space characters and the four ASCII
 * separators 0x1c..0x1f. */
bool ju_isspace(uint32_t cp)
{
    if (cp <= 0x20)
        return cp == ' ' || (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x1f);
    return cp == 0x85 || cp == 0xa0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) ||
           cp == 0x2028 || cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

/* Ranges where upper and lower case alternate (even code point upper, odd lower, or the
 * other way round when odd_upper). */
struct pair_range {
    uint32_t lo, hi;
    bool odd_upper;
};

static const struct pair_range pair_ranges[] = {
    {0x100, 0x12f, false}, {0x132, 0x137, false}, {0x139, 0x148, true},
    {0x14a, 0x177, false}, {0x179, 0x17e, true},  {0x460, 0x481, false},
    {0x48a, 0x4bf, false}, {0x4c1, 0x4ce, true},  {0x4d0, 0x52f, false},
};

/* Ranges of upper-case letters whose lower case is a fixed distance away. */
struct shift_range {
    uint32_t lo, hi;
    int32_t delta;
};

static const struct shift_range shift_ranges[] = {
    {'A', 'Z', 32},       {0xc0, 0xd6, 32},   {0xd8, 0xde, 32},   {0x391, 0x3a1, 32},
    {0x3a3, 0x3ab, 32},   {0x386, 0x386, 38}, {0x388, 0x38a, 37}, {0x38c, 0x38c, 64},
    {0x38e, 0x38f, 63},   {0x410, 0x42f, 32}, {0x400, 0x40f, 80}, {0x4c0, 0x4c0, 15},
    {0x178, 0x178, -121},
};

uint32_t ju_lower(uint32_t cp)
{
    for (size_t i = 0; i < sizeof shift_ranges / sizeof *shift_ranges; i++)
        if (cp >= shift_ranges[i].lo && cp <= shift_ranges[i].hi)
            return (uint32_t)((int32_t)cp + shift_ranges[i].delta);
    for (size_t i = 0; i < sizeof pair_ranges / sizeof *pair_ranges; i++)
        if (cp >= pair_ranges[i].lo && cp <= pair_ranges[i].hi)
            return ((cp & 1) == pair_ranges[i].odd_upper) ? cp + 1 : cp;
    return cp;
}

uint32_t ju_upper(uint32_t cp)
{
    switch (cp) {
    case 0xb5:
        return 0x39c;
    case 0xff:
        return 0x178;
    case 0x131:
        return 'I';
    case 0x17f:
        return 'S';
    case 0x3c2:
        return 0x3a3;
    default:
        break;
    }
    for (size_t i = 0; i < sizeof shift_ranges / sizeof *shift_ranges; i++) {
        uint32_t lo = (uint32_t)((int32_t)shift_ranges[i].lo + shift_ranges[i].delta);
        uint32_t hi = (uint32_t)((int32_t)shift_ranges[i].hi + shift_ranges[i].delta);
        if (cp >= lo && cp <= hi)
            return (uint32_t)((int32_t)cp - shift_ranges[i].delta);
    }
    for (size_t i = 0; i < sizeof pair_ranges / sizeof *pair_ranges; i++)
        if (cp >= pair_ranges[i].lo && cp <= pair_ranges[i].hi)
            return ((cp & 1) != pair_ranges[i].odd_upper) ? cp - 1 : cp;
    return cp;
}

bool ju_iscased(uint32_t cp)
{
    return ju_upper(cp) != cp || ju_lower(cp) != cp;
}

bool ju_isalnum(uint32_t cp)
{
    if (cp < 0x80)
        return (cp >= '0' && cp <= '9') || ((cp | 32) >= 'a' && (cp | 32) <= 'z');
    return ju_upper(cp) != cp || ju_lower(cp) != cp;
}
