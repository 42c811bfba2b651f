/* grammar_parse.c - GBNF text to the compiled form of grammar_int.h (see grammar.h for the
 * syntax). Reading order: the parser's state and errors, elements and classes, items,
 * sequences and rules, then the checks (every rule defined, no left recursion) and the
 * layout into one element array.
 *
 * Repetitions are expanded into generated rules, so the matcher only knows sequences,
 * alternatives and references:
 *     x*      R ::= x R |            (the last item replaces the frame: no stack growth)
 *     x+      x R                    with R as for x*
 *     x?      R ::= x |
 *     x{m,n}  x .. x (m times), then n - m nested optionals R1 ::= x | ;  Rk ::= x R(k-1) |
 * Errors longjmp to kvr_grammar_compile, which frees what the parser holds. */
#include "model/grammar_int.h"

#include "core/alloc.h"
#include "core/utf8.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

struct prule {
    const char *name; /* into the text; NULL for a generated rule */
    uint32_t name_len;
    uint32_t parent; /* a generated rule: the rule whose text made it */
    bool defined;
    size_t ref_pos; /* where it was first named, for "undefined" errors */
    struct gel *el;
    uint32_t n_el, cap_el;
};

struct parser {
    const char *s;
    size_t n, i;
    struct kvr_err *err;
    int rc;
    jmp_buf fail;
    struct prule *rules;
    uint32_t n_rules, cap_rules;
    struct gclass *cls;
    uint32_t n_class, cap_class;
    uint32_t *lo, *hi;
    uint32_t n_range, cap_range;
    size_t total_el;
    uint32_t depth;
    struct gel *tmp; /* an item being repeated (freed on failure too) */
};

/* ---- errors and growth ------------------------------------------------------------------ */

static void where(const struct parser *p, size_t pos, uint32_t *line, uint32_t *col)
{
    *line = 1;
    *col = 1;
    for (size_t k = 0; k < pos && k < p->n; k++) {
        if (p->s[k] == '\n') {
            (*line)++;
            *col = 1;
        } else {
            (*col)++;
        }
    }
}

__attribute__((format(printf, 4, 5), noreturn)) static void
fail_at(struct parser *p, int code, size_t pos, const char *fmt, ...)
{
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    uint32_t line, col;
    where(p, pos, &line, &col);
    p->rc = kvr_err_set(p->err, code, "grammar: line %u col %u: %s", line, col, msg);
    longjmp(p->fail, 1);
}

__attribute__((noreturn)) static void nomem(struct parser *p)
{
    p->rc = kvr_err_set(p->err, KVR_ENOMEM, "grammar: out of memory");
    longjmp(p->fail, 1);
}

/* Make room for one more of `*n` items of `size` bytes in *arr of capacity *cap. */
static void grow(struct parser *p, void **arr, uint32_t n, uint32_t *cap, size_t size)
{
    if (n < *cap)
        return;
    uint32_t c = *cap ? *cap * 2 : 16;
    void *q = kvr_realloc(*arr, (size_t)c * size);
    if (!q)
        nomem(p);
    *arr = q;
    *cap = c;
}

/* ---- elements and classes ---------------------------------------------------------------- */

static void push_el(struct parser *p, uint32_t r, uint32_t type, uint32_t value)
{
    if (++p->total_el > KVR_GRAMMAR_MAX_ELEMENTS)
        fail_at(p, KVR_ERANGE, p->i, "more than %u elements (repetitions expanded)",
                KVR_GRAMMAR_MAX_ELEMENTS);
    struct prule *q = &p->rules[r];
    grow(p, (void **)&q->el, q->n_el, &q->cap_el, sizeof *q->el);
    q->el[q->n_el++] = (struct gel){type, value};
}

static uint32_t new_rule(struct parser *p, const char *name, uint32_t len, uint32_t parent)
{
    if (p->n_rules >= KVR_GRAMMAR_MAX_RULES)
        fail_at(p, KVR_ERANGE, p->i, "more than %u rules (groups and repetitions count)",
                KVR_GRAMMAR_MAX_RULES);
    grow(p, (void **)&p->rules, p->n_rules, &p->cap_rules, sizeof *p->rules);
    p->rules[p->n_rules] = (struct prule){.name = name, .name_len = len, .parent = parent};
    return p->n_rules++;
}

static uint32_t rule_named(struct parser *p, const char *name, uint32_t len, size_t pos)
{
    for (uint32_t r = 0; r < p->n_rules; r++)
        if (p->rules[r].name && p->rules[r].name_len == len && !memcmp(p->rules[r].name, name, len))
            return r;
    uint32_t r = new_rule(p, name, len, 0);
    p->rules[r].parent = r;
    p->rules[r].ref_pos = pos;
    return r;
}

static void class_add_range(struct parser *p, uint32_t lo, uint32_t hi)
{
    if (lo > hi)
        fail_at(p, KVR_EFORMAT, p->i, "range U+%04X-U+%04X is backwards", lo, hi);
    if (p->n_range == p->cap_range) { /* lo and hi grow together */
        uint32_t c = p->cap_range ? p->cap_range * 2 : 64;
        uint32_t *l = kvr_realloc(p->lo, (size_t)c * sizeof *l);
        if (l)
            p->lo = l;
        uint32_t *h = l ? kvr_realloc(p->hi, (size_t)c * sizeof *h) : NULL;
        if (!h)
            nomem(p);
        p->hi = h;
        p->cap_range = c;
    }
    p->lo[p->n_range] = lo;
    p->hi[p->n_range] = hi;
    p->n_range++;
    p->cls[p->n_class - 1].n++;
}

static uint32_t class_begin(struct parser *p, bool negated)
{
    grow(p, (void **)&p->cls, p->n_class, &p->cap_class, sizeof *p->cls);
    p->cls[p->n_class] = (struct gclass){.first = p->n_range, .negated = negated};
    return p->n_class++;
}

/* Fill the ASCII bitmap from the ranges, negation applied. */
static void class_end(struct parser *p, uint32_t c)
{
    struct gclass *k = &p->cls[c];
    for (uint32_t cp = 0; cp < 128; cp++) {
        bool in = false;
        for (uint32_t i = k->first; i < k->first + k->n && !in; i++)
            in = cp >= p->lo[i] && cp <= p->hi[i];
        if (in != k->negated)
            k->ascii[cp >> 6] |= 1ull << (cp & 63);
    }
}

static uint32_t class_single(struct parser *p, uint32_t cp)
{
    uint32_t c = class_begin(p, false);
    class_add_range(p, cp, cp);
    class_end(p, c);
    return c;
}

/* ---- characters ----------------------------------------------------------------------------- */

static bool eof(const struct parser *p)
{
    return p->i >= p->n;
}

static void skip_space(struct parser *p)
{
    while (!eof(p)) {
        char c = p->s[p->i];
        if (c == '#') {
            while (!eof(p) && p->s[p->i] != '\n')
                p->i++;
        } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            p->i++;
        } else {
            break;
        }
    }
}

static uint32_t hex_digits(struct parser *p, int n)
{
    uint32_t v = 0;
    for (int k = 0; k < n; k++, p->i++) {
        char c = eof(p) ? 0 : p->s[p->i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0)
            fail_at(p, KVR_EFORMAT, p->i, "expected %d hex digits", n);
        v = v * 16 + (uint32_t)d;
    }
    if (v > 0x10FFFF)
        fail_at(p, KVR_EFORMAT, p->i, "code point U+%X is beyond U+10FFFF", v);
    return v;
}

/* One character of a literal or class: UTF-8 or an escape. */
static uint32_t read_char(struct parser *p)
{
    if (eof(p))
        fail_at(p, KVR_EFORMAT, p->i, "unexpected end of grammar");
    if (p->s[p->i] == '\\') {
        p->i++;
        char c = eof(p) ? 0 : p->s[p->i++];
        switch (c) {
        case 'n':
            return '\n';
        case 'r':
            return '\r';
        case 't':
            return '\t';
        case 'x':
            return hex_digits(p, 2);
        case 'u':
            return hex_digits(p, 4);
        case 'U':
            return hex_digits(p, 8);
        case '\\':
        case '"':
        case '\'':
        case '[':
        case ']':
        case '-':
        case '^':
        case '/':
            return (uint32_t)c;
        default:
            fail_at(p, KVR_EFORMAT, p->i - 1, "unknown escape \\%c", c ? c : '0');
        }
    }
    uint32_t cp;
    size_t k = kvr_utf8_decode(p->s + p->i, p->n - p->i, &cp, KVR_UTF8_STRICT);
    if (!k)
        fail_at(p, KVR_EFORMAT, p->i, "invalid UTF-8");
    p->i += k;
    return cp;
}

static bool name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
}

static uint32_t name_len_at(const struct parser *p, size_t i)
{
    size_t k = i;
    while (k < p->n && name_char(p->s[k]))
        k++;
    return (uint32_t)(k - i);
}

/* Whether a rule definition `name ::=` starts at the cursor (which ends the one before). */
static bool at_definition(const struct parser *p)
{
    uint32_t len = name_len_at(p, p->i);
    if (!len)
        return false;
    size_t k = p->i + len;
    while (k < p->n && (p->s[k] == ' ' || p->s[k] == '\t'))
        k++;
    return k + 3 <= p->n && !memcmp(p->s + k, "::=", 3);
}

/* ---- items and repetition ------------------------------------------------------------------ */

static void parse_alternates(struct parser *p, uint32_t r);

static void parse_literal(struct parser *p, uint32_t r)
{
    p->i++; /* the opening quote */
    while (!eof(p) && p->s[p->i] != '"')
        push_el(p, r, GEL_CHAR, class_single(p, read_char(p)));
    if (eof(p))
        fail_at(p, KVR_EFORMAT, p->i, "unterminated literal");
    p->i++;
}

static void parse_class(struct parser *p, uint32_t r)
{
    size_t start = p->i++;
    bool neg = !eof(p) && p->s[p->i] == '^';
    if (neg)
        p->i++;
    uint32_t c = class_begin(p, neg);
    while (!eof(p) && p->s[p->i] != ']') {
        uint32_t lo = read_char(p), hi = lo;
        if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
            p->i++;
            hi = read_char(p);
        }
        class_add_range(p, lo, hi);
    }
    if (eof(p))
        fail_at(p, KVR_EFORMAT, start, "unterminated character class");
    p->i++;
    class_end(p, c);
    push_el(p, r, GEL_CHAR, c);
}

static uint32_t read_count(struct parser *p)
{
    size_t start = p->i;
    uint64_t v = 0;
    while (!eof(p) && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        v = v * 10 + (uint64_t)(p->s[p->i++] - '0');
        if (v > KVR_GRAMMAR_MAX_REPEAT)
            fail_at(p, KVR_ERANGE, start, "repetition count above %u", KVR_GRAMMAR_MAX_REPEAT);
    }
    if (p->i == start)
        fail_at(p, KVR_EFORMAT, p->i, "expected a number in {m,n}");
    return (uint32_t)v;
}

/* Append item (copy of `it`, n elements) to rule r. */
static void append_item(struct parser *p, uint32_t r, const struct gel *it, uint32_t n)
{
    for (uint32_t k = 0; k < n; k++)
        push_el(p, r, it[k].type, it[k].value);
}

/* R ::= item R | ;  the star of an item. */
static uint32_t star_rule(struct parser *p, uint32_t r, const struct gel *it, uint32_t n)
{
    uint32_t s = new_rule(p, NULL, 0, p->rules[r].parent);
    append_item(p, s, it, n);
    push_el(p, s, GEL_REF, s);
    push_el(p, s, GEL_ALT, 0);
    push_el(p, s, GEL_END, 0);
    p->rules[s].defined = true;
    return s;
}

/* Expand the item that starts at element `start` of rule r by {m, n} (n = UINT32_MAX:
 * unbounded). The sizes are checked before the item is copied out. */
static void repeat_item(struct parser *p, uint32_t r, uint32_t start, uint32_t m, uint32_t n)
{
    uint32_t len = p->rules[r].n_el - start;
    uint32_t n_opt = n == UINT32_MAX ? 1 : n - m;
    if (n != UINT32_MAX && n < m)
        fail_at(p, KVR_EFORMAT, p->i, "{%u,%u}: the maximum is below the minimum", m, n);
    uint64_t need = (uint64_t)len * ((uint64_t)m + n_opt) + 4ull * n_opt;
    if (p->total_el - len + need > KVR_GRAMMAR_MAX_ELEMENTS)
        fail_at(p, KVR_ERANGE, p->i, "more than %u elements (repetitions expanded)",
                KVR_GRAMMAR_MAX_ELEMENTS);
    if ((uint64_t)p->n_rules + n_opt > KVR_GRAMMAR_MAX_RULES)
        fail_at(p, KVR_ERANGE, p->i, "more than %u rules (groups and repetitions count)",
                KVR_GRAMMAR_MAX_RULES);
    struct gel *it = p->tmp = kvr_malloc((size_t)(len ? len : 1) * sizeof *it);
    if (!it)
        nomem(p);
    memcpy(it, p->rules[r].el + start, len * sizeof *it);
    p->total_el -= len;
    p->rules[r].n_el = start;
    for (uint32_t k = 0; k < m; k++)
        append_item(p, r, it, len);
    if (n == UINT32_MAX) {
        push_el(p, r, GEL_REF, star_rule(p, r, it, len));
    } else if (n > m) {
        uint32_t prev = UINT32_MAX;
        for (uint32_t k = 0; k < n - m; k++) {
            uint32_t o = new_rule(p, NULL, 0, p->rules[r].parent);
            append_item(p, o, it, len);
            if (prev != UINT32_MAX)
                push_el(p, o, GEL_REF, prev);
            push_el(p, o, GEL_ALT, 0);
            push_el(p, o, GEL_END, 0);
            p->rules[o].defined = true;
            prev = o;
        }
        push_el(p, r, GEL_REF, prev);
    }
    kvr_free(it);
    p->tmp = NULL;
}

static void parse_postfix(struct parser *p, uint32_t r, uint32_t start)
{
    if (eof(p))
        return;
    char c = p->s[p->i];
    if (c == '*' || c == '+' || c == '?') {
        p->i++;
        repeat_item(p, r, start, c == '+' ? 1 : 0, c == '?' ? 1 : UINT32_MAX);
    } else if (c == '{') {
        p->i++;
        skip_space(p);
        uint32_t m = read_count(p), n = m;
        skip_space(p);
        if (!eof(p) && p->s[p->i] == ',') {
            p->i++;
            skip_space(p);
            n = !eof(p) && p->s[p->i] == '}' ? UINT32_MAX : read_count(p);
            skip_space(p);
        }
        if (eof(p) || p->s[p->i] != '}')
            fail_at(p, KVR_EFORMAT, p->i, "expected } to close {m,n}");
        p->i++;
        repeat_item(p, r, start, m, n);
    }
}

static void parse_item(struct parser *p, uint32_t r)
{
    uint32_t start = p->rules[r].n_el;
    char c = p->s[p->i];
    if (c == '"') {
        parse_literal(p, r);
    } else if (c == '[') {
        parse_class(p, r);
    } else if (c == '.') {
        p->i++;
        uint32_t k = class_begin(p, true);
        class_end(p, k);
        push_el(p, r, GEL_CHAR, k);
    } else if (c == '(') {
        size_t open = p->i++;
        if (++p->depth > KVR_GRAMMAR_MAX_NESTING)
            fail_at(p, KVR_ERANGE, open, "groups nested deeper than %u", KVR_GRAMMAR_MAX_NESTING);
        uint32_t sub = new_rule(p, NULL, 0, p->rules[r].parent);
        parse_alternates(p, sub);
        push_el(p, sub, GEL_END, 0);
        p->rules[sub].defined = true;
        skip_space(p);
        if (eof(p) || p->s[p->i] != ')')
            fail_at(p, KVR_EFORMAT, open, "unclosed (");
        p->i++;
        p->depth--;
        push_el(p, r, GEL_REF, sub);
    } else if (name_char(c)) {
        uint32_t len = name_len_at(p, p->i);
        push_el(p, r, GEL_REF, rule_named(p, p->s + p->i, len, p->i));
        p->i += len;
    } else {
        fail_at(p, KVR_EFORMAT, p->i, "unexpected '%c'", c);
    }
    parse_postfix(p, r, start);
}

/* ---- sequences and rules ------------------------------------------------------------------- */

static void parse_sequence(struct parser *p, uint32_t r)
{
    for (;;) {
        skip_space(p);
        if (eof(p) || p->s[p->i] == '|' || p->s[p->i] == ')' || at_definition(p))
            return;
        parse_item(p, r);
    }
}

static void parse_alternates(struct parser *p, uint32_t r)
{
    parse_sequence(p, r);
    while (!eof(p) && p->s[p->i] == '|') {
        p->i++;
        push_el(p, r, GEL_ALT, 0);
        parse_sequence(p, r);
    }
}

static void parse_rule(struct parser *p)
{
    size_t pos = p->i;
    uint32_t len = name_len_at(p, p->i);
    if (!len)
        fail_at(p, KVR_EFORMAT, pos, "expected a rule name");
    if (!at_definition(p))
        fail_at(p, KVR_EFORMAT, pos + len, "expected ::= after the rule name");
    uint32_t r = rule_named(p, p->s + pos, len, pos);
    if (p->rules[r].defined)
        fail_at(p, KVR_EFORMAT, pos, "rule '%.*s' is defined twice", (int)len, p->s + pos);
    p->rules[r].defined = true;
    p->i = pos + len;
    while (p->s[p->i] != ':')
        p->i++;
    p->i += 3;
    parse_alternates(p, r);
    push_el(p, r, GEL_END, 0);
    if (!eof(p) && p->s[p->i] == ')')
        fail_at(p, KVR_EFORMAT, p->i, "unmatched )");
}

/* ---- checks and layout ---------------------------------------------------------------------- */

static void name_of(const struct parser *p, uint32_t r, const char **name, int *len)
{
    const struct prule *q = &p->rules[p->rules[r].parent];
    *name = q->name ? q->name : "?";
    *len = q->name ? (int)q->name_len : 1;
}

/* Left recursion: a rule that can reach itself through first positions (references
 * preceded only by rules that match the empty text) would expand forever. Nullable rules
 * by fixpoint, then the first-position graph is peeled (Kahn): what remains is a cycle. */
static void check_left_recursion(struct parser *p)
{
    uint32_t nr = p->n_rules;
    bool *nullable = kvr_calloc(nr, sizeof *nullable);
    uint32_t *indeg = kvr_calloc(nr, sizeof *indeg), *queue = kvr_calloc(nr, sizeof *queue);
    if (!nullable || !indeg || !queue) {
        kvr_free(nullable), kvr_free(indeg), kvr_free(queue);
        nomem(p);
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (uint32_t r = 0; r < nr; r++) {
            bool alt_null = true;
            for (uint32_t k = 0; k < p->rules[r].n_el && !nullable[r]; k++) {
                struct gel e = p->rules[r].el[k];
                if (e.type == GEL_ALT || e.type == GEL_END) {
                    if (alt_null)
                        nullable[r] = changed = true;
                    alt_null = true;
                } else if (e.type == GEL_CHAR || !nullable[e.value]) {
                    alt_null = false;
                }
            }
        }
    }
    /* first-position edges r -> s, walked twice: count in-degrees, then peel */
    for (int pass = 0; pass < 2; pass++) {
        uint32_t qh = 0, qt = 0;
        if (pass == 1)
            for (uint32_t r = 0; r < nr; r++)
                if (!indeg[r])
                    queue[qt++] = r;
        for (uint32_t r = 0; pass == 0 ? r < nr : qh < qt; r++) {
            uint32_t from = pass == 0 ? r : queue[qh++];
            bool first = true;
            for (uint32_t k = 0; k < p->rules[from].n_el; k++) {
                struct gel e = p->rules[from].el[k];
                if (e.type == GEL_ALT || e.type == GEL_END) {
                    first = true;
                } else if (e.type == GEL_CHAR) {
                    first = false;
                } else if (first) {
                    if (pass == 0)
                        indeg[e.value]++;
                    else if (--indeg[e.value] == 0)
                        queue[qt++] = e.value;
                    first = nullable[e.value];
                }
            }
        }
        if (pass == 1 && qt < nr) {
            uint32_t bad = 0;
            while (!indeg[bad])
                bad++;
            kvr_free(nullable), kvr_free(indeg), kvr_free(queue);
            const char *name;
            int len;
            name_of(p, bad, &name, &len);
            fail_at(p, KVR_EFORMAT, p->rules[p->rules[bad].parent].ref_pos,
                    "rule '%.*s' is left-recursive (reaches itself before any character)", len,
                    name);
        }
    }
    kvr_free(nullable), kvr_free(indeg), kvr_free(queue);
}

static int layout(struct parser *p, struct kvr_grammar *g)
{
    g->n_rules = p->n_rules;
    g->n_el = (uint32_t)p->total_el;
    uint32_t n_alt = 0;
    for (uint32_t r = 0; r < p->n_rules; r++)
        for (uint32_t k = 0; k < p->rules[r].n_el; k++)
            n_alt += p->rules[r].el[k].type == GEL_ALT || p->rules[r].el[k].type == GEL_END;
    g->el = kvr_calloc(g->n_el ? g->n_el : 1, sizeof *g->el);
    g->rule_start = kvr_calloc(g->n_rules, sizeof *g->rule_start);
    g->rule_alt = kvr_calloc(g->n_rules + 1, sizeof *g->rule_alt);
    g->alt_first = kvr_calloc(n_alt ? n_alt : 1, sizeof *g->alt_first);
    if (!g->el || !g->rule_start || !g->rule_alt || !g->alt_first)
        return KVR_ENOMEM;
    uint32_t at = 0, a = 0;
    for (uint32_t r = 0; r < p->n_rules; r++) {
        g->rule_start[r] = at;
        g->rule_alt[r] = a;
        g->alt_first[a++] = at;
        for (uint32_t k = 0; k < p->rules[r].n_el; k++) {
            g->el[at++] = p->rules[r].el[k];
            if (p->rules[r].el[k].type == GEL_ALT)
                g->alt_first[a++] = at;
        }
    }
    g->rule_alt[p->n_rules] = a;
    g->n_class = p->n_class;
    g->cls = p->cls;
    g->n_range = p->n_range;
    g->lo = p->lo;
    g->hi = p->hi;
    p->cls = NULL;
    p->lo = p->hi = NULL;
    return KVR_OK;
}

static void parser_fini(struct parser *p)
{
    for (uint32_t r = 0; r < p->n_rules; r++)
        kvr_free(p->rules[r].el);
    kvr_free(p->rules);
    kvr_free(p->cls);
    kvr_free(p->lo);
    kvr_free(p->hi);
    kvr_free(p->tmp);
}

static void parse_all(struct parser *p)
{
    skip_space(p);
    while (!eof(p)) {
        parse_rule(p);
        skip_space(p);
    }
    for (uint32_t r = 0; r < p->n_rules; r++)
        if (!p->rules[r].defined)
            fail_at(p, KVR_EFORMAT, p->rules[r].ref_pos, "rule '%.*s' is not defined",
                    (int)p->rules[r].name_len, p->rules[r].name);
    check_left_recursion(p);
}

int kvr_grammar_compile(struct kvr_grammar **out, const char *text, size_t len, struct kvr_err *err)
{
    *out = NULL;
    if (len > KVR_GRAMMAR_MAX_TEXT_BYTES)
        return kvr_err_set(err, KVR_ERANGE, "grammar: %zu bytes, more than %u", len,
                           KVR_GRAMMAR_MAX_TEXT_BYTES);
    struct parser p = {.s = text, .n = len, .err = err};
    if (setjmp(p.fail)) {
        parser_fini(&p);
        return p.rc;
    }
    parse_all(&p);
    uint32_t root = UINT32_MAX;
    for (uint32_t r = 0; r < p.n_rules && root == UINT32_MAX; r++)
        if (p.rules[r].name && p.rules[r].name_len == 4 && !memcmp(p.rules[r].name, "root", 4))
            root = r;
    if (root == UINT32_MAX)
        fail_at(&p, KVR_EFORMAT, len, "no rule named root");
    /* no failure longjmps past this point */
    struct kvr_grammar *g = kvr_calloc(1, sizeof *g);
    int rc = g ? layout(&p, g) : KVR_ENOMEM;
    parser_fini(&p);
    if (rc) {
        kvr_grammar_destroy(g);
        return kvr_err_set(err, rc, "grammar: out of memory");
    }
    g->root = root;
    *out = g;
    return KVR_OK;
}

void kvr_grammar_destroy(struct kvr_grammar *g)
{
    if (!g)
        return;
    kvr_free(g->el);
    kvr_free(g->rule_start);
    kvr_free(g->rule_alt);
    kvr_free(g->alt_first);
    kvr_free(g->cls);
    kvr_free(g->lo);
    kvr_free(g->hi);
    kvr_free(g);
}

uint32_t kvr_grammar_n_rules(const struct kvr_grammar *g)
{
    return g->n_rules;
}
