/* tokenizer_unicode.c - code point classes for the BPE pre-tokenizers, looked up in the
 * generated tables of tokenizer_unicode_data.c (format in tokenizer_unicode.h). ASCII,
 * the common case, is classified without a search (the unit test checks it against the
 * table). */
#include "model/tokenizer_unicode.h"

static enum kvr_ucat ascii_ucat(uint32_t c)
{
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z')
        return KVR_UCAT_LETTER;
    if (c >= '0' && c <= '9')
        return KVR_UCAT_NUMBER;
    if (c == ' ')
        return KVR_UCAT_SEPARATOR;
    if (c < 0x20 || c == 0x7F)
        return KVR_UCAT_OTHER;
    /* The ASCII symbols (Sc, Sk, Sm); every other printable one is punctuation. */
    static const char symbols[] = "$+<=>^`|~";
    for (const char *p = symbols; *p; p++)
        if ((uint32_t)*p == c)
            return KVR_UCAT_SYMBOL;
    return KVR_UCAT_PUNCT;
}

enum kvr_ucat kvr_cp_ucat(uint32_t cp)
{
    if (cp < 0x80)
        return ascii_ucat(cp);
    if (cp > 0x10FFFF)
        return KVR_UCAT_OTHER;
    /* The last run whose first code point is <= cp. */
    size_t lo = 0, hi = kvr_ucat_n_runs;
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (kvr_ucat_runs[mid] >> 3 <= cp)
            lo = mid;
        else
            hi = mid;
    }
    return (enum kvr_ucat)(kvr_ucat_runs[lo] & 7);
}

bool kvr_cp_is_space(uint32_t cp)
{
    if (cp < 0x80)
        return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20;
    for (size_t i = 0; i < kvr_n_white_space; i++)
        if (cp >= kvr_white_space[i][0] && cp <= kvr_white_space[i][1])
            return true;
    return false;
}

enum kvr_cp_class kvr_cp_class(uint32_t cp)
{
    if (kvr_cp_is_space(cp))
        return KVR_CP_SPACE;
    switch (kvr_cp_ucat(cp)) {
    case KVR_UCAT_LETTER:
        return KVR_CP_LETTER;
    case KVR_UCAT_NUMBER:
        return KVR_CP_NUMBER;
    default:
        return KVR_CP_OTHER;
    }
}
