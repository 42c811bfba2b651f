/* jinja_strings.c - the string operations that filters and str methods share: case mapping,
 * strip, find, replace, split and splitlines, with Python's semantics over code points. */
#include "jinja/jinja_int.h"

#include <string.h>

/* ---- case and whitespace ---------------------------------------------------------------- */

struct jval js_case(struct jctx *c, const struct jstr *s, enum jcasing how)
{
    struct jbuf b = jbuf_new(c);
    bool prev_cased = false;
    jcharge(c, s->len / 64, 0);
    for (size_t i = 0, k = 0; i < s->len; k++) {
        uint32_t cp;
        size_t n = ju_decode(s->s, s->len, i, &cp);
        bool up = how == JCASE_UPPER || (how == JCASE_CAPITALIZE && k == 0) ||
                  (how == JCASE_PYTITLE && !prev_cased);
        prev_cased = ju_iscased(cp);
        char enc[8];
        if (up && cp == 0xdf) {
            jbuf_put(c, &b, how == JCASE_UPPER ? "SS" : "Ss", 2);
        } else {
            uint32_t m = up ? ju_upper(cp) : ju_lower(cp);
            jbuf_put(c, &b, enc, kvr_utf8_encode(m, enc));
        }
        i += n;
    }
    return jv_buf(c, &b);
}

/* jinja2's title: every word (after '-', whitespace or an opening bracket) gets an upper
 * first letter and lower-case rest. */
struct jval js_title(struct jctx *c, const struct jstr *s)
{
    struct jbuf b = jbuf_new(c);
    bool start = true;
    for (size_t i = 0; i < s->len;) {
        uint32_t cp;
        size_t n = ju_decode(s->s, s->len, i, &cp);
        bool sep = ju_isspace(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
        char enc[8];
        uint32_t m = sep ? cp : start ? ju_upper(cp) : ju_lower(cp);
        jbuf_put(c, &b, enc, kvr_utf8_encode(m, enc));
        start = sep;
        i += n;
    }
    return jv_buf(c, &b);
}

static bool in_set(uint32_t cp, const struct jstr *chars)
{
    if (!chars)
        return ju_isspace(cp);
    for (size_t i = 0; i < chars->len;) {
        uint32_t x;
        i += ju_decode(chars->s, chars->len, i, &x);
        if (x == cp)
            return true;
    }
    return false;
}

struct jval js_strip(struct jctx *c, const struct jstr *s, const struct jstr *chars, bool left,
                     bool right)
{
    size_t a = 0, b = s->len;
    jcharge(c, s->len / 64, 0);
    while (left && a < b) {
        uint32_t cp;
        size_t n = ju_decode(s->s, s->len, a, &cp);
        if (!in_set(cp, chars))
            break;
        a += n;
    }
    while (right && b > a) {
        size_t st = b - 1;
        while (st > a && ((unsigned char)s->s[st] & 0xc0) == 0x80)
            st--;
        uint32_t cp;
        ju_decode(s->s, b, st, &cp);
        if (!in_set(cp, chars))
            break;
        b = st;
    }
    return jv_str(&c->ar, s->s + a, b - a);
}

const char *js_find(const char *h, size_t hn, const char *x, size_t xn)
{
    if (!xn)
        return h;
    for (size_t i = 0; i + xn <= hn; i++)
        if (!memcmp(h + i, x, xn))
            return h + i;
    return NULL;
}

struct jval js_replace(struct jctx *c, const struct jstr *s, const struct jstr *old,
                       const struct jstr *new, int64_t count)
{
    struct jbuf b = jbuf_new(c);
    size_t i = 0;
    int64_t done = 0;
    jcharge(c, s->len / 64, 0);
    if (!old->len) {
        for (;;) {
            if (count < 0 || done < count) {
                jbuf_put(c, &b, new->s, new->len);
                done++;
            }
            if (i >= s->len)
                break;
            uint32_t cp;
            size_t n = ju_decode(s->s, s->len, i, &cp);
            jbuf_put(c, &b, s->s + i, n);
            i += n;
        }
        return jv_buf(c, &b);
    }
    while (count < 0 || done < count) {
        const char *hit = js_find(s->s + i, s->len - i, old->s, old->len);
        if (!hit)
            break;
        size_t at = (size_t)(hit - s->s);
        jbuf_put(c, &b, s->s + i, at - i);
        jbuf_put(c, &b, new->s, new->len);
        i = at + old->len;
        done++;
    }
    jbuf_put(c, &b, s->s + i, s->len - i);
    return jv_buf(c, &b);
}

struct jval js_split(struct jctx *c, const struct jstr *s, const struct jstr *sep, int64_t maxsplit,
                     uint32_t line)
{
    struct jlist *l = jlist_new(&c->ar, 8);
    jcharge(c, s->len / 64, line);
    if (sep && !sep->len)
        jerr(c, KVR_EFORMAT, line, "empty separator");
    size_t i = 0;
    if (sep) {
        for (;;) {
            const char *hit = maxsplit < 0 || (int64_t)l->n < maxsplit
                                  ? js_find(s->s + i, s->len - i, sep->s, sep->len)
                                  : NULL;
            if (!hit) {
                jlist_push(&c->ar, l, jv_str(&c->ar, s->s + i, s->len - i));
                break;
            }
            size_t at = (size_t)(hit - s->s);
            jlist_push(&c->ar, l, jv_str(&c->ar, s->s + i, at - i));
            i = at + sep->len;
        }
        return jv_list(l);
    }
    for (;;) {
        uint32_t cp;
        size_t n;
        while (i < s->len && (n = ju_decode(s->s, s->len, i, &cp), ju_isspace(cp)))
            i += n;
        if (i >= s->len)
            break;
        if (maxsplit >= 0 && (int64_t)l->n >= maxsplit) {
            jlist_push(&c->ar, l, jv_str(&c->ar, s->s + i, s->len - i));
            break;
        }
        size_t st = i;
        while (i < s->len && (n = ju_decode(s->s, s->len, i, &cp), !ju_isspace(cp)))
            i += n;
        jlist_push(&c->ar, l, jv_str(&c->ar, s->s + st, i - st));
    }
    return jv_list(l);
}

/* The last x[0..xn) in h[0..hn) (xn > 0), or NULL. */
static const char *find_last(const char *h, size_t hn, const char *x, size_t xn)
{
    for (size_t i = hn; i >= xn; i--)
        if (!memcmp(h + i - xn, x, xn))
            return h + i - xn;
    return NULL;
}

static void reverse_list(struct jlist *l)
{
    for (uint32_t i = 0, j = l->n ? l->n - 1 : 0; i < j; i++, j--) {
        struct jval t = l->v[i];
        l->v[i] = l->v[j];
        l->v[j] = t;
    }
}

/* Without maxsplit rsplit and split give the same parts; with it, the cuts are made from
 * the end, and the part left at the start keeps its leading white space. */
struct jval js_rsplit(struct jctx *c, const struct jstr *s, const struct jstr *sep,
                      int64_t maxsplit, uint32_t line)
{
    if (maxsplit < 0)
        return js_split(c, s, sep, maxsplit, line);
    if (sep && !sep->len)
        jerr(c, KVR_EFORMAT, line, "empty separator");
    jcharge(c, s->len / 64, line);
    struct jlist *l = jlist_new(&c->ar, 8);
    size_t end = s->len;
    if (sep) {
        const char *hit;
        while ((int64_t)l->n < maxsplit && (hit = find_last(s->s, end, sep->s, sep->len))) {
            size_t at = (size_t)(hit - s->s);
            jlist_push(&c->ar, l, jv_str(&c->ar, hit + sep->len, end - at - sep->len));
            end = at;
        }
        jlist_push(&c->ar, l, jv_str(&c->ar, s->s, end));
        reverse_list(l);
        return jv_list(l);
    }
    /* Runs of white space: scan code points forward once, then cut from the last. */
    size_t *at = ja_alloc_array(&c->ar, s->len + 1, sizeof *at);
    bool *sp = ja_alloc_array(&c->ar, s->len + 1, sizeof *sp);
    size_t n = 0;
    for (size_t i = 0; i < s->len; n++) {
        uint32_t cp;
        at[n] = i;
        i += ju_decode(s->s, s->len, i, &cp);
        sp[n] = ju_isspace(cp);
    }
    at[n] = s->len;
    size_t k = n; /* code points left to look at: [0, k) */
    for (;;) {
        while (k > 0 && sp[k - 1])
            k--;
        if (k == 0)
            break;
        if ((int64_t)l->n >= maxsplit) {
            jlist_push(&c->ar, l, jv_str(&c->ar, s->s, at[k]));
            break;
        }
        size_t e = k;
        while (k > 0 && !sp[k - 1])
            k--;
        jlist_push(&c->ar, l, jv_str(&c->ar, s->s + at[k], at[e] - at[k]));
    }
    reverse_list(l);
    return jv_list(l);
}

static bool is_line_break(uint32_t cp)
{
    return cp == '\n' || cp == '\r' || cp == 0x0b || cp == 0x0c || cp == 0x1c || cp == 0x1d ||
           cp == 0x1e || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
}

struct jlist *js_splitlines(struct jctx *c, const struct jstr *s, bool keepends)
{
    struct jlist *l = jlist_new(&c->ar, 8);
    size_t st = 0, i = 0;
    while (i < s->len) {
        uint32_t cp;
        size_t n = ju_decode(s->s, s->len, i, &cp);
        if (!is_line_break(cp)) {
            i += n;
            continue;
        }
        size_t end = i;
        i += n;
        if (cp == '\r' && i < s->len && s->s[i] == '\n')
            i++;
        jlist_push(&c->ar, l, jv_str(&c->ar, s->s + st, (keepends ? i : end) - st));
        st = i;
    }
    if (st < s->len)
        jlist_push(&c->ar, l, jv_str(&c->ar, s->s + st, s->len - st));
    return l;
}
