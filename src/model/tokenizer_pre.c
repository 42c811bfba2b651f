/* tokenizer_pre.c - the pre-tokenizer table and the scanners of its rules.
 *
 * Reading order: character tests, the rules (one scanner per regular expression, each
 * quoting its pattern), the table of pre-tokenizers, the split loop.
 *
 * Every scanner answers one question: how long is the leftmost-first match of its pattern
 * that starts at c[pos], within the word c[0..n)? 0 means no match there. The patterns are
 * those of the vocabularies' tokenizer.json files; the scanners implement the regex
 * semantics that matter for them (alternatives tried left to right, greedy quantifiers
 * that give back characters one at a time), and the comments say which backtracking
 * outcome each branch stands for.
 *
 * Character classes: \p{X} is the major general category (tokenizer_unicode.h), \s is the
 * White_Space property. A pattern that lists non-ASCII characters literally (the DeepSeek
 * LLM ones) never matches a white-space character through that list: llama.cpp turns every
 * non-ASCII white space into U+000B before matching such a pattern, and the reference
 * vectors come from it. */
#include "model/tokenizer_pre.h"

#include "model/tokenizer_unicode.h"

#include <stdio.h>
#include <string.h>

/* ---- character tests ------------------------------------------------------------------ */

static bool is_space(uint32_t c)
{
    return kvr_cp_is_space(c);
}

static bool is_crlf(uint32_t c)
{
    return c == '\r' || c == '\n';
}

static bool is_letter(uint32_t c)
{
    return !is_space(c) && kvr_cp_ucat(c) == KVR_UCAT_LETTER;
}

static bool is_number(uint32_t c)
{
    return !is_space(c) && kvr_cp_ucat(c) == KVR_UCAT_NUMBER;
}

static bool is_punct(uint32_t c)
{
    return !is_space(c) && kvr_cp_ucat(c) == KVR_UCAT_PUNCT;
}

/* [^\s\p{L}\p{N}] */
static bool is_other(uint32_t c)
{
    return kvr_cp_class(c) == KVR_CP_OTHER;
}

static uint32_t ascii_lower(uint32_t c)
{
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

struct range {
    uint32_t lo, hi;
};

static bool in_set(const struct range *r, size_t n, uint32_t c)
{
    if (c > 0x7F && is_space(c))
        return false; /* see the file comment */
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (c < r[mid].lo)
            hi = mid;
        else if (c > r[mid].hi)
            lo = mid + 1;
        else
            return true;
    }
    return false;
}

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

/* Length of the run of characters satisfying f from c[pos], at most max. */
static size_t run(const uint32_t *c, size_t n, size_t pos, bool (*f)(uint32_t), size_t max)
{
    size_t e = pos;
    while (e < n && e - pos < max && f(c[e]))
        e++;
    return e - pos;
}

#define ANY ((size_t)-1)

/* ---- rules ------------------------------------------------------------------------------ */

enum pre_rule {
    RULE_GPT2,
    RULE_LLAMA3,
    RULE_QWEN2,
    RULE_CRLF,
    RULE_DSL_LETTERS,
    RULE_DSL_PUNCT,
    RULE_SPACE_END,
    RULE_CJK,
    RULE_NUMBERS,
    RULE_NUMBER,
    RULE_DSC_LETTERS,
    RULE_DSC_PUNCT,
    RULE_FALCON_PUNCT,
    RULE_DEFAULT_PUNCT,
    RULE_DIGITS3,
    RULE_BLOOM,
    RULE_DIGITS_1_3,
    RULE_CJK_KANA,
    RULE_DSV3,
    RULE_GPT4O,
    RULE_KIMI,
    RULE_COUNT
};

/* GPT-2:
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * (the contractions are lower case only). */
static size_t scan_gpt2(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    uint32_t c0 = c[pos];
    if (c0 == '\'' && pos + 1 < n) {
        uint32_t c1 = c[pos + 1];
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
            return 2;
        if (pos + 2 < n) {
            uint32_t c2 = c[pos + 2];
            if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
                return 3;
        }
    }
    /* " ?X+": with the optional space taken if a run of X follows it, else from c0. */
    size_t k = pos + (c0 == ' ' && pos + 1 < n && !is_space(c[pos + 1]));
    if (!is_space(c[k])) {
        enum kvr_cp_class cls = kvr_cp_class(c[k]);
        size_t e = k;
        while (e < n && kvr_cp_class(c[e]) == cls)
            e++;
        return e - pos;
    }
    size_t w = run(c, n, pos, is_space, ANY);
    /* \s+(?!\S): all of it at the end of the word, else all but the last space (which
     * then starts the next word); a single space before a non-space is \s+, which this
     * splitter leaves to the gap (the same word either way). */
    if (pos + w == n)
        return w;
    return w >= 2 ? w - 1 : 0;
}

/* Llama 3 (max_digits 3) and Qwen 2 (max_digits 1):
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *    ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * (Qwen 2's has \p{N} where Llama 3's has \p{N}{1,3}). Case-insensitive means ASCII case
 * here, as llama.cpp matches it. */
static size_t scan_llama3_digits(const uint32_t *c, size_t n, size_t pos, size_t max_digits)
{
    uint32_t c0 = c[pos];
    if (c0 == '\'' && pos + 1 < n) {
        uint32_t c1 = ascii_lower(c[pos + 1]);
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
            return 2;
        if (pos + 2 < n) {
            uint32_t c2 = ascii_lower(c[pos + 2]);
            if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
                return 3;
        }
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (is_letter(c0))
        return run(c, n, pos, is_letter, ANY);
    if (!is_crlf(c0) && !is_number(c0) && pos + 1 < n && is_letter(c[pos + 1]))
        return 1 + run(c, n, pos + 1, is_letter, ANY);
    /* \p{N}{1,max} */
    if (is_number(c0))
        return run(c, n, pos, is_number, max_digits);
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    size_t k = pos + (c0 == ' ' && pos + 1 < n && is_other(c[pos + 1]));
    if (is_other(c[k])) {
        size_t e = k + run(c, n, k, is_other, ANY);
        return e + run(c, n, e, is_crlf, ANY) - pos;
    }
    /* Only white space is left: c0 is \s. */
    size_t w = run(c, n, pos, is_space, ANY);
    /* \s*[\r\n]+: \s* gives back until the last \r or \n of the run, which [\r\n]+ takes. */
    for (size_t j = pos + w; j > pos; j--)
        if (is_crlf(c[j - 1]))
            return j - pos;
    /* \s+(?!\S), then \s+. */
    if (pos + w == n || w == 1)
        return w;
    return w - 1;
}

static size_t scan_llama3(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return scan_llama3_digits(c, n, pos, 3);
}

static size_t scan_qwen2(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return scan_llama3_digits(c, n, pos, 1);
}

/* [\r\n] */
static size_t scan_crlf(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)n, (void)skip;
    return is_crlf(c[pos]);
}

/* \s?[SET]+ for a literal set: the optional white space is taken when a set character
 * follows it; a white-space character is never in these sets. */
static size_t space_then_set(const uint32_t *c, size_t n, size_t pos, const struct range *set,
                             size_t n_set)
{
    size_t k = pos + (is_space(c[pos]) && pos + 1 < n);
    size_t e = k;
    while (e < n && in_set(set, n_set, c[e]))
        e++;
    return e > k ? e - pos : 0;
}

/* DeepSeek LLM's letters: the literal class of
 *   \s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫ
 *       ᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹ
 *       ℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲
 *       𐳀-𐳲𑢠-𑣟𞤀-𞥃]+
 * (cased letters, as the pattern lists them: not the Unicode category). */
static const struct range dsl_letters[] = {
    {0x41, 0x5A},       {0x61, 0x7A},       {0xB5, 0xB5},       {0xC0, 0xD6},
    {0xD8, 0xF6},       {0xF8, 0x1BA},      {0x1BC, 0x1BF},     {0x1C4, 0x293},
    {0x295, 0x2AF},     {0x370, 0x373},     {0x376, 0x377},     {0x37B, 0x37D},
    {0x37F, 0x37F},     {0x386, 0x386},     {0x388, 0x38A},     {0x38C, 0x38C},
    {0x38E, 0x3A1},     {0x3A3, 0x3F5},     {0x3F7, 0x481},     {0x48A, 0x52F},
    {0x531, 0x556},     {0x10A0, 0x10C5},   {0x13A0, 0x13F5},   {0x13F8, 0x13FD},
    {0x1C90, 0x1CBA},   {0x1CBD, 0x1CBF},   {0x1D00, 0x1D2B},   {0x1D6B, 0x1D77},
    {0x1D79, 0x1D9A},   {0x1E00, 0x1F15},   {0x1F18, 0x1F1D},   {0x1F20, 0x1F45},
    {0x1F48, 0x1F4D},   {0x1F50, 0x1F57},   {0x1F59, 0x1F59},   {0x1F5B, 0x1F5B},
    {0x1F5D, 0x1F5D},   {0x1F5F, 0x1F7D},   {0x1F80, 0x1FB4},   {0x1FB6, 0x1FBC},
    {0x1FBE, 0x1FBE},   {0x1FC2, 0x1FC4},   {0x1FC6, 0x1FCC},   {0x1FD0, 0x1FD3},
    {0x1FD6, 0x1FDB},   {0x1FE0, 0x1FEC},   {0x1FF2, 0x1FF4},   {0x1FF6, 0x1FFC},
    {0x2102, 0x2102},   {0x2107, 0x2107},   {0x210A, 0x2113},   {0x2115, 0x2115},
    {0x2119, 0x211D},   {0x2124, 0x2124},   {0x2126, 0x2126},   {0x2128, 0x2128},
    {0x212A, 0x212D},   {0x212F, 0x2134},   {0x2139, 0x2139},   {0x213C, 0x213F},
    {0x2145, 0x2149},   {0x214E, 0x214E},   {0x2183, 0x2184},   {0x2C00, 0x2C7B},
    {0x2C7E, 0x2CE4},   {0x2CEB, 0x2CEE},   {0x2CF2, 0x2CF3},   {0xA640, 0xA66D},
    {0xA680, 0xA69B},   {0xA722, 0xA76F},   {0xA771, 0xA787},   {0xA78B, 0xA78E},
    {0xAB70, 0xABBF},   {0xFB00, 0xFB06},   {0xFB13, 0xFB17},   {0xFF21, 0xFF3A},
    {0xFF41, 0xFF5A},   {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB},
    {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
};

static size_t scan_dsl_letters(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return space_then_set(c, n, pos, dsl_letters, N_OF(dsl_letters));
}

/* DeepSeek LLM's punctuation: \s?[!-/:-~！-／：-～‘-‟　-。]+ */
static const struct range dsl_punct[] = {
    {0x21, 0x2F},     {0x3A, 0x7E},     {0x2018, 0x201F},
    {0x3000, 0x3002}, {0xFF01, 0xFF0F}, {0xFF1A, 0xFF5E},
};

static size_t scan_dsl_punct(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return space_then_set(c, n, pos, dsl_punct, N_OF(dsl_punct));
}

/* \s+$ : a run of white space that reaches the end of the word. A run that does not can
 * match at none of its positions, so the split loop may skip it whole. */
static size_t scan_space_end(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    size_t w = run(c, n, pos, is_space, ANY);
    if (w > 0 && pos + w == n)
        return w;
    if (w > 1)
        *skip = pos + w;
    return 0;
}

/* [一-龥ࠀ-一가-퟿]+ (U+4E00..U+9FA5, U+0800..U+4E00, U+AC00..U+D7FF). */
static const struct range cjk[] = {{0x0800, 0x9FA5}, {0xAC00, 0xD7FF}};

static bool is_cjk(uint32_t c)
{
    return in_set(cjk, N_OF(cjk), c);
}

static size_t scan_cjk(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return run(c, n, pos, is_cjk, ANY);
}

/* \p{N}+ */
static size_t scan_numbers(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return run(c, n, pos, is_number, ANY);
}

/* \p{N} */
static size_t scan_number(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)n, (void)skip;
    return is_number(c[pos]);
}

/* \s?X+ for a category test X. */
static size_t space_then(const uint32_t *c, size_t n, size_t pos, bool (*f)(uint32_t))
{
    size_t k = pos + (is_space(c[pos]) && pos + 1 < n);
    size_t r = run(c, n, k, f, ANY);
    return r ? k + r - pos : 0;
}

/* DeepSeek Coder: \s?\p{L}+ and \s?\p{P}+ */
static size_t scan_dsc_letters(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return space_then(c, n, pos, is_letter);
}

static size_t scan_dsc_punct(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return space_then(c, n, pos, is_punct);
}

/* Falcon: [\p{P}\$\+<=>\^~\|`]+ ; the default: [\p{P}\$\+<=>\^~\|]+ (no backquote). */
static bool is_falcon_punct(uint32_t c)
{
    return is_punct(c) || (c < 0x80 && c && strchr("$+<=>^~|`", (int)c));
}

static bool is_default_punct(uint32_t c)
{
    return is_punct(c) || (c < 0x80 && c && strchr("$+<=>^~|", (int)c));
}

static size_t scan_falcon_punct(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return run(c, n, pos, is_falcon_punct, ANY);
}

static size_t scan_default_punct(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return run(c, n, pos, is_default_punct, ANY);
}

/* [0-9][0-9][0-9] */
static bool is_ascii_digit(uint32_t c)
{
    return c >= '0' && c <= '9';
}

static size_t scan_digits3(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return run(c, n, pos, is_ascii_digit, 3) == 3 ? 3 : 0;
}

/* BLOOM and its relatives:  ?[^(\s|.,!?…。，、।۔،)]+  (a class, so '(' '|' ')' are members). */
static bool is_bloom_word(uint32_t c)
{
    static const uint32_t stop[] = {'(',    '|',    ')',    '.',    ',',    '!',    '?',
                                    0x2026, 0x3002, 0xFF0C, 0x3001, 0x0964, 0x06D4, 0x060C};
    if (is_space(c))
        return false;
    for (size_t i = 0; i < N_OF(stop); i++)
        if (c == stop[i])
            return false;
    return true;
}

static size_t scan_bloom(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    size_t k = pos + (c[pos] == ' ' && pos + 1 < n && is_bloom_word(c[pos + 1]));
    size_t r = run(c, n, k, is_bloom_word, ANY);
    return r ? k + r - pos : 0;
}

/* DeepSeek V3, first: \p{N}{1,3} */
static size_t scan_digits_1_3(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return run(c, n, pos, is_number, 3);
}

/* DeepSeek V3, second: [一-龥぀-ゟ゠-ヿ]+ (CJK ideographs, hiragana, katakana). */
static const struct range cjk_kana[] = {{0x3040, 0x30FF}, {0x4E00, 0x9FA5}};

static bool is_cjk_kana(uint32_t c)
{
    return in_set(cjk_kana, N_OF(cjk_kana), c);
}

static size_t scan_cjk_kana(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    return run(c, n, pos, is_cjk_kana, ANY);
}

static bool is_ascii_alpha(uint32_t c)
{
    return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
}

/* [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]: every ASCII punctuation and symbol character. */
static bool is_ascii_punct(uint32_t c)
{
    return c > 0x20 && c < 0x7F && !is_ascii_alpha(c) && !(c >= '0' && c <= '9');
}

/* [\p{L}\p{M}] */
static bool is_letter_mark(uint32_t c)
{
    enum kvr_ucat k = kvr_cp_ucat(c);
    return !is_space(c) && (k == KVR_UCAT_LETTER || k == KVR_UCAT_MARK);
}

/* [\p{P}\p{S}], as llama.cpp matches it: without '~' (it leaves that one ASCII symbol
 * out of \p{S}; tokenize_peer.sh shows it, and its ids are the reference). */
static bool is_punct_symbol(uint32_t c)
{
    enum kvr_ucat k = kvr_cp_ucat(c);
    return c != '~' && !is_space(c) && (k == KVR_UCAT_PUNCT || k == KVR_UCAT_SYMBOL);
}

/* The white-space tail shared by the Llama 3 style patterns:
 *   \s*[\r\n]+|\s+(?!\S)|\s+   (c[pos] is white space) */
static size_t space_tail(const uint32_t *c, size_t n, size_t pos)
{
    size_t w = run(c, n, pos, is_space, ANY);
    for (size_t j = pos + w; j > pos; j--)
        if (is_crlf(c[j - 1]))
            return j - pos;
    if (pos + w == n || w == 1)
        return w;
    return w - 1;
}

/* DeepSeek V3, third:
 *   [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
 *    ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * Numbers and anything else none of these take stay between matches (their own words). */
static size_t scan_dsv3(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    uint32_t c0 = c[pos];
    if (is_ascii_punct(c0) && pos + 1 < n && is_ascii_alpha(c[pos + 1]))
        return 1 + run(c, n, pos + 1, is_ascii_alpha, ANY);
    /* A mark first: the optional character and the run give the same match. */
    if (is_letter_mark(c0))
        return run(c, n, pos, is_letter_mark, ANY);
    if (!is_crlf(c0) && !is_letter(c0) && !is_punct_symbol(c0) && pos + 1 < n &&
        is_letter_mark(c[pos + 1]))
        return 1 + run(c, n, pos + 1, is_letter_mark, ANY);
    size_t k = pos + (c0 == ' ' && pos + 1 < n && is_punct_symbol(c[pos + 1]));
    if (is_punct_symbol(c[k])) {
        size_t e = k + run(c, n, k, is_punct_symbol, ANY);
        return e + run(c, n, e, is_crlf, ANY) - pos;
    }
    return is_space(c0) ? space_tail(c, n, pos) : 0;
}

/* GPT-4o's o200k vocabulary (gpt-oss):
 *   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
 *   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
 *   \p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * as llama.cpp matches it, whose ids are the reference: its tables know the major category
 * only, so the "upper" class is a letter other than a-z, the "lower" class a letter other
 * than A-Z (a letter outside ASCII is in both), marks are in neither, and the contractions
 * are ASCII case-insensitive. */
static bool is_upperish(uint32_t c)
{
    return is_letter(c) && !(c >= 'a' && c <= 'z');
}

static bool is_lowerish(uint32_t c)
{
    return is_letter(c) && !(c >= 'A' && c <= 'Z');
}

/* [\r\n/] */
static bool is_crlf_slash(uint32_t c)
{
    return is_crlf(c) || c == '/';
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)? at c[pos]: its length, 0 when absent. */
static size_t contraction(const uint32_t *c, size_t n, size_t pos)
{
    if (pos + 1 >= n || c[pos] != '\'')
        return 0;
    uint32_t c1 = ascii_lower(c[pos + 1]);
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')
        return 2;
    if (pos + 2 < n) {
        uint32_t c2 = ascii_lower(c[pos + 2]);
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
            return 3;
    }
    return 0;
}

/* The two letter alternatives from c[k], a letter: the end of the letters they take, or k
 * when neither matches. First: upper* takes every letter up to the first a-z, lower+ then
 * runs up to the next A-Z; without an a-z in the run, upper* gives back letters until the
 * last one outside ASCII (the only kind lower+ can start on) and lower+ takes just that one.
 * Second, for a run of A-Z only: all of it. */
static size_t gpt4o_letters(const uint32_t *c, size_t n, size_t k)
{
    size_t j = k;
    while (j < n && is_upperish(c[j]))
        j++;
    if (j < n && is_lowerish(c[j])) {
        while (j < n && is_lowerish(c[j]))
            j++;
        return j;
    }
    for (size_t i = j; i > k; i--)
        if (c[i - 1] > 0x7F)
            return i;
    return j; /* the second alternative: upper+ (j > k: c[k] is a letter), lower* empty */
}

static size_t scan_gpt4o(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    uint32_t c0 = c[pos];
    size_t k = pos;
    if (!is_letter(c0) && !is_crlf(c0) && !is_number(c0) && pos + 1 < n && is_letter(c[pos + 1]))
        k = pos + 1; /* the optional leading character */
    if (is_letter(c[k])) {
        size_t e = gpt4o_letters(c, n, k);
        return e + contraction(c, n, e) - pos;
    }
    if (is_number(c0))
        return run(c, n, pos, is_number, 3);
    k = pos + (c0 == ' ' && pos + 1 < n && is_other(c[pos + 1]));
    if (is_other(c[k])) {
        size_t e = k + run(c, n, k, is_other, ANY);
        return e + run(c, n, e, is_crlf_slash, ANY) - pos; /* "//\n/" is one word */
    }
    return is_space(c0) ? space_tail(c, n, pos) : 0;
}

/* Kimi K2 (a deepseek2 model with its own vocabulary):
 *   [\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)?|(the same with + and * swapped)|\p{N}{1,3}|
 *    ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * as llama.cpp matches it, whose ids are the reference: Han is the CJK ideograph blocks
 * (not U+3005, the radicals or extensions G and later), and the two letter alternatives
 * come down to a run of letters other than Han, with no split at a change of case. */
static const struct range han[] = {
    {0x3400, 0x4DBF},   {0x4E00, 0x9FFF},   {0xF900, 0xFAFF},
    {0x20000, 0x2A6DF}, {0x2A700, 0x2EBEF}, {0x2F800, 0x2FA1F},
};

static bool is_han(uint32_t c)
{
    return in_set(han, N_OF(han), c);
}

static bool is_letter_not_han(uint32_t c)
{
    return is_letter(c) && !is_han(c);
}

static size_t scan_kimi(const uint32_t *c, size_t n, size_t pos, size_t *skip)
{
    (void)skip;
    uint32_t c0 = c[pos];
    if (is_han(c0))
        return run(c, n, pos, is_han, ANY);
    size_t k = pos;
    if (!is_letter(c0) && !is_crlf(c0) && !is_number(c0) && pos + 1 < n &&
        is_letter_not_han(c[pos + 1]))
        k = pos + 1; /* the optional leading character */
    if (is_letter_not_han(c[k])) {
        size_t e = k + run(c, n, k, is_letter_not_han, ANY);
        return e + contraction(c, n, e) - pos;
    }
    if (is_number(c0))
        return run(c, n, pos, is_number, 3);
    k = pos + (c0 == ' ' && pos + 1 < n && is_other(c[pos + 1]));
    if (is_other(c[k])) {
        size_t e = k + run(c, n, k, is_other, ANY);
        return e + run(c, n, e, is_crlf, ANY) - pos;
    }
    return is_space(c0) ? space_tail(c, n, pos) : 0;
}

typedef size_t (*scan_fn)(const uint32_t *c, size_t n, size_t pos, size_t *skip);

static const scan_fn scanners[RULE_COUNT] = {
    [RULE_GPT2] = scan_gpt2,
    [RULE_LLAMA3] = scan_llama3,
    [RULE_QWEN2] = scan_qwen2,
    [RULE_CRLF] = scan_crlf,
    [RULE_DSL_LETTERS] = scan_dsl_letters,
    [RULE_DSL_PUNCT] = scan_dsl_punct,
    [RULE_SPACE_END] = scan_space_end,
    [RULE_CJK] = scan_cjk,
    [RULE_NUMBERS] = scan_numbers,
    [RULE_NUMBER] = scan_number,
    [RULE_DSC_LETTERS] = scan_dsc_letters,
    [RULE_DSC_PUNCT] = scan_dsc_punct,
    [RULE_FALCON_PUNCT] = scan_falcon_punct,
    [RULE_DEFAULT_PUNCT] = scan_default_punct,
    [RULE_DIGITS3] = scan_digits3,
    [RULE_BLOOM] = scan_bloom,
    [RULE_DIGITS_1_3] = scan_digits_1_3,
    [RULE_CJK_KANA] = scan_cjk_kana,
    [RULE_DSV3] = scan_dsv3,
    [RULE_GPT4O] = scan_gpt4o,
    [RULE_KIMI] = scan_kimi,
};

/* ---- the table ---------------------------------------------------------------------------
 * Names as llama.cpp's converter writes them to tokenizer.ggml.pre; names that share a row
 * are vocabularies whose patterns are the same. */

static const char *const names_gpt2[] = {
    "gpt-2",   "phi-2",      "roberta-bpe",     "mpt",        "olmo",         "jais",     "jina-es",
    "jina-de", "jina-v1-en", "jina-v2-es",      "jina-v2-de", "jina-v2-code", "gigachat", "a.x-4.0",
    "mellum",  "trillion",   "granite-docling", "exaone4",    "modern-bert",  NULL};
static const char *const names_llama3[] = {
    "llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", NULL};
static const char *const names_llama3_merged[] = {"dbrx", "smaug-bpe", "glm4", "chatglm-bpe", NULL};
static const char *const names_qwen2[] = {
    "qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "kormo", "solar-open",
    /* Their pattern ends "\s*[\r\n]" where Qwen's has "\s*[\r\n]+": the same matches. */
    "bailingmoe", "llada-moe", NULL};
static const char *const names_bloom[] = {"bloom", "poro-chat", "gpt3-finnish", NULL};
static const char *const names_viking[] = {"viking", NULL};
static const char *const names_dsl[] = {"deepseek-llm", NULL};
static const char *const names_dsc[] = {"deepseek-coder", NULL};
static const char *const names_falcon[] = {"falcon", NULL};
static const char *const names_starcoder[] = {"starcoder", "refact", "command-r",  "smollm",
                                              "codeshell", "exaone", "minerva-7b", NULL};
static const char *const names_dsv3[] = {"deepseek-v3", "hunyuan-dense", NULL};
static const char *const names_gpt4o[] = {"gpt-4o", NULL};
static const char *const names_kimi[] = {"kimi-k2", NULL};
static const char *const names_default[] = {"default", NULL};

#define ROW(names_, ...)                                                                           \
    .names = (names_), .n_rules = sizeof((uint8_t[]){__VA_ARGS__}), .rules = {__VA_ARGS__}

static const struct kvr_pre table[] = {
    {ROW(names_gpt2, RULE_GPT2)},
    /* Llama 3 adds BOS unless the file says otherwise. */
    {ROW(names_llama3, RULE_LLAMA3), .ignore_merges = true, .add_bos = true},
    {ROW(names_llama3_merged, RULE_LLAMA3)},
    {ROW(names_qwen2, RULE_QWEN2)},
    /* DeepSeek LLM: [\r\n], letters, punctuation, \s+$, CJK, \p{N}+ */
    {ROW(names_dsl, RULE_CRLF, RULE_DSL_LETTERS, RULE_DSL_PUNCT, RULE_SPACE_END, RULE_CJK,
         RULE_NUMBERS)},
    /* DeepSeek Coder: [\r\n], \s?\p{L}+, \s?\p{P}+, CJK, \p{N} */
    {ROW(names_dsc, RULE_CRLF, RULE_DSC_LETTERS, RULE_DSC_PUNCT, RULE_CJK, RULE_NUMBER)},
    {ROW(names_falcon, RULE_FALCON_PUNCT, RULE_GPT2, RULE_DIGITS3)},
    {ROW(names_starcoder, RULE_NUMBER, RULE_GPT2)},
    {ROW(names_bloom, RULE_BLOOM)},
    {ROW(names_viking, RULE_BLOOM, RULE_NUMBER)},
    {ROW(names_dsv3, RULE_DIGITS_1_3, RULE_CJK_KANA, RULE_DSV3)},
    {ROW(names_gpt4o, RULE_GPT4O)},
    {ROW(names_kimi, RULE_KIMI)},
    /* What llama.cpp uses for a missing tokenizer.ggml.pre; here only when named. */
    {ROW(names_default, RULE_DEFAULT_PUNCT, RULE_GPT2, RULE_NUMBERS, RULE_DIGITS3)},
};

#define N_TABLE N_OF(table)

const struct kvr_pre *kvr_pre_find(const char *name, size_t len)
{
    for (size_t i = 0; i < N_TABLE; i++)
        for (const char *const *nm = table[i].names; *nm; nm++)
            if (strlen(*nm) == len && memcmp(*nm, name, len) == 0)
                return &table[i];
    return NULL;
}

const struct kvr_pre *kvr_pre_gpt2(void)
{
    return &table[0];
}

const char *kvr_pre_name(size_t i)
{
    for (size_t r = 0; r < N_TABLE; r++)
        for (const char *const *nm = table[r].names; *nm; nm++)
            if (i-- == 0)
                return *nm;
    return NULL;
}

void kvr_pre_list(char *buf, size_t cap, bool aliases)
{
    size_t m = 0;
    if (cap == 0)
        return;
    buf[0] = 0;
    for (size_t i = 0; i < N_TABLE; i++) {
        for (const char *const *nm = table[i].names; *nm && (aliases || nm == table[i].names);
             nm++) {
            int k = snprintf(buf + m, cap - m, "%s%s", m ? ", " : "", *nm);
            if (k < 0 || (size_t)k >= cap - m)
                return; /* cut, still NUL-terminated */
            m += (size_t)k;
        }
    }
}

/* ---- the split ------------------------------------------------------------------------ */

/* Split each word of `in` (ends, n_in of them) by `rule` into `out`; returns the count. */
static size_t split_rule(enum pre_rule rule, const uint32_t *cps, const uint32_t *in, size_t n_in,
                         uint32_t *out)
{
    scan_fn scan = scanners[rule];
    size_t n_out = 0, start = 0;
    for (size_t w = 0; w < n_in; w++) {
        const uint32_t *c = cps + start;
        size_t n = in[w] - start, gap = 0;
        for (size_t pos = 0; pos < n;) {
            size_t skip = pos + 1;
            size_t m = scan(c, n, pos, &skip);
            if (m == 0) {
                pos = skip;
                continue;
            }
            if (pos > gap)
                out[n_out++] = (uint32_t)(start + pos);
            pos += m;
            out[n_out++] = (uint32_t)(start + pos);
            gap = pos;
        }
        if (gap < n)
            out[n_out++] = (uint32_t)(start + n);
        start = in[w];
    }
    return n_out;
}

const uint32_t *kvr_pre_split(const struct kvr_pre *p, const uint32_t *cps, size_t n, uint32_t *a,
                              uint32_t *b, size_t *n_words)
{
    if (n == 0) {
        *n_words = 0;
        return a;
    }
    b[0] = (uint32_t)n;
    size_t count = 1;
    const uint32_t *in = b;
    uint32_t *out = a;
    for (uint8_t r = 0; r < p->n_rules; r++) {
        count = split_rule((enum pre_rule)p->rules[r], cps, in, count, out);
        const uint32_t *done = out;
        out = out == a ? b : a;
        in = done;
    }
    *n_words = count;
    return in;
}
