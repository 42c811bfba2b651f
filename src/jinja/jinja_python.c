/* jinja_python.c - Python built-ins that templates reach through jinja2 and that are more
 * than a line: printf-style formatting (str % args, and the format filter, which is
 * str % args too), round() with Python's rounding, and the methods of list.
 *
 * Formatting follows Python's "printf-style String Formatting": %[(key)][flags][width]
 * [.precision]type with flags - + space 0 #, types s r a d i u f F e E g G x X o c and %%.
 * A tuple supplies the values one per conversion; a dict supplies them by %(key); any other
 * value is the single value. Errors carry Python's messages. */
#include "jinja/jinja_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- str % args ---------------------------------------------------------------------------- */

struct spec {
    bool left, plus, space, zero, alt;
    int width, prec; /* -1: not given */
    char type;
};

/* Pad `body` (n bytes, cps code points) to the spec's width: spaces on the left, or on the
 * right with '-'; numbers padded with '0' put the zeros after a sign or 0x prefix. */
static void put_padded(struct jctx *c, struct jbuf *b, const struct spec *sp, const char *body,
                       size_t n, size_t cps, bool numeric)
{
    size_t pad = sp->width > 0 && (size_t)sp->width > cps ? (size_t)sp->width - cps : 0;
    if (sp->left || !pad) {
        jbuf_put(c, b, body, n);
        for (size_t i = 0; i < pad; i++)
            jbuf_putc(c, b, ' ');
        return;
    }
    if (numeric && sp->zero) {
        size_t lead = (n && strchr("+- ", body[0])) ? 1 : 0;
        if (n > lead + 1 && body[lead] == '0' && strchr("xXo", body[lead + 1]))
            lead += 2;
        jbuf_put(c, b, body, lead);
        for (size_t i = 0; i < pad; i++)
            jbuf_putc(c, b, '0');
        jbuf_put(c, b, body + lead, n - lead);
        return;
    }
    for (size_t i = 0; i < pad; i++)
        jbuf_putc(c, b, ' ');
    jbuf_put(c, b, body, n);
}

static void put_text(struct jctx *c, struct jbuf *b, const struct spec *sp, struct jval v)
{
    struct jbuf t = jbuf_new(c);
    if (sp->type == 's')
        jv_write_str(c, &t, v);
    else
        jv_write_repr(c, &t, v);
    size_t n = t.len, cps = ju_count(t.p ? t.p : "", t.len);
    if (sp->prec >= 0 && (size_t)sp->prec < cps) { /* precision: the first code points */
        size_t i = 0;
        for (int k = 0; k < sp->prec; k++) {
            uint32_t cp;
            i += ju_decode(t.p, t.len, i, &cp);
        }
        n = i;
        cps = (size_t)sp->prec;
    }
    put_padded(c, b, sp, t.p ? t.p : "", n, cps, false);
}

/* An integer conversion, built by hand: Python writes -ff and 0o17 where C writes two's
 * complement and 017. */
static size_t int_body(const struct spec *sp, long long x, char *body, size_t cap)
{
    unsigned long long mag = x < 0 ? 0ULL - (unsigned long long)x : (unsigned long long)x;
    char digits[32];
    char t = strchr("diu", sp->type) ? 'u' : sp->type;
    int nd = t == 'u'   ? snprintf(digits, sizeof digits, "%llu", mag)
             : t == 'x' ? snprintf(digits, sizeof digits, "%llx", mag)
             : t == 'X' ? snprintf(digits, sizeof digits, "%llX", mag)
                        : snprintf(digits, sizeof digits, "%llo", mag);
    const char *sign = x < 0 ? "-" : sp->plus ? "+" : sp->space ? " " : "";
    const char *prefix = !sp->alt || t == 'u' ? "" : t == 'x' ? "0x" : t == 'X' ? "0X" : "0o";
    size_t zeros = sp->prec > nd ? (size_t)(sp->prec - nd) : 0; /* precision: least digits */
    size_t ns = strlen(sign), np = strlen(prefix);
    if (ns + np + zeros + (size_t)nd >= cap) /* cannot happen: precision <= 400 < cap */
        return 0;
    memcpy(body, sign, ns);
    memcpy(body + ns, prefix, np);
    memset(body + ns + np, '0', zeros);
    memcpy(body + ns + np + zeros, digits, (size_t)nd + 1);
    return ns + np + zeros + (size_t)nd;
}

static void put_number(struct jctx *c, struct jbuf *b, const struct spec *sp, struct jval v,
                       uint32_t line)
{
    char body[1024]; /* %.400f of 1e308: 309 digits, a point and 400 more */
    bool int_only = sp->type == 'x' || sp->type == 'X' || sp->type == 'o';
    if (v.t != JT_INT && v.t != JT_BOOL && (v.t != JT_FLOAT || int_only))
        jerr(c, KVR_EFORMAT, line, "%%%c format: %s is required, not %s", sp->type,
             int_only ? "an integer" : "a real number", jv_type_name(v));
    size_t n;
    if (int_only || strchr("diu", sp->type)) {
        long long x;
        if (v.t == JT_FLOAT) {
            if (!isfinite(v.u.f) || fabs(v.u.f) >= 9.2e18)
                jerr(c, KVR_ERANGE, line, "%%%c format: number out of range", sp->type);
            x = (long long)v.u.f; /* Python's int(): toward zero */
        } else {
            x = v.t == JT_INT ? v.u.i : v.u.b;
        }
        n = int_body(sp, x, body, sizeof body);
    } else {
        double x = v.t == JT_FLOAT ? v.u.f : v.t == JT_INT ? (double)v.u.i : v.u.b;
        char fmt[24];
        snprintf(fmt, sizeof fmt, "%%%s%s%s.%d%c", sp->plus ? "+" : "", sp->space ? " " : "",
                 sp->alt ? "#" : "", sp->prec < 0 ? 6 : sp->prec, sp->type);
        /* fmt is built just above from the parsed flags and a float conversion. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
        snprintf(body, sizeof body, fmt, x);
#pragma GCC diagnostic pop
        n = strlen(body);
    }
    put_padded(c, b, sp, body, n, n, true);
}

static void put_char(struct jctx *c, struct jbuf *b, const struct spec *sp, struct jval v,
                     uint32_t line)
{
    char body[8];
    size_t n;
    if (v.t == JT_STR && ju_count(v.u.s->s, v.u.s->len) == 1) {
        n = v.u.s->len;
        memcpy(body, v.u.s->s, n);
    } else if (v.t == JT_INT && v.u.i >= 0 && v.u.i <= 0x10FFFF) {
        n = kvr_utf8_encode((uint32_t)v.u.i, body);
    } else {
        jerr(c, KVR_EFORMAT, line, "%%c requires int or char");
    }
    put_padded(c, b, sp, body, n, 1, false);
}

/* The spec at f[i] (after '%'), up to its type; returns the index after it. */
static size_t parse_spec(struct jctx *c, const struct jstr *f, size_t i, struct spec *sp,
                         uint32_t line)
{
    *sp = (struct spec){.width = -1, .prec = -1};
    for (; i < f->len && strchr("-+ 0#", f->s[i]) && f->s[i]; i++) {
        char ch = f->s[i];
        sp->left |= ch == '-', sp->plus |= ch == '+', sp->space |= ch == ' ';
        sp->zero |= ch == '0', sp->alt |= ch == '#';
    }
    for (int *num = &sp->width;; num = &sp->prec) {
        if (i < f->len && f->s[i] == '*')
            jerr(c, KVR_ENOTSUP, line, "'*' in a format is not supported");
        for (; i < f->len && f->s[i] >= '0' && f->s[i] <= '9'; i++) {
            *num = (*num < 0 ? 0 : *num) * 10 + (f->s[i] - '0');
            if (*num > 400)
                jerr(c, KVR_ERANGE, line, "format width or precision too large");
        }
        if (num == &sp->prec || i >= f->len || f->s[i] != '.')
            break;
        i++;
        sp->prec = 0;
    }
    while (i < f->len && (f->s[i] == 'l' || f->s[i] == 'h' || f->s[i] == 'L'))
        i++; /* length modifiers: accepted and ignored, as Python does */
    if (i >= f->len)
        jerr(c, KVR_EFORMAT, line, "incomplete format");
    sp->type = f->s[i]; /* checked once the value is taken, as Python does */
    return i + 1;
}

/* The value of the conversion at f[*i]: by %(key) from a dict (*i moves past the key),
 * else the next of the tuple (*i stays). */
static struct jval next_value(struct jctx *c, const struct jstr *f, size_t *i, struct jval args,
                              uint32_t *used, uint32_t line)
{
    if (*i < f->len && f->s[*i] == '(') {
        size_t st = ++*i, depth = 1;
        for (; *i < f->len && depth; ++*i)
            depth += f->s[*i] == '(' ? 1 : f->s[*i] == ')' ? -1 : 0;
        if (depth)
            jerr(c, KVR_EFORMAT, line, "incomplete format key");
        if (args.t != JT_DICT)
            jerr(c, KVR_EFORMAT, line, "format requires a mapping");
        int64_t k = jdict_find_str(c, args.u.d, f->s + st, *i - 1 - st);
        if (k < 0)
            jerr(c, KVR_EFORMAT, line, "KeyError: '%.*s'", (int)(*i - 1 - st), f->s + st);
        return args.u.d->v[k];
    }
    bool tuple = args.t == JT_LIST && args.u.l->tuple;
    uint32_t n = tuple ? args.u.l->n : 1;
    if (*used >= n)
        jerr(c, KVR_EFORMAT, line, "not enough arguments for format string");
    return tuple ? args.u.l->v[(*used)++] : ((*used)++, args);
}

struct jval jpy_percent(struct jctx *c, const struct jstr *f, struct jval args, uint32_t line)
{
    struct jbuf b = jbuf_new(c);
    uint32_t used = 0;
    bool by_key = false;
    for (size_t i = 0; i < f->len;) {
        const char *pct = memchr(f->s + i, '%', f->len - i);
        size_t end = pct ? (size_t)(pct - f->s) : f->len;
        jbuf_put(c, &b, f->s + i, end - i);
        if (!pct)
            break;
        i = end + 1;
        jcharge(c, 1, line);
        if (i < f->len && f->s[i] == '%') {
            jbuf_putc(c, &b, '%');
            i++;
            continue;
        }
        bool keyed = i < f->len && f->s[i] == '(';
        by_key |= keyed;
        struct jval v = keyed ? next_value(c, f, &i, args, &used, line) : jv_none();
        struct spec sp;
        size_t at = i;
        i = parse_spec(c, f, i, &sp, line);
        if (!keyed && sp.type != '%')
            v = next_value(c, f, &at, args, &used, line);
        if (!strchr("sradiufFeEgGxXoc%", sp.type))
            jerr(c, KVR_EFORMAT, line, "unsupported format character '%c' (0x%x) at index %zu",
                 sp.type, (unsigned)(unsigned char)sp.type, i - 1);
        if (sp.type == '%')
            jbuf_putc(c, &b, '%');
        else if (sp.type == 's' || sp.type == 'r' || sp.type == 'a')
            put_text(c, &b, &sp, v);
        else if (sp.type == 'c')
            put_char(c, &b, &sp, v, line);
        else
            put_number(c, &b, &sp, v, line);
    }
    bool tuple = args.t == JT_LIST && args.u.l->tuple;
    if (!by_key && used < (tuple ? args.u.l->n : 1) && args.t != JT_DICT)
        jerr(c, KVR_EFORMAT, line, "not all arguments converted during string formatting");
    return jv_buf(c, &b);
}

/* ---- round() --------------------------------------------------------------------------------- */

struct jval jpy_round(struct jctx *c, struct jval v, int64_t ndigits, uint32_t line)
{
    if (ndigits < -308 || ndigits > 308)
        jerr(c, KVR_ERANGE, line, "round precision out of range");
    if (v.t == JT_INT || v.t == JT_BOOL) { /* an int stays an int, rounded half to even */
        int64_t x = v.t == JT_INT ? v.u.i : v.u.b, p = 1;
        for (int64_t k = 0; k < -ndigits; k++)
            if (__builtin_mul_overflow(p, 10, &p))
                return jv_int(0);
        int64_t q = x / p, r = x % p;
        if (r < 0)
            q--, r += p;
        if (2 * r > p || (2 * r == p && (q & 1)))
            q++;
        int64_t out;
        if (__builtin_mul_overflow(q, p, &out))
            jerr(c, KVR_ERANGE, line, "integer overflow (integers are 64-bit)");
        return jv_int(out);
    }
    double x = v.u.f;
    if (!isfinite(x))
        return v;
    if (ndigits < 0) {
        double p = pow(10, (double)-ndigits);
        return jv_float(nearbyint(x / p) * p);
    }
    /* printf rounds the exact binary value to the nearest decimal, ties to even: Python's
     * round() does the same (round(2.675, 2) is 2.67, round(2.5) is 2). */
    char buf[700];
    snprintf(buf, sizeof buf, "%.*f", (int)ndigits, x);
    return jv_float(strtod(buf, NULL));
}

/* ---- list methods ---------------------------------------------------------------------------- */

bool jpy_list_method_exists(const char *name)
{
    return !strcmp(name, "index") || !strcmp(name, "count");
}

struct jval jpy_list_method(struct jctx *c, const struct jlist *l, const char *m,
                            const struct jargs *a, uint32_t line)
{
    const struct jval *x = jargs_get(a, 0, NULL);
    if (!x)
        jerr(c, KVR_EFORMAT, line, "%s() takes exactly one argument (0 given)", m);
    jcharge(c, l->n / 16, line);
    int64_t n = 0;
    for (uint32_t i = 0; i < l->n; i++) {
        if (!jv_equal(c, l->v[i], *x))
            continue;
        if (m[0] == 'i')
            return jv_int(i);
        n++;
    }
    if (m[0] == 'i')
        jerr(c, KVR_EFORMAT, line, "ValueError: value is not in list");
    return jv_int(n);
}
