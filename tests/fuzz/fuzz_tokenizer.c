/* fuzz_tokenizer.c - libFuzzer target for the tokenizers.
 *
 * Input: one mode byte, then a payload.
 *   mode % 4 == 0  encode the payload with a small SentencePiece vocabulary built in memory
 *   mode % 4 == 1  the same with a small GPT-2 byte-level BPE vocabulary
 *   mode % 4 == 2  build a vocabulary from the payload (see vocab_from_bytes), then encode
 *   mode % 4 == 3  open the payload as a GGUF image and build the tokenizer from it
 *   bit 4: parse_special, bit 5: add_special, bit 6 (mode 2): BPE instead of SPM,
 *   bit 7 (modes 1 and 2, BPE): the next byte picks the pre-tokenizer, by index into the
 *   names kvr_tok_pre_name lists (modulo their count); without it, GPT-2's.
 * Invariants checked (a violation traps): encode never fails with enough room, reports
 * KVR_EFULL with one id too few, returns ids in range; streaming decode only ever emits
 * valid UTF-8; valid UTF-8 text without specials decodes back to itself (for SPM, unless
 * it contains U+2581 itself, which SentencePiece cannot tell from an escaped space, or a
 * user-defined token, after which SPM adds a space). With a pre-tokenizer picked, its
 * split is also checked directly: the words cover the text in order, none empty. */
#define _GNU_SOURCE /* memmem */
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "model/tokenizer_pre.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_TEXT 8192
#define MAX_IDS (8 * MAX_TEXT + 16)

static int32_t ids[MAX_IDS];
static char out[16 * MAX_IDS];

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "fuzz_tokenizer: %s failed at line %d\n", #c, __LINE__);               \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

/* Strict UTF-8 (shortest forms, no surrogates, at most U+10FFFF). */
static bool utf8_valid(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint8_t c = p[i];
        size_t k;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            k = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            k = 3;
            lo = c == 0xE0 ? 0xA0 : 0x80;
            hi = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            k = 4;
            lo = c == 0xF0 ? 0x90 : 0x80;
            hi = c == 0xF4 ? 0x8F : 0xBF;
        } else {
            return false;
        }
        if (n - i < k || p[i + 1] < lo || p[i + 1] > hi)
            return false;
        for (size_t j = 2; j < k; j++)
            if ((p[i + j] & 0xC0) != 0x80)
                return false;
        i += k;
    }
    return true;
}

static struct kvr_gguf_str S(const char *s) {
    return (struct kvr_gguf_str){strlen(s), s};
}

/* SPM: <unk> <s> </s>, the 256 byte tokens, a few pieces, a control and a user-defined
 * token. */
static struct kvr_tok *
make_spm(void)
{
    static char bytes[256][7];
#define SP "\xE2\x96\x81" /* U+2581, SentencePiece's space */
    static const char *const words[] = {SP,           (SP "t"),       "he",    (SP "the"), (SP "a"),
                                        "ab",         "\xC3\xA9",     (SP SP), "ll",       "o",
                                        (SP "Hello"), "<|im_start|>", "<ud>"};
#undef SP
    enum { N_WORDS = sizeof words / sizeof words[0], N = 3 + 256 + N_WORDS };
    static struct kvr_gguf_str toks[N];
    static float scores[N];
    static int32_t types[N];
    toks[0] = S("<unk>");
    toks[1] = S("<s>");
    toks[2] = S("</s>");
    types[0] = KVR_TOK_TYPE_UNKNOWN;
    types[1] = types[2] = KVR_TOK_TYPE_CONTROL;
    for (int b = 0; b < 256; b++) {
        snprintf(bytes[b], sizeof bytes[b], "<0x%02X>", b);
        toks[3 + b] = S(bytes[b]);
        types[3 + b] = KVR_TOK_TYPE_BYTE;
    }
    for (int i = 0; i < N_WORDS; i++) {
        toks[259 + i] = S(words[i]);
        scores[259 + i] = -(float)(i % 5);
        types[259 + i] = KVR_TOK_TYPE_NORMAL;
    }
    types[N - 2] = KVR_TOK_TYPE_CONTROL;
    types[N - 1] = KVR_TOK_TYPE_USER_DEFINED;
    struct kvr_tok_vocab v;
    kvr_tok_vocab_init(&v, KVR_TOK_SPM);
    v.n_tokens = N;
    v.tokens = toks;
    v.scores = scores;
    v.types = types;
    struct kvr_tok *t = NULL;
    CHECK(kvr_tok_create_from_vocab(&t, &v, NULL) == 0);
    return t;
}

/* BPE: the 256 byte-alphabet characters, a few merges and <|endoftext|>, with the
 * pre-tokenizer named `pre` (NULL: GPT-2's). */
static struct kvr_tok *make_bpe(const char *pre)
{
    static char alpha[256][4];
    static const char *const merged[] = {"\xC4\xA0t", "he", "\xC4\xA0the", "ll",
                                         "\xC4\xA0\xC4\xA0"};
    static const char *const merges[] = {"\xC4\xA0 t", "h e", "\xC4\xA0t he", "l l",
                                         "\xC4\xA0 \xC4\xA0"};
    enum { N_MERGED = 5, N = 256 + N_MERGED + 1 };
    static struct kvr_gguf_str toks[N], rules[N_MERGED];
    static int32_t types[N];
    int n = 0;
    unsigned next = 0x100;
    for (unsigned b = 0; b < 256; b++) {
        /* The byte alphabet: printable Latin-1 stands for itself, the rest from U+0100. */
        bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        unsigned cp = printable ? b : next++;
        if (cp < 0x80) {
            alpha[b][0] = (char)cp;
        } else {
            alpha[b][0] = (char)(0xC0 | (cp >> 6));
            alpha[b][1] = (char)(0x80 | (cp & 0x3F));
        }
        toks[n] = S(alpha[b]);
        types[n++] = KVR_TOK_TYPE_NORMAL;
    }
    for (int i = 0; i < N_MERGED; i++) {
        toks[n] = S(merged[i]);
        types[n++] = KVR_TOK_TYPE_NORMAL;
        rules[i] = S(merges[i]);
    }
    toks[n] = S("<|endoftext|>");
    types[n++] = KVR_TOK_TYPE_CONTROL;
    struct kvr_tok_vocab v;
    kvr_tok_vocab_init(&v, KVR_TOK_BPE);
    v.n_tokens = n;
    v.tokens = toks;
    v.types = types;
    v.n_merges = N_MERGED;
    v.merges = rules;
    v.bos_id = v.eos_id = n - 1;
    if (pre)
        v.pre = S(pre);
    struct kvr_tok *t = NULL;
    CHECK(kvr_tok_create_from_vocab(&t, &v, NULL) == 0);
    return t;
}

/* The index of the name picked by byte b (see the mode byte). */
static size_t pick_pre(uint8_t b)
{
    size_t n = 0;
    while (kvr_tok_pre_name(n))
        n++;
    return b % n;
}

/* The pre-tokenizer's split of text as code points (one per byte here: the split works on
 * any code point values), checked for covering the text. */
static void check_split(const char *pre, const uint8_t *text, size_t len)
{
    static uint32_t cps[MAX_TEXT], a[MAX_TEXT + 1], b[MAX_TEXT + 1];
    if (len > MAX_TEXT)
        len = MAX_TEXT;
    /* One code point per byte: at odd positions the byte itself (ASCII and Latin-1: space,
     * digits, punctuation, \r\n), at even ones spread over all planes (letters, marks,
     * CJK, unassigned), so every class the rules ask about shows up. */
    for (size_t i = 0; i < len; i++)
        cps[i] = i % 2 ? text[i] : (uint32_t)text[i] * 0x1111u % 0x110000u;
    const struct kvr_pre *p = kvr_pre_find(pre, strlen(pre));
    CHECK(p != NULL);
    size_t n_words;
    const uint32_t *ends = kvr_pre_split(p, cps, len, a, b, &n_words);
    CHECK(n_words <= len);
    CHECK(len == 0 || (n_words > 0 && ends[n_words - 1] == len));
    for (size_t w = 0; w < n_words; w++)
        CHECK(ends[w] > (w ? ends[w - 1] : 0));
}

/* Encode, check the invariants, decode. */
static void exercise(const struct kvr_tok *t, const uint8_t *text, size_t len, bool add_special,
                     bool parse_special, bool check_round_trip)
{
    static struct kvr_tok_scratch *s[KVR_TOK_KIND_COUNT];
    enum kvr_tok_kind kind = kvr_tok_kind(t);
    if (!s[kind])
        CHECK(kvr_tok_scratch_create(&s[kind], t, MAX_TEXT) == 0);
    if (len > MAX_TEXT)
        len = MAX_TEXT;
    int n = kvr_tok_encode(t, s[kind], (const char *)text, len, add_special, parse_special, ids,
                           MAX_IDS);
    if (n == KVR_EINVAL)
        return; /* a vocabulary that cannot represent some byte (mode 2 and 3) */
    CHECK(n >= 0);
    for (int i = 0; i < n; i++)
        CHECK(ids[i] >= 0 && ids[i] < kvr_tok_n_vocab(t));
    if (n > 0)
        CHECK(kvr_tok_encode(t, s[kind], (const char *)text, len, add_special, parse_special, ids,
                             (size_t)n - 1) == KVR_EFULL);

    struct kvr_detok d;
    bool spm = kind == KVR_TOK_SPM;
    kvr_detok_init(&d, spm, false);
    size_t m = 0, step = kvr_detok_max_bytes(t);
    int i = 0;
    for (; i < n && m + step + 3 <= sizeof out; i++) {
        int k = kvr_detok_push(t, &d, ids[i], out + m, sizeof out - m);
        CHECK(k >= 0);
        m += (size_t)k;
    }
    int k = kvr_detok_flush(&d, out + m, sizeof out - m);
    CHECK(k >= 0);
    m += (size_t)k;
    CHECK(utf8_valid((const uint8_t *)out, m));
    if (i == n && check_round_trip && !add_special && !parse_special && utf8_valid(text, len) &&
        (!spm || (!memmem(text, len, "<ud>", 4) && !memmem(text, len, "\xE2\x96\x81", 3))))
        CHECK(m == len && memcmp(out, text, len) == 0);
}

/* Mode 2: lines of the first part (up to a 0 byte) are pieces; a leading '!' marks a
 * control token, '~' user-defined, '?' unknown, '^' byte; lines starting with '#' are BPE
 * merges. The rest of the payload is the text. */
static void vocab_from_bytes(const uint8_t *p, size_t n, bool bpe, const char *pre,
                             bool add_special, bool parse_special)
{
    enum { MAX = 512 };
    static struct kvr_gguf_str toks[MAX], merges[MAX];
    static int32_t types[MAX];
    static float scores[MAX];
    const uint8_t *z = memchr(p, 0, n);
    size_t vlen = z ? (size_t)(z - p) : n;
    int n_tok = 0, n_merge = 0;
    for (size_t i = 0; i < vlen;) {
        const uint8_t *nl = memchr(p + i, '\n', vlen - i);
        size_t e = nl ? (size_t)(nl - p) : vlen;
        const char *line = (const char *)p + i;
        size_t len = e - i;
        int32_t type = KVR_TOK_TYPE_NORMAL;
        if (len > 0 && line[0] == '#' && n_merge < MAX) {
            merges[n_merge++] = (struct kvr_gguf_str){len - 1, line + 1};
        } else if (n_tok < MAX) {
            if (len > 0 && strchr("!~?^", line[0])) {
                type = line[0] == '!'   ? KVR_TOK_TYPE_CONTROL
                       : line[0] == '~' ? KVR_TOK_TYPE_USER_DEFINED
                       : line[0] == '?' ? KVR_TOK_TYPE_UNKNOWN
                                        : KVR_TOK_TYPE_BYTE;
                line++;
                len--;
            }
            scores[n_tok] = -(float)(len % 7);
            types[n_tok] = type;
            toks[n_tok++] = (struct kvr_gguf_str){len, line};
        }
        i = e + 1;
    }
    struct kvr_tok_vocab v;
    kvr_tok_vocab_init(&v, bpe ? KVR_TOK_BPE : KVR_TOK_SPM);
    v.n_tokens = n_tok;
    v.tokens = toks;
    v.scores = scores;
    v.types = types;
    v.n_merges = bpe ? n_merge : 0;
    v.merges = merges;
    if (bpe && pre)
        v.pre = S(pre);
    /* Keep the default special ids only where they exist. */
    if (v.bos_id >= n_tok)
        v.bos_id = -1;
    if (v.eos_id >= n_tok)
        v.eos_id = -1;
    if (v.unk_id >= n_tok)
        v.unk_id = -1;
    v.add_bos = v.bos_id >= 0 ? -1 : 0;
    struct kvr_tok *t = NULL;
    struct kvr_err err;
    if (kvr_tok_create_from_vocab(&t, &v, &err) != 0)
        return;
    size_t rest = z ? n - vlen - 1 : 0;
    exercise(t, z ? z + 1 : p, rest, add_special, parse_special, false);
    kvr_tok_destroy(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct kvr_tok *spm, *bpe, *bpe_pre[256]; /* by pre-tokenizer index */
    if (!spm) {
        spm = make_spm();
        bpe = make_bpe(NULL);
    }
    if (size < 1)
        return 0;
    uint8_t mode = data[0];
    bool parse_special = mode & 0x10, add_special = mode & 0x20;
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    const char *pre = NULL;
    size_t pre_index = 0;
    if ((mode & 3) != 0 && (mode & 3) != 3 && (mode & 0x80) && n > 0) {
        pre_index = pick_pre(p[0]);
        pre = kvr_tok_pre_name(pre_index);
        if (!bpe_pre[pre_index])
            bpe_pre[pre_index] = make_bpe(pre);
        p++;
        n--;
    }
    switch (mode & 3) {
    case 0:
        exercise(spm, p, n, add_special, parse_special, true);
        break;
    case 1:
        exercise(pre ? bpe_pre[pre_index] : bpe, p, n, add_special, parse_special, true);
        if (pre)
            check_split(pre, p, n);
        break;
    case 2:
        vocab_from_bytes(p, n, mode & 0x40, pre, add_special, parse_special);
        break;
    default: {
        struct kvr_gguf *g = NULL;
        struct kvr_tok *t = NULL;
        if (kvr_gguf_open_mem(&g, p, n, NULL) != 0)
            break;
        if (kvr_tok_create(&t, g, NULL) == 0) {
            static const char text[] = "Hello world, <s> \xC3\xBCn\xC3\xAF \xF0\x9F\xA6\x99 a\n";
            kvr_gguf_close(g);
            g = NULL;
            exercise(t, (const uint8_t *)text, sizeof text - 1, add_special, parse_special, false);
            kvr_tok_destroy(t);
        }
        kvr_gguf_close(g);
        break;
    }
    }
    return 0;
}
