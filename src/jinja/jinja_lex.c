/* jinja_lex.c - the Jinja lexer: template text to tokens (see jinja_int.h).
 *
 * Text between tags becomes T_TEXT with the whitespace rules already applied, the way
 * Hugging Face configures jinja2:
 *   "{%-", "{{-", "{#-"   strip all whitespace before the tag;
 *   "-%}", "-}}", "-#}"   strip all whitespace after it;
 *   trim_blocks           "%}" and "#}" eat one newline right after them ("+%}" keeps it);
 *   lstrip_blocks         spaces and tabs from the start of a line up to "{%" or "{#"
 *                         are removed ("{%+" keeps them); "{{" is not affected.
 * Inside a tag the expression is cut into names, numbers, strings and operators; an end
 * tag inside open brackets is not an end ("{{ {'a': {'b': 1}} }}"). Comments vanish and
 * {% raw %}...{% endraw %} becomes text. */
#include "jinja/jinja_int.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct lexer {
    struct jarena *ar;
    const struct kvr_jinja_limits *lim;
    const char *s;
    size_t len, pos;
    uint32_t line;
    struct jtoken *toks;
    uint32_t n, cap;
};

_Noreturn static void lfail(struct lexer *L, const char *msg)
{
    jfail_at(L->ar->fail, KVR_EFORMAT, L->line, "%s", msg);
}

static struct jtoken *push(struct lexer *L, enum jtok kind)
{
    if (L->n == L->cap) {
        if (L->cap >= L->lim->max_nodes)
            jfail_at(L->ar->fail, KVR_ERANGE, L->line, "more than %u tokens",
                     (unsigned)L->lim->max_nodes);
        uint32_t cap = L->cap ? L->cap * 2 : 256;
        if (cap > L->lim->max_nodes)
            cap = L->lim->max_nodes;
        struct jtoken *nt = ja_alloc_array(L->ar, cap, sizeof *nt);
        if (L->n)
            memcpy(nt, L->toks, L->n * sizeof *nt);
        L->toks = nt;
        L->cap = cap;
    }
    struct jtoken *t = &L->toks[L->n++];
    memset(t, 0, sizeof *t);
    t->kind = (uint8_t)kind;
    t->line = L->line;
    return t;
}

static void advance(struct lexer *L, size_t n)
{
    for (size_t i = 0; i < n && L->pos < L->len; i++)
        if (L->s[L->pos++] == '\n')
            L->line++;
}

/* Length of the Unicode whitespace character at i, or 0. */
static size_t space_at(const char *s, size_t len, size_t i)
{
    uint32_t cp;
    size_t n = ju_decode(s, len, i, &cp);
    return ju_isspace(cp) ? n : 0;
}

static void skip_space(struct lexer *L)
{
    size_t n;
    while (L->pos < L->len && (n = space_at(L->s, L->len, L->pos)))
        advance(L, n);
}

/* Length of text[0..len) with trailing Unicode whitespace removed. */
static size_t rstrip_len(const char *s, size_t len)
{
    size_t end = len;
    while (end > 0) {
        size_t start = end - 1;
        while (start > 0 && ((unsigned char)s[start] & 0xc0) == 0x80 && end - start < 4)
            start--;
        if (space_at(s, end, start) != end - start)
            break;
        end = start;
    }
    return end;
}

static void emit_text(struct lexer *L, size_t start, size_t len, uint32_t line)
{
    if (!len)
        return;
    struct jtoken *t = push(L, T_TEXT);
    t->line = line;
    t->s = jstr_new(L->ar, L->s + start, len);
}

/* Apply the stripping a tag at `tag` asks of the text [start, tag) before it, emit it. */
static void text_before_tag(struct lexer *L, size_t start, size_t tag, uint32_t line,
                            bool lstrippable)
{
    size_t len = tag - start;
    char ws = tag + 2 < L->len ? L->s[tag + 2] : 0;
    if (ws == '-') {
        len = rstrip_len(L->s + start, len);
    } else if (ws != '+' && lstrippable) {
        size_t nl = len;
        while (nl > 0 && L->s[start + nl - 1] != '\n')
            nl--;
        bool line_start = nl > 0 || start == 0 || L->s[start - 1] == '\n';
        bool blank = true;
        for (size_t i = start + nl; i < tag; i++)
            if (L->s[i] != ' ' && L->s[i] != '\t')
                blank = false;
        if (line_start && blank)
            len = nl;
    }
    emit_text(L, start, len, line);
}

static bool starts(const struct lexer *L, size_t at, const char *w)
{
    size_t n = strlen(w);
    return at + n <= L->len && !memcmp(L->s + at, w, n);
}

/* After an end tag: "-" strips whitespace, trim_blocks eats one newline. */
static void after_end_tag(struct lexer *L, char ws, bool trim)
{
    if (ws == '-')
        skip_space(L);
    else if (ws != '+' && trim && L->pos < L->len && L->s[L->pos] == '\n')
        advance(L, 1);
}

/* Is there "{%[-+]? raw [-+]?%}" at pos? Returns its length and the whitespace flag of
 * its end. `word` is "raw" or "endraw". */
static size_t raw_tag(const struct lexer *L, size_t pos, const char *word, char *end_ws)
{
    size_t i = pos + 2;
    if (!starts(L, pos, "{%"))
        return 0;
    if (i < L->len && (L->s[i] == '-' || L->s[i] == '+'))
        i++;
    while (i < L->len && (L->s[i] == ' ' || L->s[i] == '\t' || L->s[i] == '\n'))
        i++;
    if (!starts(L, i, word))
        return 0;
    i += strlen(word);
    if (i < L->len && (L->s[i] == '_' || ((L->s[i] | 32) >= 'a' && (L->s[i] | 32) <= 'z') ||
                       (L->s[i] >= '0' && L->s[i] <= '9')))
        return 0;
    while (i < L->len && (L->s[i] == ' ' || L->s[i] == '\t' || L->s[i] == '\n'))
        i++;
    *end_ws = 0;
    if (i < L->len && (L->s[i] == '-' || L->s[i] == '+'))
        *end_ws = L->s[i++];
    if (!starts(L, i, "%}"))
        return 0;
    return i + 2 - pos;
}

static void lex_string(struct lexer *L)
{
    char q = L->s[L->pos];
    uint32_t line = L->line;
    size_t i = L->pos + 1;
    struct jbuf_tmp {
        char *p;
        size_t n;
    } out = {ja_alloc(L->ar, L->len - L->pos + 1), 0};
    for (;;) {
        if (i >= L->len)
            lfail(L, "unterminated string");
        char ch = L->s[i];
        if (ch == q)
            break;
        if (ch != '\\') {
            out.p[out.n++] = ch;
            i++;
            continue;
        }
        if (i + 1 >= L->len)
            lfail(L, "unterminated string");
        char e = L->s[i + 1];
        i += 2;
        int hex = 0;
        switch (e) {
        case 'n':
            out.p[out.n++] = '\n';
            break;
        case 't':
            out.p[out.n++] = '\t';
            break;
        case 'r':
            out.p[out.n++] = '\r';
            break;
        case 'a':
            out.p[out.n++] = '\a';
            break;
        case 'b':
            out.p[out.n++] = '\b';
            break;
        case 'f':
            out.p[out.n++] = '\f';
            break;
        case 'v':
            out.p[out.n++] = '\v';
            break;
        case '\\':
            out.p[out.n++] = '\\';
            break;
        case '\'':
            out.p[out.n++] = '\'';
            break;
        case '"':
            out.p[out.n++] = '"';
            break;
        case '\n':
            break;
        case 'x':
            hex = 2;
            break;
        case 'u':
            hex = 4;
            break;
        case 'U':
            hex = 8;
            break;
        default:
            if (e >= '0' && e <= '7') {
                uint32_t v = (uint32_t)(e - '0');
                for (int k = 0; k < 2 && i < L->len && L->s[i] >= '0' && L->s[i] <= '7'; k++)
                    v = v * 8 + (uint32_t)(L->s[i++] - '0');
                out.n += kvr_utf8_encode(v, out.p + out.n);
            } else {
                out.p[out.n++] = '\\';
                out.p[out.n++] = e;
            }
        }
        if (hex) {
            uint32_t v = 0;
            for (int k = 0; k < hex; k++, i++) {
                char h = i < L->len ? L->s[i] : 0;
                int d = h >= '0' && h <= '9'                 ? h - '0'
                        : (h | 32) >= 'a' && (h | 32) <= 'f' ? (h | 32) - 'a' + 10
                                                             : -1;
                if (d < 0)
                    lfail(L, "truncated \\x, \\u or \\U escape in a string");
                v = v * 16 + (uint32_t)d;
            }
            if (v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff))
                lfail(L, "escape is not a Unicode scalar value");
            out.n += kvr_utf8_encode(v, out.p + out.n);
        }
    }
    struct jtoken *t = push(L, T_STR);
    t->line = line;
    t->s = jstr_new(L->ar, out.p, out.n);
    advance(L, i + 1 - L->pos);
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}
static bool is_name0(char c)
{
    return c == '_' || ((c | 32) >= 'a' && (c | 32) <= 'z');
}

static void lex_number(struct lexer *L)
{
    char buf[128];
    size_t n = 0, i = L->pos;
    bool is_float = false;
    while (i < L->len &&
           (is_digit(L->s[i]) || (L->s[i] == '_' && i + 1 < L->len && is_digit(L->s[i + 1])))) {
        if (L->s[i] != '_' && n < sizeof buf - 1)
            buf[n++] = L->s[i];
        i++;
    }
    bool after_dot = L->pos > 0 && L->s[L->pos - 1] == '.';
    if (!after_dot && i + 1 < L->len && L->s[i] == '.' && is_digit(L->s[i + 1])) {
        is_float = true;
        if (n < sizeof buf - 1)
            buf[n++] = L->s[i];
        i++;
        while (i < L->len && (is_digit(L->s[i]) || L->s[i] == '_'))
            if (L->s[i++] != '_' && n < sizeof buf - 1)
                buf[n++] = L->s[i - 1];
    }
    if (!after_dot && i < L->len && (L->s[i] | 32) == 'e') {
        size_t j = i + 1;
        if (j < L->len && (L->s[j] == '+' || L->s[j] == '-'))
            j++;
        if (j < L->len && is_digit(L->s[j])) {
            is_float = true;
            while (i < j && n < sizeof buf - 1)
                buf[n++] = L->s[i++];
            while (i < L->len && (is_digit(L->s[i]) || L->s[i] == '_'))
                if (L->s[i++] != '_' && n < sizeof buf - 1)
                    buf[n++] = L->s[i - 1];
        }
    }
    buf[n] = 0;
    if (n >= sizeof buf - 1)
        lfail(L, "number literal too long");
    int base = 10;
    if (!is_float && buf[0] == '0') {
        /* As in Python 3: 0x1f, 0o17, 0b101; otherwise a decimal integer has no leading
         * zero, so "010" lexes as 0 followed by 10 (a syntax error later). */
        char p = i < L->len ? (char)(L->s[i] | 32) : 0;
        base = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 10;
        n = 0;
        if (base != 10) {
            for (i++; i < L->len && (L->s[i] == '_' || isxdigit((unsigned char)L->s[i])); i++) {
                if (L->s[i] == '_')
                    continue;
                char d = L->s[i];
                int v = d <= '9' ? d - '0' : (d | 32) - 'a' + 10;
                if (v >= base)
                    break;
                if (n < sizeof buf - 1)
                    buf[n++] = d;
            }
            if (!n)
                lfail(L, "invalid number literal");
        } else {
            for (i = L->pos; i < L->len && (L->s[i] == '0' || (L->s[i] == '_' && i + 1 < L->len &&
                                                               L->s[i + 1] == '0'));
                 i++)
                ;
            buf[n++] = '0';
        }
        buf[n] = 0;
    }
    struct jtoken *t = push(L, is_float ? T_FLOAT : T_INT);
    if (is_float) {
        t->f = strtod(buf, NULL);
    } else {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(buf, &end, base);
        if (errno || v > INT64_MAX)
            lfail(L, "integer literal too large");
        t->i = (int64_t)v;
    }
    advance(L, i - L->pos);
}

static const struct {
    const char *text;
    enum jop op;
} ops[] = {
    {"//", OP_FLOORDIV}, {"**", OP_POW},   {"==", OP_EQ},      {"!=", OP_NE},      {"<=", OP_LE},
    {">=", OP_GE},       {"+", OP_ADD},    {"-", OP_SUB},      {"*", OP_MUL},      {"/", OP_DIV},
    {"%", OP_MOD},       {"~", OP_TILDE},  {"<", OP_LT},       {">", OP_GT},       {"=", OP_ASSIGN},
    {"(", OP_LPAREN},    {")", OP_RPAREN}, {"[", OP_LBRACKET}, {"]", OP_RBRACKET}, {"{", OP_LBRACE},
    {"}", OP_RBRACE},    {",", OP_COMMA},  {".", OP_DOT},      {":", OP_COLON},    {"|", OP_PIPE},
};

/* The inside of a {% %} or {{ }} tag, up to and including its end. */
static void lex_tag(struct lexer *L, bool block)
{
    uint32_t depth = 0;
    for (;;) {
        skip_space(L);
        if (L->pos >= L->len)
            lfail(L, block ? "unexpected end of template, expected '%}'"
                           : "unexpected end of template, expected '}}'");
        const char *end = block ? "%}" : "}}";
        char ws = L->s[L->pos];
        if (depth == 0 && (ws == '-' || (block && ws == '+')) && starts(L, L->pos + 1, end)) {
            push(L, block ? T_BLOCK_END : T_VAR_END);
            advance(L, 3);
            after_end_tag(L, ws, block);
            return;
        }
        if (depth == 0 && starts(L, L->pos, end)) {
            push(L, block ? T_BLOCK_END : T_VAR_END);
            advance(L, 2);
            after_end_tag(L, 0, block);
            return;
        }
        char ch = L->s[L->pos];
        if (ch == '\'' || ch == '"') {
            lex_string(L);
        } else if (is_digit(ch)) {
            lex_number(L);
        } else if (is_name0(ch)) {
            size_t i = L->pos;
            while (i < L->len && (is_name0(L->s[i]) || is_digit(L->s[i])))
                i++;
            struct jtoken *t = push(L, T_NAME);
            t->s = jstr_new(L->ar, L->s + L->pos, i - L->pos);
            advance(L, i - L->pos);
        } else {
            size_t k;
            for (k = 0; k < sizeof ops / sizeof *ops; k++)
                if (starts(L, L->pos, ops[k].text))
                    break;
            if (k == sizeof ops / sizeof *ops)
                lfail(L, "unexpected character in expression");
            enum jop op = ops[k].op;
            if (op == OP_LPAREN || op == OP_LBRACKET || op == OP_LBRACE) {
                depth++;
            } else if (op == OP_RPAREN || op == OP_RBRACKET || op == OP_RBRACE) {
                if (!depth)
                    lfail(L, "unbalanced closing bracket");
                depth--;
            }
            struct jtoken *t = push(L, T_OP);
            t->op = (uint8_t)op;
            advance(L, strlen(ops[k].text));
        }
    }
}

uint32_t jlex(struct jarena *a, const struct kvr_jinja_limits *lim, const char *src, size_t len,
              struct jtoken **out)
{
    struct lexer L = {.ar = a, .lim = lim, .s = src, .len = len, .line = 1};
    while (L.pos < L.len) {
        size_t start = L.pos;
        uint32_t line = L.line;
        size_t tag = start;
        while (tag + 1 < L.len &&
               !(L.s[tag] == '{' &&
                 (L.s[tag + 1] == '{' || L.s[tag + 1] == '%' || L.s[tag + 1] == '#')))
            tag++;
        if (tag + 1 >= L.len) {
            emit_text(&L, start, L.len - start, line);
            advance(&L, L.len - start);
            break;
        }
        char kind = L.s[tag + 1];
        text_before_tag(&L, start, tag, line, kind != '{');
        advance(&L, tag - start);
        char end_ws;
        size_t raw = kind == '%' ? raw_tag(&L, tag, "raw", &end_ws) : 0;
        if (raw) {
            advance(&L, raw);
            if (end_ws == '-')
                skip_space(&L);
            size_t body = L.pos, stop = body;
            size_t end_len = 0;
            uint32_t body_line = L.line;
            for (; stop + 1 < L.len; stop++)
                if ((end_len = raw_tag(&L, stop, "endraw", &end_ws)))
                    break;
            if (!end_len)
                lfail(&L, "missing {% endraw %}");
            size_t n = stop - body;
            if (L.s[stop + 2] == '-')
                n = rstrip_len(L.s + body, n);
            emit_text(&L, body, n, body_line);
            advance(&L, stop + end_len - L.pos);
            after_end_tag(&L, end_ws, true);
            continue;
        }
        if (kind == '#') {
            size_t i = tag + 2;
            while (i + 1 < L.len && !(L.s[i] == '#' && L.s[i + 1] == '}'))
                i++;
            if (i + 1 >= L.len)
                lfail(&L, "missing end of comment tag");
            char ws = i > tag + 2 && (L.s[i - 1] == '-' || L.s[i - 1] == '+') ? L.s[i - 1] : 0;
            advance(&L, i + 2 - L.pos);
            after_end_tag(&L, ws, true);
            continue;
        }
        push(&L, kind == '%' ? T_BLOCK_BEGIN : T_VAR_BEGIN);
        advance(&L, 2);
        if (L.pos < L.len && (L.s[L.pos] == '-' || (kind == '%' && L.s[L.pos] == '+')))
            advance(&L, 1);
        lex_tag(&L, kind == '%');
    }
    push(&L, T_EOF);
    *out = L.toks;
    return L.n;
}
