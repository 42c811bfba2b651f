/* json_schema_str.c - the string- and number-shaped parts of JSON Schema to GBNF
 * (json_schema.h): integer ranges as digit patterns, string formats as fixed grammars, and
 * a subset of ECMAScript regular expressions (`pattern`) translated to GBNF.
 *
 * Generated strings never contain escapes, quotes, backslashes or control characters
 * unless the pattern names them literally, so what the grammar writes between the quotes
 * is the decoded string the pattern is tested against. Where the regex dialects differ
 * (\s, \W, \D and the like in Python's re versus ECMAScript), the negated shorthands are
 * generated from printable ASCII only, which both dialects agree on. */
#include "bridge/json_schema.h"

#include "core/alloc.h"
#include "core/utf8.h"
#include "model/grammar.h"

#include <stdio.h>
#include <string.h>

/* ---- integer ranges ---------------------------------------------------------------------------
 */

/* Whether s[0..n) are all the digit d (the strings here are not NUL-terminated). */
static bool all_digit(const char *s, size_t n, char d)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != d)
            return false;
    return true;
}

/* Same-length digit strings x <= y: alternatives covering exactly [x, y]. */
static void digits_range(struct kvr_sbuf *out, const char *x, const char *y, size_t n)
{
    if (n == 0) {
        kvr_sbuf_puts(out, "\"\"");
        return;
    }
    if (!memcmp(x, y, n)) {
        kvr_gbnf_literal(out, x, n);
        return;
    }
    if (x[0] == y[0]) {
        kvr_sbuf_printf(out, "\"%c\" (", x[0]);
        digits_range(out, x + 1, y + 1, n - 1);
        kvr_sbuf_puts(out, ")");
        return;
    }
    bool x_low = all_digit(x + 1, n - 1, '0'), y_high = all_digit(y + 1, n - 1, '9');
    char lo = x_low ? x[0] : (char)(x[0] + 1), hi = y_high ? y[0] : (char)(y[0] - 1);
    const char *sep = "";
    char nines[20], zeros[20];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    if (!x_low) {
        kvr_sbuf_printf(out, "\"%c\" (", x[0]);
        digits_range(out, x + 1, nines, n - 1);
        kvr_sbuf_puts(out, ")");
        sep = " | ";
    }
    if (lo <= hi) {
        kvr_sbuf_printf(out, "%s[%c-%c]", sep, lo, hi);
        if (n > 1)
            kvr_sbuf_printf(out, " [0-9]{%zu}", n - 1);
        sep = " | ";
    }
    if (!y_high) {
        kvr_sbuf_printf(out, "%s\"%c\" (", sep, y[0]);
        digits_range(out, zeros, y + 1, n - 1);
        kvr_sbuf_puts(out, ")");
    }
}

/* Non-negative integers in [a, b] (b = INT64_MAX: unbounded, up to 16 digits), no leading
 * zeros. */
static void nonneg_range(struct kvr_sbuf *out, int64_t a, int64_t b)
{
    char xa[24], xb[24];
    int la = snprintf(xa, sizeof xa, "%lld", (long long)a);
    bool open = b == INT64_MAX;
    int lb = open ? (la > 16 ? la : 16) : snprintf(xb, sizeof xb, "%lld", (long long)b);
    const char *sep = "";
    for (int len = la; len <= lb; len++) {
        char lo[24], hi[24];
        if (len == la)
            memcpy(lo, xa, (size_t)len);
        else
            lo[0] = '1', memset(lo + 1, '0', (size_t)len - 1);
        if (len == lb && !open)
            memcpy(hi, xb, (size_t)len);
        else
            memset(hi, '9', (size_t)len);
        if (len == 1 && lo[0] == '0' && hi[0] > '0') { /* "0" alone, then 1..hi */
            kvr_sbuf_printf(out, "%s\"0\"", sep);
            sep = " | ";
            lo[0] = '1';
        }
        kvr_sbuf_printf(out, "%s(", sep);
        digits_range(out, lo, hi, (size_t)len);
        kvr_sbuf_puts(out, ")");
        sep = " | ";
    }
}

void kvr_gbnf_int_range(struct kvr_sbuf *out, int64_t lo, int64_t hi)
{
    const char *sep = "";
    if (lo < 0) { /* -[max(1, -hi), -lo] */
        int64_t a = hi < 0 ? -hi : 1, b = lo == INT64_MIN ? INT64_MAX : -lo;
        kvr_sbuf_puts(out, "\"-\" (");
        nonneg_range(out, a, b);
        kvr_sbuf_puts(out, ")");
        sep = " | ";
    }
    if (hi >= 0) {
        kvr_sbuf_puts(out, sep);
        nonneg_range(out, lo > 0 ? lo : 0, hi);
    }
}

/* ---- formats ------------------------------------------------------------------------------------
 */

#define Q "\"\\\"\""
/* an octet without leading zeros */
#define OCTET "(\"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9]? [0-9])"
static const struct {
    const char *name;
    const char *body;
} formats[] = {
    /* days 01-28 only: every one is a real date in every month */
    {"date", Q " [0-9]{4} \"-\" (\"0\" [1-9] | \"1\" [0-2]) \"-\" (\"0\" [1-9] | \"1\" [0-9] | "
               "\"2\" [0-8]) " Q},
    {"time", Q " ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] \":\" [0-5] [0-9] \"Z\" " Q},
    {"date-time", Q " [0-9]{4} \"-\" (\"0\" [1-9] | \"1\" [0-2]) \"-\" (\"0\" [1-9] | \"1\" "
                    "[0-9] | \"2\" [0-8]) \"T\" ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] "
                    "\":\" [0-5] [0-9] \"Z\" " Q},
    {"uuid", Q " [0-9a-f]{8} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" "
               "[0-9a-f]{12} " Q},
    {"email", Q " [a-z0-9]{1,20} (\".\" [a-z0-9]{1,20})? \"@\" [a-z0-9]{1,20} \".\" [a-z]{2,6} " Q},
    {"ipv4", Q " " OCTET " \".\" " OCTET " \".\" " OCTET " \".\" " OCTET " " Q},
};
#undef Q
#undef OCTET

int kvr_gbnf_format(struct kvr_sbuf *out, const char *format)
{
    for (size_t i = 0; i < sizeof formats / sizeof *formats; i++)
        if (!strcmp(formats[i].name, format)) {
            kvr_sbuf_puts(out, formats[i].body);
            return KVR_OK;
        }
    return KVR_ENOTSUP;
}

/* ---- patterns -------------------------------------------------------------------------------- */

#define MAX_RANGES 256

struct cls {
    uint32_t lo[MAX_RANGES], hi[MAX_RANGES];
    uint32_t n;
};

struct rx {
    const char *s;
    size_t i, n;
    struct kvr_sbuf *out;
    const char *why;
    uint32_t depth;
};

static void cls_add(struct cls *c, uint32_t lo, uint32_t hi)
{
    if (c->n < MAX_RANGES)
        c->lo[c->n] = lo, c->hi[c->n] = hi, c->n++;
}

/* Sort and merge the ranges. */
static void cls_norm(struct cls *c)
{
    for (uint32_t i = 1; i < c->n; i++)
        for (uint32_t j = i; j > 0 && c->lo[j - 1] > c->lo[j]; j--) {
            uint32_t a = c->lo[j], b = c->hi[j];
            c->lo[j] = c->lo[j - 1], c->hi[j] = c->hi[j - 1];
            c->lo[j - 1] = a, c->hi[j - 1] = b;
        }
    uint32_t k = 0;
    for (uint32_t i = 0; i < c->n; i++) {
        if (k && c->lo[i] <= c->hi[k - 1] + 1) {
            if (c->hi[i] > c->hi[k - 1])
                c->hi[k - 1] = c->hi[i];
        } else {
            c->lo[k] = c->lo[i], c->hi[k] = c->hi[i], k++;
        }
    }
    c->n = k;
}

/* c = complement of c within [lo, hi]. */
static void cls_complement(struct cls *c, uint32_t lo, uint32_t hi)
{
    cls_norm(c);
    struct cls r = {.n = 0};
    uint32_t x = lo;
    for (uint32_t i = 0; i < c->n && x <= hi; i++) {
        if (c->hi[i] < x)
            continue;
        if (c->lo[i] > x)
            cls_add(&r, x, c->lo[i] - 1 < hi ? c->lo[i] - 1 : hi);
        x = c->hi[i] + 1;
    }
    if (x <= hi)
        cls_add(&r, x, hi);
    *c = r;
}

/* Remove what a raw string character may not be: controls, '"', '\\' and surrogates. */
static void cls_json_safe(struct cls *c)
{
    struct cls bad = {.n = 0};
    cls_add(&bad, 0, 0x1f);
    cls_add(&bad, '"', '"');
    cls_add(&bad, '\\', '\\');
    cls_add(&bad, 0xD800, 0xDFFF);
    cls_complement(&bad, 0, 0x10FFFF); /* the safe set */
    cls_norm(c);
    struct cls r = {.n = 0};
    for (uint32_t i = 0; i < c->n; i++)
        for (uint32_t j = 0; j < bad.n; j++) {
            uint32_t a = c->lo[i] > bad.lo[j] ? c->lo[i] : bad.lo[j];
            uint32_t b = c->hi[i] < bad.hi[j] ? c->hi[i] : bad.hi[j];
            if (a <= b)
                cls_add(&r, a, b);
        }
    *c = r;
}

static void put_cp(struct kvr_sbuf *out, uint32_t cp)
{
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9'))
        kvr_sbuf_printf(out, "%c", (char)cp);
    else if (cp < 0x100)
        kvr_sbuf_printf(out, "\\x%02X", cp);
    else if (cp < 0x10000)
        kvr_sbuf_printf(out, "\\u%04X", cp);
    else
        kvr_sbuf_printf(out, "\\U%08X", cp);
}

static int cls_emit(struct rx *r, struct cls *c)
{
    cls_json_safe(c);
    if (!c->n) {
        r->why = "a character class with no character a JSON string can hold unescaped";
        return KVR_ENOTSUP;
    }
    kvr_sbuf_puts(r->out, "[");
    for (uint32_t i = 0; i < c->n; i++) {
        put_cp(r->out, c->lo[i]);
        if (c->hi[i] > c->lo[i]) {
            kvr_sbuf_puts(r->out, "-");
            put_cp(r->out, c->hi[i]);
        }
    }
    kvr_sbuf_puts(r->out, "]");
    return KVR_OK;
}

/* \d \w \s and negations into c; false if `e` is not one. */
static bool shorthand(char e, struct cls *c)
{
    switch (e) {
    case 'd':
        cls_add(c, '0', '9');
        return true;
    case 'w':
        cls_add(c, '0', '9'), cls_add(c, 'A', 'Z'), cls_add(c, 'a', 'z'), cls_add(c, '_', '_');
        return true;
    case 's':
        cls_add(c, ' ', ' ');
        return true; /* the one space both dialects agree on */
    case 'D':
        cls_add(c, ' ', '/'), cls_add(c, ':', '~');
        return true;
    case 'W':
        cls_add(c, ' ', '/'), cls_add(c, ':', '@'), cls_add(c, '[', '^'), cls_add(c, '`', '`'),
            cls_add(c, '{', '~');
        return true;
    case 'S':
        cls_add(c, '!', '~');
        return true;
    default:
        return false;
    }
}

/* An escaped literal: the code point, or UINT32_MAX if unsupported. */
static uint32_t escaped(struct rx *r, char e)
{
    switch (e) {
    case 'n':
        return '\n';
    case 't':
        return '\t';
    case 'r':
        return '\r';
    case 'f':
        return '\f';
    case 'v':
        return '\v';
    case '0':
        return 0;
    default:
        if (strchr("\\^$.|?*+()[]{}/-\"'", e))
            return (uint32_t)e;
        r->why = "an escape outside \\d \\w \\s \\D \\W \\S \\n \\t \\r \\f \\v and punctuation";
        return UINT32_MAX;
    }
}

/* One character (UTF-8 or escape) inside a class or as a literal. */
static int next_cp(struct rx *r, uint32_t *cp)
{
    if (r->i >= r->n) {
        r->why = "unexpected end of pattern";
        return KVR_ENOTSUP;
    }
    size_t k = kvr_utf8_decode(r->s + r->i, r->n - r->i, cp, KVR_UTF8_STRICT);
    if (!k) {
        r->why = "invalid UTF-8";
        return KVR_ENOTSUP;
    }
    r->i += k;
    return KVR_OK;
}

static int parse_class(struct rx *r)
{
    struct cls c = {.n = 0};
    r->i++; /* [ */
    bool neg = r->i < r->n && r->s[r->i] == '^';
    r->i += neg;
    bool first = true;
    while (r->i < r->n && (r->s[r->i] != ']' || first)) {
        first = false;
        uint32_t lo;
        if (r->s[r->i] == '\\' && r->i + 1 < r->n) {
            char e = r->s[r->i + 1];
            r->i += 2;
            if (shorthand(e, &c))
                continue;
            if ((lo = escaped(r, e)) == UINT32_MAX)
                return KVR_ENOTSUP;
        } else if (next_cp(r, &lo)) {
            return KVR_ENOTSUP;
        }
        uint32_t hi = lo;
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            r->i++;
            if (r->s[r->i] == '\\' && r->i + 1 < r->n) {
                r->i += 2;
                if ((hi = escaped(r, r->s[r->i - 1])) == UINT32_MAX)
                    return KVR_ENOTSUP;
            } else if (next_cp(r, &hi)) {
                return KVR_ENOTSUP;
            }
            if (hi < lo) {
                r->why = "a backwards range in a class";
                return KVR_ENOTSUP;
            }
        }
        cls_add(&c, lo, hi);
    }
    if (r->i >= r->n) {
        r->why = "an unterminated class";
        return KVR_ENOTSUP;
    }
    r->i++;
    if (neg)
        cls_complement(&c, 0, 0x10FFFF);
    return cls_emit(r, &c);
}

/* A literal code point of the decoded string, as the JSON text that stands for it. */
static void literal_cp(struct rx *r, uint32_t cp)
{
    char buf[8];
    if (cp == '"' || cp == '\\') {
        buf[0] = '\\', buf[1] = (char)cp;
        kvr_gbnf_literal(r->out, buf, 2);
    } else if (cp < 0x20) {
        int n = snprintf(buf, sizeof buf, "\\u%04x", cp);
        kvr_gbnf_literal(r->out, buf, (size_t)n);
    } else {
        kvr_gbnf_literal(r->out, buf, kvr_utf8_encode(cp, buf));
    }
}

static int parse_alt(struct rx *r);

static int parse_atom(struct rx *r)
{
    char ch = r->s[r->i];
    if (ch == '(') {
        if (++r->depth > 32) {
            r->why = "groups nested deeper than 32";
            return KVR_ENOTSUP;
        }
        r->i++;
        if (r->i < r->n && r->s[r->i] == '?') {
            if (r->i + 1 < r->n && r->s[r->i + 1] == ':') {
                r->i += 2;
            } else {
                r->why = "lookaround or named groups";
                return KVR_ENOTSUP;
            }
        }
        kvr_sbuf_puts(r->out, "(");
        int rc = parse_alt(r);
        if (rc)
            return rc;
        if (r->i >= r->n || r->s[r->i] != ')') {
            r->why = "an unclosed group";
            return KVR_ENOTSUP;
        }
        r->i++;
        r->depth--;
        kvr_sbuf_puts(r->out, ")");
        return KVR_OK;
    }
    if (ch == '[')
        return parse_class(r);
    if (ch == '.') {
        r->i++;
        struct cls c = {.n = 0};
        cls_add(&c, '\n', '\n');
        cls_complement(&c, 0, 0x10FFFF);
        return cls_emit(r, &c);
    }
    if (ch == '^' || ch == '$') {
        r->why = "an anchor that is not at the pattern's start or end";
        return KVR_ENOTSUP;
    }
    if (ch == '\\') {
        if (r->i + 1 >= r->n) {
            r->why = "a trailing backslash";
            return KVR_ENOTSUP;
        }
        char e = r->s[r->i + 1];
        r->i += 2;
        struct cls c = {.n = 0};
        if (shorthand(e, &c))
            return cls_emit(r, &c);
        if (e >= '1' && e <= '9') {
            r->why = "a backreference";
            return KVR_ENOTSUP;
        }
        if (e == 'b' || e == 'B') {
            r->why = "a word boundary";
            return KVR_ENOTSUP;
        }
        uint32_t cp = escaped(r, e);
        if (cp == UINT32_MAX)
            return KVR_ENOTSUP;
        literal_cp(r, cp);
        return KVR_OK;
    }
    if (strchr("*+?{", ch)) {
        r->why = "a quantifier with nothing to repeat";
        return KVR_ENOTSUP;
    }
    uint32_t cp;
    if (next_cp(r, &cp))
        return KVR_ENOTSUP;
    literal_cp(r, cp);
    return KVR_OK;
}

static int read_num(struct rx *r, uint32_t *v)
{
    size_t start = r->i;
    *v = 0;
    while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') {
        *v = *v * 10 + (uint32_t)(r->s[r->i++] - '0');
        if (*v > 1000) {
            r->why = "a repetition count above 1000";
            return KVR_ENOTSUP;
        }
    }
    if (r->i == start) {
        r->why = "a malformed {m,n}";
        return KVR_ENOTSUP;
    }
    return KVR_OK;
}

static int parse_quant(struct rx *r)
{
    if (r->i >= r->n)
        return KVR_OK;
    char ch = r->s[r->i];
    if (ch == '*' || ch == '+' || ch == '?') {
        r->i++;
        kvr_sbuf_printf(r->out, "%c", ch);
    } else if (ch == '{') {
        r->i++;
        uint32_t m, n;
        if (read_num(r, &m))
            return KVR_ENOTSUP;
        bool open = false;
        n = m;
        if (r->i < r->n && r->s[r->i] == ',') {
            r->i++;
            open = r->i < r->n && r->s[r->i] == '}';
            if (!open && read_num(r, &n))
                return KVR_ENOTSUP;
        }
        if (r->i >= r->n || r->s[r->i] != '}' || (!open && n < m)) {
            r->why = "a malformed {m,n}";
            return KVR_ENOTSUP;
        }
        r->i++;
        if (open)
            kvr_sbuf_printf(r->out, "{%u,}", m);
        else
            kvr_sbuf_printf(r->out, "{%u,%u}", m, n);
    } else {
        return KVR_OK;
    }
    if (r->i < r->n && r->s[r->i] == '?') /* lazy: the same language */
        r->i++;
    if (r->i < r->n && strchr("*+?{", r->s[r->i])) {
        r->why = "a quantifier on a quantifier";
        return KVR_ENOTSUP;
    }
    return KVR_OK;
}

static bool at_end_anchor(const struct rx *r)
{
    return r->i + 1 == r->n && r->s[r->i] == '$';
}

static int parse_seq(struct rx *r)
{
    kvr_sbuf_puts(r->out, "\"\"");
    while (r->i < r->n && r->s[r->i] != '|' && r->s[r->i] != ')' && !at_end_anchor(r)) {
        kvr_sbuf_puts(r->out, " ");
        /* the quantifier applies to the atom: wrap it so it binds to all of it */
        kvr_sbuf_puts(r->out, "(");
        int rc = parse_atom(r);
        if (rc)
            return rc;
        kvr_sbuf_puts(r->out, ")");
        if ((rc = parse_quant(r)))
            return rc;
    }
    return KVR_OK;
}

static int parse_alt(struct rx *r)
{
    int rc = parse_seq(r);
    while (!rc && r->i < r->n && r->s[r->i] == '|') {
        r->i++;
        kvr_sbuf_puts(r->out, " | ");
        rc = parse_seq(r);
    }
    return rc;
}

int kvr_gbnf_pattern(struct kvr_sbuf *out, const char *pattern, const char **why)
{
    struct rx r = {.s = pattern, .n = strlen(pattern), .out = out};
    if (r.n > 4096) {
        *why = "a pattern longer than 4096 bytes";
        return KVR_ENOTSUP;
    }
    bool start = r.n && pattern[0] == '^';
    r.i = start;
    const char *any = "[^\"\\\\\\x00-\\x1f]*";
    kvr_sbuf_puts(out, "\"\\\"\" ");
    if (!start)
        kvr_sbuf_printf(out, "%s ", any);
    kvr_sbuf_puts(out, "(");
    int rc = parse_alt(&r);
    if (!rc && r.i < r.n && !at_end_anchor(&r)) {
        r.why = r.s[r.i] == ')' ? "an unmatched )" : "an unexpected character";
        rc = KVR_ENOTSUP;
    }
    if (rc) {
        *why = r.why;
        return rc;
    }
    kvr_sbuf_puts(out, ")");
    if (!at_end_anchor(&r))
        kvr_sbuf_printf(out, " %s", any);
    kvr_sbuf_puts(out, " \"\\\"\"");
    return KVR_OK;
}
