/* jinja_filters.c - the filters, tests and str/dict methods of the Jinja interpreter.
 *
 * Filters (jinja2 semantics; map/select/... return lists where jinja2 returns generators):
 *   abs capitalize count default|d dictsort first float format indent int items join last length
 *   list lower map max min reject rejectattr replace reverse round safe select selectattr
 *   sort string sum title tojson trim unique upper wordcount
 * Tests: boolean callable defined divisibleby eq|equalto|== even false float ge|>= gt|>|
 *   greaterthan in integer iterable le|<= lower lt|<|lessthan mapping ne|!= none number
 *   odd sameas sequence string true undefined upper
 * Methods (Python's; the sandbox's immutable ones only):
 *   str: strip lstrip rstrip split rsplit splitlines startswith endswith upper lower title
 *        capitalize replace find rfind count join isdigit isalpha isspace isalnum islower
 *        isupper removeprefix removesuffix index
 *   dict: items keys values get
 *   list: index count */
#include "jinja/jinja_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct jval *arg(const struct jargs *a, int i, const char *name)
{
    return jargs_get(a, i, name);
}

static bool arg_bool(struct jctx *c, const struct jargs *a, int i, const char *name, bool def)
{
    const struct jval *v = arg(a, i, name);
    return v ? jv_truthy(c, *v) : def;
}

static const struct jstr *arg_str(struct jctx *c, const struct jargs *a, int i, const char *name,
                                  uint32_t line)
{
    const struct jval *v = arg(a, i, name);
    if (!v || v->t == JT_NONE)
        return NULL;
    if (v->t != JT_STR)
        jerr(c, KVR_EFORMAT, line, "argument '%s' must be a string, not %s", name,
             jv_type_name(*v));
    return v->u.s;
}

static struct jval str_of(struct jctx *c, struct jval v)
{
    return jv_to_str(c, v);
}

/* ---- methods ------------------------------------------------------------------------------ */

static const char *const str_methods[] = {
    "strip",    "lstrip",  "rstrip",       "split",        "rsplit",     "splitlines", "startswith",
    "endswith", "upper",   "lower",        "title",        "capitalize", "replace",    "find",
    "rfind",    "count",   "join",         "isdigit",      "isalpha",    "isspace",    "isalnum",
    "islower",  "isupper", "removeprefix", "removesuffix", "index",      NULL,
};
static const char *const dict_methods[] = {"items", "keys", "values", "get", NULL};

static bool in_list(const char *const *names, const char *name)
{
    for (; *names; names++)
        if (!strcmp(*names, name))
            return true;
    return false;
}

bool jmethod_exists(struct jval v, const char *name)
{
    if (v.t == JT_STR)
        return in_list(str_methods, name);
    if (v.t == JT_DICT && !v.u.d->ns)
        return in_list(dict_methods, name);
    if (v.t == JT_LIST)
        return jpy_list_method_exists(name);
    return false;
}

static struct jlist *dict_items(struct jctx *c, const struct jdict *d)
{
    struct jlist *l = jlist_new(&c->ar, d->n + 1);
    for (uint32_t i = 0; i < d->n; i++) {
        struct jlist *pair = jlist_new(&c->ar, 2);
        pair->tuple = true;
        jlist_push(&c->ar, pair, d->k[i]);
        jlist_push(&c->ar, pair, d->v[i]);
        jlist_push(&c->ar, l, jv_list(pair));
    }
    return l;
}

/* startswith/endswith take a string or a tuple of strings. */
static bool affix(struct jctx *c, const struct jstr *s, struct jval x, bool end, uint32_t line)
{
    if (x.t == JT_LIST && x.u.l->tuple) {
        for (uint32_t i = 0; i < x.u.l->n; i++)
            if (affix(c, s, x.u.l->v[i], end, line))
                return true;
        return false;
    }
    if (x.t != JT_STR)
        jerr(c, KVR_EFORMAT, line, "%s arg must be str or a tuple of str, not %s",
             end ? "endswith" : "startswith", jv_type_name(x));
    const struct jstr *p = x.u.s;
    return p->len <= s->len && !memcmp(end ? s->s + s->len - p->len : s->s, p->s, p->len);
}

static bool all_chars(const struct jstr *s, int kind)
{
    if (!s->len)
        return false;
    bool any_cased = false;
    for (size_t i = 0; i < s->len;) {
        uint32_t cp;
        i += ju_decode(s->s, s->len, i, &cp);
        bool digit = cp >= '0' && cp <= '9';
        bool alpha = ju_iscased(cp) || (cp > 0x7f && !ju_isspace(cp) && cp >= 0xc0);
        switch (kind) {
        case 0:
            if (!digit)
                return false;
            break;
        case 1:
            if (!alpha)
                return false;
            break;
        case 2:
            if (!ju_isspace(cp))
                return false;
            break;
        case 3:
            if (!alpha && !digit)
                return false;
            break;
        case 4:
            if (ju_upper(cp) != cp && ju_lower(cp) == cp)
                any_cased = true;
            else if (ju_lower(cp) != cp)
                return false;
            break;
        default:
            if (ju_lower(cp) != cp && ju_upper(cp) == cp)
                any_cased = true;
            else if (ju_upper(cp) != cp)
                return false;
            break;
        }
    }
    return kind < 4 || any_cased;
}

static int64_t arg_int(struct jctx *c, const struct jargs *a, int i, const char *name, int64_t def,
                       uint32_t line)
{
    const struct jval *v = arg(a, i, name);
    if (!v || v->t == JT_NONE)
        return def;
    if (v->t != JT_INT && v->t != JT_BOOL)
        jerr(c, KVR_EFORMAT, line, "'%s' must be an integer, not %s", name, jv_type_name(*v));
    return v->t == JT_INT ? v->u.i : v->u.b;
}

static struct jval str_method(struct jctx *c, const struct jstr *s, const char *m,
                              const struct jargs *a, uint32_t line)
{
    if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip"))
        return js_strip(c, s, arg_str(c, a, 0, "chars", line), m[0] != 'r', m[0] != 'l');
    if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
        int64_t max = arg_int(c, a, 1, "maxsplit", -1, line);
        if (m[0] == 'r')
            return js_rsplit(c, s, arg_str(c, a, 0, "sep", line), max, line);
        return js_split(c, s, arg_str(c, a, 0, "sep", line), max, line);
    }
    if (!strcmp(m, "splitlines"))
        return jv_list(js_splitlines(c, s, arg_bool(c, a, 0, "keepends", false)));
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
        const struct jval *x = arg(a, 0, NULL);
        if (!x)
            jerr(c, KVR_EFORMAT, line, "%s takes one argument", m);
        return jv_bool(affix(c, s, *x, m[0] == 'e', line));
    }
    if (!strcmp(m, "upper"))
        return js_case(c, s, JCASE_UPPER);
    if (!strcmp(m, "lower"))
        return js_case(c, s, JCASE_LOWER);
    if (!strcmp(m, "title"))
        return js_case(c, s, JCASE_PYTITLE);
    if (!strcmp(m, "capitalize"))
        return js_case(c, s, JCASE_CAPITALIZE);
    if (!strcmp(m, "replace")) {
        const struct jstr *old = arg_str(c, a, 0, "old", line),
                          *new = arg_str(c, a, 1, "new", line);
        if (!old || !new)
            jerr(c, KVR_EFORMAT, line, "replace takes two strings");
        return js_replace(c, s, old, new, arg_int(c, a, 2, "count", -1, line));
    }
    if (!strcmp(m, "index")) { /* find, which fails where find gives -1 */
        struct jval at = str_method(c, s, "find", a, line);
        if (at.u.i < 0)
            jerr(c, KVR_EFORMAT, line, "ValueError: substring not found");
        return at;
    }
    if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "count")) {
        const struct jstr *x = arg_str(c, a, 0, "sub", line);
        if (!x)
            jerr(c, KVR_EFORMAT, line, "%s takes a string", m);
        jcharge(c, s->len / 64, line);
        int64_t found = -1, n = 0;
        for (size_t i = 0; i + x->len <= s->len;) {
            if (!memcmp(s->s + i, x->s, x->len)) {
                found = (int64_t)ju_count(s->s, i);
                n++;
                if (m[0] == 'f')
                    break;
                if (m[0] == 'c') {
                    i += x->len ? x->len : 1;
                    continue;
                }
            }
            i++;
        }
        if (m[0] == 'c' && !x->len)
            n = (int64_t)ju_count(s->s, s->len) + 1;
        return jv_int(m[0] == 'c' ? n : found);
    }
    if (!strcmp(m, "join")) {
        const struct jval *x = arg(a, 0, NULL);
        if (!x)
            jerr(c, KVR_EFORMAT, line, "join takes one argument");
        struct jlist *items = jv_iter(c, *x, line);
        struct jbuf b = jbuf_new(c);
        for (uint32_t i = 0; i < items->n; i++) {
            if (items->v[i].t != JT_STR)
                jerr(c, KVR_EFORMAT, line, "sequence item %u: expected str instance, %s found",
                     (unsigned)i, jv_type_name(items->v[i]));
            if (i)
                jbuf_put(c, &b, s->s, s->len);
            jbuf_put(c, &b, items->v[i].u.s->s, items->v[i].u.s->len);
        }
        return jv_buf(c, &b);
    }
    if (!strcmp(m, "removeprefix") || !strcmp(m, "removesuffix")) {
        const struct jstr *x = arg_str(c, a, 0, "affix", line);
        if (!x)
            jerr(c, KVR_EFORMAT, line, "%s takes a string", m);
        bool suffix = m[6] == 's';
        struct jval xv = {.t = JT_STR, .u.s = (struct jstr *)x};
        if (affix(c, s, xv, suffix, line))
            return jv_str(&c->ar, suffix ? s->s : s->s + x->len, s->len - x->len);
        return (struct jval){.t = JT_STR, .u.s = (struct jstr *)s};
    }
    static const char *const is_names[] = {"isdigit", "isalpha", "isspace",
                                           "isalnum", "islower", "isupper"};
    for (int k = 0; k < 6; k++)
        if (!strcmp(m, is_names[k]))
            return jv_bool(all_chars(s, k));
    jerr(c, KVR_EFORMAT, line, "'str' object has no attribute '%s'", m);
}

struct jval jmethod_call(struct jctx *c, struct jval self, const struct jstr *name,
                         const struct jargs *a, uint32_t line)
{
    if (self.t == JT_STR)
        return str_method(c, self.u.s, name->s, a, line);
    if (self.t == JT_LIST)
        return jpy_list_method(c, self.u.l, name->s, a, line);
    const struct jdict *d = self.u.d;
    if (!strcmp(name->s, "items"))
        return jv_list(dict_items(c, d));
    if (!strcmp(name->s, "keys") || !strcmp(name->s, "values")) {
        struct jlist *l = jlist_new(&c->ar, d->n + 1);
        memcpy(l->v, name->s[0] == 'k' ? d->k : d->v, d->n * sizeof *l->v);
        l->n = d->n;
        return jv_list(l);
    }
    const struct jval *k = arg(a, 0, NULL);
    if (!k)
        jerr(c, KVR_EFORMAT, line, "get expected at least 1 argument");
    int64_t i = jdict_find(c, d, *k);
    if (i >= 0)
        return d->v[i];
    const struct jval *def = arg(a, 1, NULL);
    return def ? *def : jv_none();
}

/* ---- sorting (stable merge sort; every comparison is a step) ------------------------------- */

struct sort_key {
    const struct jstr *attr; /* NULL: the item itself */
    bool fold;               /* compare strings case-insensitively */
    bool reverse;
};

static struct jval attr_path(struct jctx *c, struct jval v, const struct jstr *path, uint32_t line)
{
    size_t st = 0;
    for (size_t i = 0; i <= path->len; i++) {
        if (i < path->len && path->s[i] != '.')
            continue;
        struct jval part = jv_str(&c->ar, path->s + st, i - st);
        char *end;
        long long idx = strtoll(part.u.s->s, &end, 10);
        /* Looking into an undefined value raises, as in jinja2. */
        if (part.u.s->len && !*end)
            v = jget_item(c, v, jv_int(idx), line);
        else
            v = jget_item(c, v, part, line);
        st = i + 1;
    }
    return v;
}

static struct jval sort_value(struct jctx *c, struct jval v, const struct sort_key *k,
                              uint32_t line)
{
    if (k->attr)
        v = attr_path(c, v, k->attr, line);
    if (k->fold && v.t == JT_STR)
        v = js_case(c, v.u.s, JCASE_LOWER);
    return v;
}

static void merge_sort(struct jctx *c, struct jval *v, struct jval *keys, uint32_t n,
                       struct jval *tmp, struct jval *tmpk, const struct sort_key *k, uint32_t line)
{
    if (n < 2)
        return;
    uint32_t h = n / 2;
    merge_sort(c, v, keys, h, tmp, tmpk, k, line);
    merge_sort(c, v + h, keys + h, n - h, tmp, tmpk, k, line);
    uint32_t i = 0, j = h, o = 0;
    while (i < h || j < n) {
        bool take_left = j >= n;
        if (i < h && j < n) {
            jcharge(c, 1, line);
            int r = jv_compare(c, keys[i], keys[j], line);
            take_left = k->reverse ? r >= 0 : r <= 0;
        } else if (i < h) {
            take_left = true;
        }
        uint32_t s = take_left ? i++ : j++;
        tmp[o] = v[s];
        tmpk[o++] = keys[s];
    }
    memcpy(v, tmp, n * sizeof *v);
    memcpy(keys, tmpk, n * sizeof *keys);
}

static struct jlist *sorted(struct jctx *c, struct jlist *items, const struct sort_key *k,
                            uint32_t line)
{
    uint32_t n = items->n;
    struct jlist *l = jlist_new(&c->ar, n + 1);
    struct jval *keys = ja_alloc_array(&c->ar, n + 1, sizeof *keys);
    struct jval *tmp = ja_alloc_array(&c->ar, n + 1, sizeof *tmp);
    struct jval *tmpk = ja_alloc_array(&c->ar, n + 1, sizeof *tmpk);
    for (uint32_t i = 0; i < n; i++) {
        l->v[i] = items->v[i];
        keys[i] = sort_value(c, items->v[i], k, line);
    }
    l->n = n;
    merge_sort(c, l->v, keys, n, tmp, tmpk, k, line);
    return l;
}

/* ---- filters ------------------------------------------------------------------------------- */

static const struct jstr *need_str(struct jctx *c, struct jval v)
{
    return str_of(c, v).u.s;
}

/* json.dumps(ensure_ascii=True): every non-ASCII character of the text as \\uXXXX (UTF-16,
 * so surrogate pairs above U+FFFF). Non-ASCII only ever occurs inside JSON strings. */
static struct jval ascii_json(struct jctx *c, const struct jbuf *in)
{
    struct jbuf b = jbuf_new(c);
    for (size_t i = 0; i < in->len;) {
        uint32_t cp;
        size_t n = ju_decode(in->p, in->len, i, &cp);
        char esc[16];
        if (cp < 0x80) {
            jbuf_put(c, &b, in->p + i, n);
        } else if (cp < 0x10000) {
            snprintf(esc, sizeof esc, "\\u%04x", (unsigned)cp);
            jbuf_put(c, &b, esc, 6);
        } else {
            cp -= 0x10000;
            snprintf(esc, sizeof esc, "\\u%04x\\u%04x", (unsigned)(0xd800 + (cp >> 10)),
                     (unsigned)(0xdc00 + (cp & 0x3ff)));
            jbuf_put(c, &b, esc, 12);
        }
        i += n;
    }
    return jv_buf(c, &b);
}

/* select/reject/selectattr/rejectattr: keep the items whose test (or truth) is `keep`. */
static struct jval select_items(struct jctx *c, struct jval v, const struct jargs *a, bool by_attr,
                                bool keep, uint32_t line)
{
    struct jlist *items = jv_iter(c, v, line);
    const struct jstr *attr = NULL;
    uint32_t first = 0;
    if (by_attr) {
        if (!a->n_pos || a->pos[0].t != JT_STR)
            jerr(c, KVR_EFORMAT, line, "selectattr/rejectattr need an attribute name");
        attr = a->pos[0].u.s;
        first = 1;
    }
    const struct jstr *test = NULL;
    if (a->n_pos > first) {
        if (a->pos[first].t != JT_STR)
            jerr(c, KVR_EFORMAT, line, "a test name must be a string");
        test = a->pos[first].u.s;
        if (!jtest_exists(test->s))
            jerr(c, KVR_EFORMAT, line, "no test named '%s'", test->s);
    }
    struct jargs targs = {0};
    for (uint32_t i = first + 1; i < a->n_pos; i++)
        targs.pos[targs.n_pos++] = a->pos[i];
    struct jlist *out = jlist_new(&c->ar, items->n + 1);
    for (uint32_t i = 0; i < items->n; i++) {
        jcharge(c, 1, line);
        struct jval x = attr ? attr_path(c, items->v[i], attr, line) : items->v[i];
        bool r = test ? jtest(c, test, x, &targs, line) : jv_truthy(c, x);
        if (r == keep)
            jlist_push(&c->ar, out, items->v[i]);
    }
    return jv_list(out);
}

static struct jval map_items(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    struct jlist *items = jv_iter(c, v, line);
    struct jlist *out = jlist_new(&c->ar, items->n + 1);
    const struct jstr *attr = arg_str(c, a, -1, "attribute", line);
    const struct jval *def = arg(a, -1, "default");
    const struct jstr *filter = NULL;
    struct jargs fargs = {0};
    if (!attr) {
        if (!a->n_pos || a->pos[0].t != JT_STR)
            jerr(c, KVR_EFORMAT, line, "map needs a filter name or attribute=");
        filter = a->pos[0].u.s;
        if (!jfilter_exists(filter->s))
            jerr(c, KVR_EFORMAT, line, "no filter named '%s'", filter->s);
        for (uint32_t i = 1; i < a->n_pos; i++)
            fargs.pos[fargs.n_pos++] = a->pos[i];
        fargs.n_kw = a->n_kw;
        for (uint32_t i = 0; i < a->n_kw; i++) {
            fargs.kw_name[i] = a->kw_name[i];
            fargs.kw[i] = a->kw[i];
        }
    }
    for (uint32_t i = 0; i < items->n; i++) {
        jcharge(c, 1, line);
        struct jval x;
        if (attr) {
            x = attr_path(c, items->v[i], attr, line);
            if (x.t == JT_UNDEF && def)
                x = *def;
        } else {
            x = jfilter(c, filter, items->v[i], &fargs, line);
        }
        jlist_push(&c->ar, out, x);
    }
    return jv_list(out);
}

static struct jval indent(struct jctx *c, const struct jstr *s, const struct jargs *a,
                          uint32_t line)
{
    struct jbuf pad = jbuf_new(c);
    const struct jval *w = arg(a, 0, "width");
    if (w && w->t == JT_STR) {
        jbuf_put(c, &pad, w->u.s->s, w->u.s->len);
    } else {
        int64_t n = arg_int(c, a, 0, "width", 4, line);
        for (int64_t i = 0; i < n; i++)
            jbuf_putc(c, &pad, ' ');
    }
    bool first = arg_bool(c, a, 1, "first", false), blank = arg_bool(c, a, 2, "blank", false);
    struct jbuf tmp = jbuf_new(c);
    jbuf_put(c, &tmp, s->s, s->len);
    jbuf_putc(c, &tmp, '\n');
    struct jlist *lines = js_splitlines(c, jv_buf(c, &tmp).u.s, false);
    struct jbuf b = jbuf_new(c);
    if (first)
        jbuf_put(c, &b, pad.p, pad.len);
    for (uint32_t i = 0; i < lines->n; i++) {
        const struct jstr *ln = lines->v[i].u.s;
        if (i) {
            jbuf_putc(c, &b, '\n');
            if (blank || ln->len)
                jbuf_put(c, &b, pad.p, pad.len);
        }
        jbuf_put(c, &b, ln->s, ln->len);
    }
    return jv_buf(c, &b);
}

static struct jval to_number(struct jctx *c, struct jval v, const struct jargs *a, bool flt)
{
    const struct jval *def = arg(a, 0, "default");
    struct jval d = def ? *def : flt ? jv_float(0) : jv_int(0);
    switch (v.t) {
    case JT_INT:
    case JT_BOOL:
        return flt ? jv_float((double)(v.t == JT_INT ? v.u.i : v.u.b))
                   : jv_int(v.t == JT_INT ? v.u.i : v.u.b);
    case JT_FLOAT:
        if (flt)
            return v;
        if (!isfinite(v.u.f) || fabs(v.u.f) >= 9.2e18)
            return d;
        return jv_int((int64_t)v.u.f);
    case JT_STR: {
        struct jval t = js_strip(c, v.u.s, NULL, true, true);
        const char *s = t.u.s->s;
        char *end;
        if (!*s)
            return d;
        if (!flt) {
            long long x = strtoll(s, &end, 10);
            if (!*end)
                return jv_int(x);
        }
        double f = strtod(s, &end);
        if (*end || (s[0] == '0' && (s[1] | 32) == 'x'))
            return d;
        if (flt)
            return jv_float(f);
        if (!isfinite(f) || fabs(f) >= 9.2e18)
            return d;
        return jv_int((int64_t)f);
    }
    default:
        return d;
    }
}

static struct jval minmax(struct jctx *c, struct jval v, const struct jargs *a, bool max,
                          uint32_t line)
{
    struct sort_key k = {.attr = arg_str(c, a, -1, "attribute", line),
                         .fold = !arg_bool(c, a, 0, "case_sensitive", false)};
    struct jlist *items = jv_iter(c, v, line);
    if (!items->n)
        return jv_undef(NULL);
    uint32_t best = 0;
    struct jval bk = sort_value(c, items->v[0], &k, line);
    for (uint32_t i = 1; i < items->n; i++) {
        struct jval x = sort_value(c, items->v[i], &k, line);
        int r = jv_compare(c, x, bk, line);
        if (max ? r > 0 : r < 0) {
            best = i;
            bk = x;
        }
    }
    return items->v[best];
}

/* ---- the filters, one function each ----------------------------------------------------- */

static struct jval f_default(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)line;
    const struct jval *def = arg(a, 0, "default_value");
    bool boolean = arg_bool(c, a, 1, "boolean", false);
    if (v.t == JT_UNDEF || (boolean && !jv_truthy(c, v)))
        return def ? *def : jv_str(&c->ar, "", 0);
    return v;
}

static struct jval f_length(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a;
    int64_t n = jv_len(c, v);
    if (n < 0)
        jerr(c, KVR_EFORMAT, line, "object of type '%s' has no len()", jv_type_name(v));
    return jv_int(n);
}

static struct jval f_safe(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)c, (void)a, (void)line;
    return v;
}

static struct jval f_string(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a, (void)line;
    return str_of(c, v);
}

static struct jval f_trim(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    return js_strip(c, need_str(c, v), arg_str(c, a, 0, "chars", line), true, true);
}

static struct jval f_upper(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a, (void)line;
    return js_case(c, need_str(c, v), JCASE_UPPER);
}

static struct jval f_lower(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a, (void)line;
    return js_case(c, need_str(c, v), JCASE_LOWER);
}

static struct jval f_capitalize(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a, (void)line;
    return js_case(c, need_str(c, v), JCASE_CAPITALIZE);
}

static struct jval f_title(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a, (void)line;
    return js_title(c, need_str(c, v));
}

/* Hugging Face's tojson(x, ensure_ascii=False, indent=None, separators=None,
 * sort_keys=False), which is json.dumps. */
static struct jval f_tojson(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    const struct jval *ind = arg(a, 1, "indent");
    int indent = -1;
    if (ind && ind->t != JT_NONE) {
        if (ind->t != JT_INT || ind->u.i < 0 || ind->u.i > 64)
            jerr(c, KVR_ENOTSUP, line, "tojson indent must be an integer 0..64");
        indent = (int)ind->u.i;
    }
    const struct jval *sep = arg(a, 2, "separators");
    if (sep && sep->t != JT_NONE)
        jerr(c, KVR_ENOTSUP, line, "tojson: separators are not supported");
    struct jbuf b = jbuf_new(c);
    jv_write_json(c, &b, v, indent, arg_bool(c, a, 3, "sort_keys", false), 0, line);
    if (arg_bool(c, a, 0, "ensure_ascii", false))
        return ascii_json(c, &b);
    return jv_buf(c, &b);
}

static struct jval f_replace(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    const struct jstr *old = arg_str(c, a, 0, "old", line), *new = arg_str(c, a, 1, "new", line);
    if (!old || !new)
        jerr(c, KVR_EFORMAT, line, "replace takes two strings");
    return js_replace(c, need_str(c, v), old, new, arg_int(c, a, 2, "count", -1, line));
}

static struct jval f_join(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    const struct jstr *sep = arg_str(c, a, 0, "d", line);
    const struct jstr *attr = arg_str(c, a, 1, "attribute", line);
    struct jlist *items = jv_iter(c, v, line);
    struct jbuf b = jbuf_new(c);
    for (uint32_t i = 0; i < items->n; i++) {
        if (i && sep)
            jbuf_put(c, &b, sep->s, sep->len);
        jv_write_str(c, &b, attr ? attr_path(c, items->v[i], attr, line) : items->v[i]);
    }
    return jv_buf(c, &b);
}

static struct jval f_first(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a;
    struct jlist *items = jv_iter(c, v, line);
    return items->n ? items->v[0] : jv_undef(NULL);
}

static struct jval f_last(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a;
    struct jlist *items = jv_iter(c, v, line);
    return items->n ? items->v[items->n - 1] : jv_undef(NULL);
}

static struct jval f_list(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a;
    struct jlist *items = jv_iter(c, v, line);
    struct jlist *l = jlist_new(&c->ar, items->n + 1);
    memcpy(l->v, items->v, items->n * sizeof *l->v);
    l->n = items->n;
    return jv_list(l);
}

static struct jval f_reverse(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a;
    if (v.t == JT_STR) {
        struct jlist *chars = jv_iter(c, v, line);
        struct jbuf b = jbuf_new(c);
        for (uint32_t i = chars->n; i-- > 0;)
            jbuf_put(c, &b, chars->v[i].u.s->s, chars->v[i].u.s->len);
        return jv_buf(c, &b);
    }
    struct jlist *items = jv_iter(c, v, line);
    struct jlist *l = jlist_new(&c->ar, items->n + 1);
    for (uint32_t i = items->n; i-- > 0;)
        jlist_push(&c->ar, l, items->v[i]);
    return jv_list(l);
}

static struct jval f_items(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a;
    if (v.t == JT_UNDEF)
        return jv_list(jlist_new(&c->ar, 1));
    if (v.t != JT_DICT || v.u.d->ns)
        jerr(c, KVR_EFORMAT, line, "can only get item pairs from a mapping");
    return jv_list(dict_items(c, v.u.d));
}

static struct jval f_dictsort(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    if (v.t != JT_DICT || v.u.d->ns)
        jerr(c, KVR_EFORMAT, line, "dictsort needs a mapping");
    const struct jstr *by = arg_str(c, a, 1, "by", line);
    struct sort_key k = {.fold = !arg_bool(c, a, 0, "case_sensitive", false),
                         .reverse = arg_bool(c, a, 2, "reverse", false)};
    k.attr = jstr_new(&c->ar, by && !strcmp(by->s, "value") ? "1" : "0", 1);
    return jv_list(sorted(c, dict_items(c, v.u.d), &k, line));
}

static struct jval f_sort(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    struct sort_key k = {.reverse = arg_bool(c, a, 0, "reverse", false),
                         .fold = !arg_bool(c, a, 1, "case_sensitive", false),
                         .attr = arg_str(c, a, 2, "attribute", line)};
    return jv_list(sorted(c, jv_iter(c, v, line), &k, line));
}

static struct jval f_unique(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    struct sort_key k = {.fold = !arg_bool(c, a, 0, "case_sensitive", false),
                         .attr = arg_str(c, a, 1, "attribute", line)};
    struct jlist *items = jv_iter(c, v, line), *seen = jlist_new(&c->ar, items->n + 1);
    struct jlist *out = jlist_new(&c->ar, items->n + 1);
    for (uint32_t i = 0; i < items->n; i++) {
        struct jval key = sort_value(c, items->v[i], &k, line);
        bool dup = false;
        for (uint32_t j = 0; j < seen->n && !dup; j++) {
            jcharge(c, 1, line);
            dup = jv_equal(c, seen->v[j], key);
        }
        if (!dup) {
            jlist_push(&c->ar, seen, key);
            jlist_push(&c->ar, out, items->v[i]);
        }
    }
    return jv_list(out);
}

static struct jval f_select(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    return select_items(c, v, a, false, true, line);
}

static struct jval f_reject(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    return select_items(c, v, a, false, false, line);
}

static struct jval f_selectattr(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    return select_items(c, v, a, true, true, line);
}

static struct jval f_rejectattr(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    return select_items(c, v, a, true, false, line);
}

static struct jval f_int(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)line;
    return to_number(c, v, a, false);
}

static struct jval f_float(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)line;
    return to_number(c, v, a, true);
}

/* jinja2's format: value % args, or value % kwargs (not both). */
static struct jval f_format(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    if (a->n_pos && a->n_kw)
        jerr(c, KVR_EFORMAT, line,
             "can't handle positional and keyword arguments at the same time");
    struct jval args;
    if (a->n_kw) {
        struct jdict *d = jdict_new(&c->ar, a->n_kw);
        for (uint32_t k = 0; k < a->n_kw; k++)
            jdict_set(c, d, (struct jval){.t = JT_STR, .u.s = (struct jstr *)a->kw_name[k]},
                      a->kw[k]);
        args = (struct jval){.t = JT_DICT, .u.d = d};
    } else {
        struct jlist *l = jlist_new(&c->ar, a->n_pos + 1);
        l->tuple = true;
        for (uint32_t k = 0; k < a->n_pos; k++)
            jlist_push(&c->ar, l, a->pos[k]);
        args = jv_list(l);
    }
    struct jval s = str_of(c, v);
    return jpy_percent(c, s.u.s, args, line);
}

static struct jval f_abs(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a;
    if (v.t == JT_INT && v.u.i != INT64_MIN)
        return jv_int(v.u.i < 0 ? -v.u.i : v.u.i);
    if (v.t == JT_FLOAT)
        return jv_float(fabs(v.u.f));
    if (v.t == JT_BOOL)
        return jv_int(v.u.b);
    jerr(c, KVR_EFORMAT, line, "bad operand type for abs(): '%s'", jv_type_name(v));
}

static struct jval f_round(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    int64_t prec = arg_int(c, a, 0, "precision", 0, line);
    const struct jstr *method = arg_str(c, a, 1, "method", line);
    if (v.t != JT_INT && v.t != JT_FLOAT && v.t != JT_BOOL)
        jerr(c, KVR_EFORMAT, line, "round needs a number");
    if (!method || !strcmp(method->s, "common")) /* jinja2 calls Python's round() */
        return jpy_round(c, v, prec, line);
    double x = v.t == JT_FLOAT ? v.u.f : v.t == JT_INT ? (double)v.u.i : v.u.b;
    if (prec < -300 || prec > 300)
        jerr(c, KVR_ERANGE, line, "round precision out of range");
    double m = pow(10, (double)prec), y = x * m;
    if (!strcmp(method->s, "ceil"))
        y = ceil(y);
    else if (!strcmp(method->s, "floor"))
        y = floor(y);
    else
        jerr(c, KVR_EFORMAT, line, "method must be common, ceil or floor");
    return jv_float(y / m);
}

static bool is_number(struct jval x)
{
    return x.t == JT_INT || x.t == JT_FLOAT || x.t == JT_BOOL;
}

static double as_double(struct jval x)
{
    return x.t == JT_FLOAT ? x.u.f : x.t == JT_INT ? (double)x.u.i : x.u.b;
}

static struct jval f_sum(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    const struct jstr *attr = arg_str(c, a, 0, "attribute", line);
    const struct jval *start = arg(a, 1, "start");
    struct jval acc = start ? *start : jv_int(0);
    struct jlist *items = jv_iter(c, v, line);
    for (uint32_t i = 0; i < items->n; i++) {
        struct jval x = attr ? attr_path(c, items->v[i], attr, line) : items->v[i];
        if (!(is_number(acc) && is_number(x)))
            jerr(c, KVR_EFORMAT, line, "sum needs numbers");
        if (acc.t == JT_FLOAT || x.t == JT_FLOAT) {
            acc = jv_float(as_double(acc) + as_double(x));
        } else {
            int64_t s;
            if (__builtin_add_overflow(acc.t == JT_INT ? acc.u.i : acc.u.b,
                                       x.t == JT_INT ? x.u.i : x.u.b, &s))
                jerr(c, KVR_ERANGE, line, "integer overflow (integers are 64-bit)");
            acc = jv_int(s);
        }
    }
    return acc;
}

static struct jval f_max(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    return minmax(c, v, a, true, line);
}

static struct jval f_min(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    return minmax(c, v, a, false, line);
}

static struct jval f_indent(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    if (v.t == JT_UNDEF) /* jinja2 appends to the value itself */
        jerr(c, KVR_EFORMAT, line, "'%.100s' is undefined", v.u.s ? v.u.s->s : "value");
    return indent(c, need_str(c, v), a, line);
}

static struct jval f_wordcount(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line)
{
    (void)a, (void)line;
    const struct jstr *s = need_str(c, v);
    int64_t n = 0;
    bool in = false;
    for (size_t i = 0; i < s->len;) {
        uint32_t cp;
        i += ju_decode(s->s, s->len, i, &cp);
        bool w = ju_isalnum(cp) || cp == '_' || (cp >= 0xc0 && !ju_isspace(cp));
        n += w && !in;
        in = w;
    }
    return jv_int(n);
}

/* ---- the filter table -------------------------------------------------------------------- */

/* Each filter with the parameters it takes after its value, in order, as jinja2 (and Hugging
 * Face, for tojson) declare them; map/select/reject and their attr forms take any. */
static const struct filter {
    const char *name;
    struct jval (*fn)(struct jctx *c, struct jval v, const struct jargs *a, uint32_t line);
    const char *params[4];
    bool variadic;
} filters[] = {
    {"abs", f_abs, {NULL}, false},
    {"capitalize", f_capitalize, {NULL}, false},
    {"count", f_length, {NULL}, false},
    {"default", f_default, {"default_value", "boolean"}, false},
    {"d", f_default, {"default_value", "boolean"}, false},
    {"dictsort", f_dictsort, {"case_sensitive", "by", "reverse"}, false},
    {"first", f_first, {NULL}, false},
    {"float", f_float, {"default"}, false},
    {"format", f_format, {NULL}, true},
    {"indent", f_indent, {"width", "first", "blank"}, false},
    {"int", f_int, {"default", "base"}, false},
    {"items", f_items, {NULL}, false},
    {"join", f_join, {"d", "attribute"}, false},
    {"last", f_last, {NULL}, false},
    {"length", f_length, {NULL}, false},
    {"list", f_list, {NULL}, false},
    {"lower", f_lower, {NULL}, false},
    {"map", map_items, {NULL}, true},
    {"max", f_max, {"case_sensitive", "attribute"}, false},
    {"min", f_min, {"case_sensitive", "attribute"}, false},
    {"reject", f_reject, {NULL}, true},
    {"rejectattr", f_rejectattr, {NULL}, true},
    {"replace", f_replace, {"old", "new", "count"}, false},
    {"reverse", f_reverse, {NULL}, false},
    {"round", f_round, {"precision", "method"}, false},
    {"safe", f_safe, {NULL}, false},
    {"select", f_select, {NULL}, true},
    {"selectattr", f_selectattr, {NULL}, true},
    {"sort", f_sort, {"reverse", "case_sensitive", "attribute"}, false},
    {"string", f_string, {NULL}, false},
    {"sum", f_sum, {"attribute", "start"}, false},
    {"title", f_title, {NULL}, false},
    {"tojson", f_tojson, {"ensure_ascii", "indent", "separators", "sort_keys"}, false},
    {"trim", f_trim, {"chars"}, false},
    {"unique", f_unique, {"case_sensitive", "attribute"}, false},
    {"upper", f_upper, {NULL}, false},
    {"wordcount", f_wordcount, {NULL}, false},
};

static const struct filter *find_filter(const char *name)
{
    for (size_t i = 0; i < sizeof filters / sizeof *filters; i++)
        if (!strcmp(filters[i].name, name))
            return &filters[i];
    return NULL;
}

bool jfilter_exists(const char *name)
{
    return find_filter(name) != NULL;
}

/* Python's TypeError for arguments a filter does not take. */
static void check_filter_args(struct jctx *c, const char *f, const struct filter *flt,
                              const struct jargs *a, uint32_t line)
{
    if (flt && flt->variadic)
        return;
    const char *const *params = flt ? flt->params : NULL;
    uint32_t n_params = 0;
    while (params && n_params < 4 && params[n_params])
        n_params++;
    if (a->n_pos > n_params)
        jerr(c, KVR_EFORMAT, line, "filter '%s' takes at most %u arguments (%u given)", f,
             (unsigned)n_params, (unsigned)a->n_pos);
    for (uint32_t k = 0; k < a->n_kw; k++) {
        uint32_t i = 0;
        while (i < n_params && strcmp(params[i], a->kw_name[k]->s))
            i++;
        if (i == n_params)
            jerr(c, KVR_EFORMAT, line, "filter '%s' got an unexpected keyword argument '%s'", f,
                 a->kw_name[k]->s);
        if (i < a->n_pos)
            jerr(c, KVR_EFORMAT, line, "filter '%s' got multiple values for argument '%s'", f,
                 a->kw_name[k]->s);
    }
}

struct jval jfilter(struct jctx *c, const struct jstr *name, struct jval v, const struct jargs *a,
                    uint32_t line)
{
    const struct filter *flt = find_filter(name->s);
    jcharge(c, 1, line);
    check_filter_args(c, name->s, flt, a, line);
    if (!flt)
        jerr(c, KVR_EFORMAT, line, "no filter named '%s'", name->s);
    return flt->fn(c, v, a, line);
}

/* ---- tests --------------------------------------------------------------------------------- */

static const char *const test_names[] = {
    "boolean",     "callable", "defined",  "divisibleby", "eq",     "equalto", "==",
    "even",        "false",    "float",    "ge",          ">=",     "gt",      ">",
    "greaterthan", "in",       "integer",  "iterable",    "le",     "<=",      "lower",
    "lt",          "<",        "lessthan", "mapping",     "ne",     "!=",      "none",
    "number",      "odd",      "sameas",   "sequence",    "string", "true",    "undefined",
    "upper",       NULL,
};

bool jtest_exists(const char *name)
{
    return in_list(test_names, name);
}

bool jtest(struct jctx *c, const struct jstr *name, struct jval v, const struct jargs *a,
           uint32_t line)
{
    const char *t = name->s;
    const struct jval *x = arg(a, 0, NULL);
    jcharge(c, 1, line);
    static const char *const one_arg[] = {
        "divisibleby", "eq", "equalto", "==",          "ne", "!=", "lt", "<",      "lessthan", "le",
        "<=",          "gt", ">",       "greaterthan", "ge", ">=", "in", "sameas", NULL};
    uint32_t n_args = a->n_pos + a->n_kw, want = in_list(one_arg, t) ? 1 : 0;
    if (n_args > want)
        jerr(c, KVR_EFORMAT, line, "test '%s' expected %u argument(s), got %u", t, (unsigned)want,
             (unsigned)n_args);
    if (!strcmp(t, "defined"))
        return v.t != JT_UNDEF;
    if (!strcmp(t, "undefined"))
        return v.t == JT_UNDEF;
    if (!strcmp(t, "none"))
        return v.t == JT_NONE;
    if (!strcmp(t, "boolean"))
        return v.t == JT_BOOL;
    if (!strcmp(t, "true"))
        return v.t == JT_BOOL && v.u.b;
    if (!strcmp(t, "false"))
        return v.t == JT_BOOL && !v.u.b;
    if (!strcmp(t, "string"))
        return v.t == JT_STR;
    if (!strcmp(t, "integer"))
        return v.t == JT_INT;
    if (!strcmp(t, "float"))
        return v.t == JT_FLOAT;
    if (!strcmp(t, "number"))
        return v.t == JT_INT || v.t == JT_FLOAT || v.t == JT_BOOL;
    if (!strcmp(t, "mapping"))
        return v.t == JT_DICT && !v.u.d->ns;
    if (!strcmp(t, "iterable"))
        return v.t == JT_STR || v.t == JT_LIST || (v.t == JT_DICT && !v.u.d->ns) || v.t == JT_UNDEF;
    if (!strcmp(t, "sequence"))
        return v.t == JT_STR || v.t == JT_LIST || (v.t == JT_DICT && !v.u.d->ns) || v.t == JT_UNDEF;
    if (!strcmp(t, "callable"))
        return v.t == JT_FUNC;
    if (!strcmp(t, "lower") || !strcmp(t, "upper")) {
        const struct jstr *s = need_str(c, v);
        return all_chars(s, t[0] == 'l' ? 4 : 5);
    }
    if (!strcmp(t, "even") || !strcmp(t, "odd") || !strcmp(t, "divisibleby")) {
        if (v.t != JT_INT && v.t != JT_BOOL)
            jerr(c, KVR_EFORMAT, line, "'%s' test needs an integer", t);
        int64_t n = v.t == JT_INT ? v.u.i : v.u.b, d = 2;
        if (t[0] == 'd') {
            if (!x || x->t != JT_INT || !x->u.i)
                jerr(c, KVR_EFORMAT, line, "divisibleby needs a non-zero integer");
            d = x->u.i;
            return d == -1 || n % d == 0;
        }
        return (n % 2 == 0) == (t[0] == 'e');
    }
    if (!x)
        jerr(c, KVR_EFORMAT, line, "test '%s' needs an argument", t);
    if (!strcmp(t, "sameas"))
        return v.t == x->t &&
               (v.t == JT_NONE || v.t == JT_UNDEF || (v.t == JT_BOOL && v.u.b == x->u.b) ||
                (v.t >= JT_STR && v.u.s == x->u.s));
    if (!strcmp(t, "in")) {
        struct jlist *items;
        if (x->t == JT_STR) {
            if (v.t != JT_STR)
                jerr(c, KVR_EFORMAT, line, "'in <string>' requires string as left operand");
            return js_find(x->u.s->s, x->u.s->len, v.u.s->s, v.u.s->len) != NULL;
        }
        items = jv_iter(c, *x, line);
        for (uint32_t i = 0; i < items->n; i++)
            if (jv_equal(c, items->v[i], v))
                return true;
        return false;
    }
    if (!strcmp(t, "eq") || !strcmp(t, "equalto") || !strcmp(t, "=="))
        return jv_equal(c, v, *x);
    if (!strcmp(t, "ne") || !strcmp(t, "!="))
        return !jv_equal(c, v, *x);
    if (v.t == JT_UNDEF || x->t == JT_UNDEF)
        jerr(c, KVR_EFORMAT, line, "an undefined value was compared");
    int r = jv_compare(c, v, *x, line);
    if (!strcmp(t, "lt") || !strcmp(t, "<") || !strcmp(t, "lessthan"))
        return r < 0;
    if (!strcmp(t, "le") || !strcmp(t, "<="))
        return r <= 0;
    if (!strcmp(t, "gt") || !strcmp(t, ">") || !strcmp(t, "greaterthan"))
        return r > 0;
    if (!strcmp(t, "ge") || !strcmp(t, ">="))
        return r >= 0;
    jerr(c, KVR_EFORMAT, line, "no test named '%s'", t);
}
