/* jinja_value.c - the arena and the values of the Jinja interpreter (see jinja_int.h).
 *
 * Values behave as Python's: str() and repr() print them as Python does (floats in their
 * shortest round-trip form, strings quoted the way repr chooses), equality compares
 * numbers across int/float/bool, and tojson is json.dumps(ensure_ascii=False). */
#include "jinja/jinja_int.h"

#include "core/alloc.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- failure and arena ------------------------------------------------------------- */

struct jchunk {
    struct jchunk *next;
    size_t size, used;
    _Alignas(16) unsigned char data[];
};

#define CHUNK_BYTES ((size_t)64 << 10)

void ja_init(struct jarena *a, size_t cap_bytes, struct jfail *fail)
{
    a->chunks = NULL;
    a->used_bytes = 0;
    a->cap_bytes = cap_bytes;
    a->fail = fail;
}

void ja_fini(struct jarena *a)
{
    struct jchunk *c = a->chunks;
    while (c) {
        struct jchunk *next = c->next;
        kvr_free(c);
        c = next;
    }
    a->chunks = NULL;
    a->used_bytes = 0;
}

_Noreturn void jfail_at(struct jfail *f, int code, uint32_t line, const char *fmt, ...)
{
    char msg[KVR_ERR_MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (line)
        kvr_err_set(f->err, code, "line %u: %s", (unsigned)line, msg);
    else
        kvr_err_set(f->err, code, "%s", msg);
    f->code = code;
    longjmp(f->jb, 1);
}

void *ja_alloc(struct jarena *a, size_t n)
{
    size_t need = (n + 15) & ~(size_t)15;
    if (need < n)
        jfail_at(a->fail, KVR_ENOMEM, 0, "allocation size overflows");
    struct jchunk *c = a->chunks;
    if (!c || c->size - c->used < need) {
        size_t size = need > CHUNK_BYTES / 4 ? need : CHUNK_BYTES;
        size_t total;
        if (!kvr_add_size(size, sizeof *c, &total) || a->used_bytes > a->cap_bytes ||
            total > a->cap_bytes - a->used_bytes)
            jfail_at(a->fail, KVR_ERANGE, 0, "working memory limit (%zu bytes) reached",
                     a->cap_bytes);
        c = kvr_malloc(total);
        if (!c)
            jfail_at(a->fail, KVR_ENOMEM, 0, "out of memory");
        c->size = size;
        c->used = 0;
        a->used_bytes += total;
        if (size == need && a->chunks) {
            /* A large block gets a chunk of its own, behind the current one. */
            c->next = a->chunks->next;
            a->chunks->next = c;
        } else {
            c->next = a->chunks;
            a->chunks = c;
        }
    }
    void *p = c->data + c->used;
    c->used += need;
    memset(p, 0, n);
    return p;
}

void *ja_alloc_array(struct jarena *a, size_t n, size_t elem)
{
    size_t bytes;
    if (!kvr_mul_size(n, elem, &bytes))
        jfail_at(a->fail, KVR_ENOMEM, 0, "array size overflows");
    return ja_alloc(a, bytes ? bytes : 1);
}

/* ---- constructors --------------------------------------------------------------------- */

struct jstr *jstr_new(struct jarena *a, const char *s, size_t len)
{
    size_t bytes;
    if (!kvr_add_size(len, sizeof(struct jstr) + 1, &bytes))
        jfail_at(a->fail, KVR_ENOMEM, 0, "string size overflows");
    struct jstr *r = ja_alloc(a, bytes);
    r->len = len;
    if (len)
        memcpy(r->s, s, len);
    r->s[len] = 0;
    return r;
}

struct jval jv_str(struct jarena *a, const char *s, size_t len)
{
    struct jval v = {.t = JT_STR};
    v.u.s = jstr_new(a, s, len);
    return v;
}

struct jval jv_int(int64_t i)
{
    return (struct jval){.t = JT_INT, .u.i = i};
}
struct jval jv_float(double f)
{
    return (struct jval){.t = JT_FLOAT, .u.f = f};
}
struct jval jv_bool(bool b)
{
    return (struct jval){.t = JT_BOOL, .u.b = b};
}
struct jval jv_none(void)
{
    return (struct jval){.t = JT_NONE};
}
struct jval jv_undef(struct jstr *name)
{
    return (struct jval){.t = JT_UNDEF, .u.s = name};
}

struct jlist *jlist_new(struct jarena *a, uint32_t cap)
{
    struct jlist *l = ja_alloc(a, sizeof *l);
    l->cap = cap ? cap : 4;
    l->v = ja_alloc_array(a, l->cap, sizeof *l->v);
    return l;
}

void jlist_push(struct jarena *a, struct jlist *l, struct jval v)
{
    if (l->n == l->cap) {
        if (l->cap > UINT32_MAX / 2)
            jfail_at(a->fail, KVR_ERANGE, 0, "list too long");
        struct jval *nv = ja_alloc_array(a, (size_t)l->cap * 2, sizeof *nv);
        memcpy(nv, l->v, l->n * sizeof *nv);
        l->v = nv;
        l->cap *= 2;
    }
    l->v[l->n++] = v;
}

struct jdict *jdict_new(struct jarena *a, uint32_t cap)
{
    struct jdict *d = ja_alloc(a, sizeof *d);
    d->cap = cap ? cap : 4;
    d->k = ja_alloc_array(a, d->cap, sizeof *d->k);
    d->v = ja_alloc_array(a, d->cap, sizeof *d->v);
    return d;
}

int64_t jdict_find(struct jctx *c, const struct jdict *d, struct jval k)
{
    jcharge(c, d->n / 16, 0);
    for (uint32_t i = 0; i < d->n; i++)
        if (jv_equal(c, d->k[i], k))
            return i;
    return -1;
}

int64_t jdict_find_str(struct jctx *c, const struct jdict *d, const char *k, size_t len)
{
    jcharge(c, d->n / 16, 0);
    for (uint32_t i = 0; i < d->n; i++)
        if (d->k[i].t == JT_STR && d->k[i].u.s->len == len && !memcmp(d->k[i].u.s->s, k, len))
            return i;
    return -1;
}

void jdict_set(struct jctx *c, struct jdict *d, struct jval k, struct jval v)
{
    int64_t i = jdict_find(c, d, k);
    if (i >= 0) {
        d->v[i] = v;
        return;
    }
    if (d->n == d->cap) {
        if (d->cap > UINT32_MAX / 2)
            jerr(c, KVR_ERANGE, 0, "dict too large");
        struct jval *nk = ja_alloc_array(&c->ar, (size_t)d->cap * 2, sizeof *nk);
        struct jval *nv = ja_alloc_array(&c->ar, (size_t)d->cap * 2, sizeof *nv);
        memcpy(nk, d->k, d->n * sizeof *nk);
        memcpy(nv, d->v, d->n * sizeof *nv);
        d->k = nk;
        d->v = nv;
        d->cap *= 2;
    }
    d->k[d->n] = k;
    d->v[d->n] = v;
    d->n++;
}

/* ---- output buffers -------------------------------------------------------------------- */

void jbuf_put(struct jctx *c, struct jbuf *b, const char *p, size_t n)
{
    if (!n)
        return;
    if (n > b->max || b->len > b->max - n)
        jerr(c, KVR_ERANGE, 0, "output limit (%zu bytes) reached", b->max);
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *np = ja_alloc(&c->ar, cap);
        if (b->len)
            memcpy(np, b->p, b->len);
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, p, n);
    b->len += n;
    b->p[b->len] = 0;
}

void jbuf_putc(struct jctx *c, struct jbuf *b, char ch)
{
    jbuf_put(c, b, &ch, 1);
}

static void jbuf_puts(struct jctx *c, struct jbuf *b, const char *s)
{
    jbuf_put(c, b, s, strlen(s));
}

static struct jbuf scratch(struct jctx *c)
{
    return (struct jbuf){.max = c->t->lim.max_output_bytes};
}

/* ---- printing ------------------------------------------------------------------------ */

/* Python's repr(float): the shortest digits that read back to the same double, in fixed
 * notation for decimal exponents -4 .. 15, else as d.ddde+XX. */
static void write_float(struct jctx *c, struct jbuf *b, double f, bool json)
{
    if (isnan(f)) {
        jbuf_puts(c, b, json ? "NaN" : "nan");
        return;
    }
    if (isinf(f)) {
        jbuf_puts(c, b, f < 0 ? (json ? "-Infinity" : "-inf") : (json ? "Infinity" : "inf"));
        return;
    }
    char e[40];
    for (int p = 1; p <= 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, f);
        if (strtod(e, NULL) == f)
            break;
    }
    char digits[24];
    size_t nd = 0;
    const char *q = e;
    bool neg = *q == '-';
    if (neg)
        q++;
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9')
            digits[nd++] = *q;
    int ex = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    char out[64];
    size_t o = 0;
    if (neg)
        out[o++] = '-';
    if (ex < -4 || ex >= 16) {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            memcpy(out + o, digits + 1, nd - 1);
            o += nd - 1;
        }
        o += (size_t)snprintf(out + o, sizeof out - o, "e%c%02d", ex < 0 ? '-' : '+', abs(ex));
    } else if (ex < 0) {
        out[o++] = '0';
        out[o++] = '.';
        for (int i = 0; i < -ex - 1; i++)
            out[o++] = '0';
        memcpy(out + o, digits, nd);
        o += nd;
    } else {
        for (int i = 0; i <= ex; i++)
            out[o++] = (size_t)i < nd ? digits[i] : '0';
        out[o++] = '.';
        if ((size_t)ex + 1 < nd) {
            memcpy(out + o, digits + ex + 1, nd - (size_t)ex - 1);
            o += nd - (size_t)ex - 1;
        } else {
            out[o++] = '0';
        }
    }
    jbuf_put(c, b, out, o);
}

static bool printable(uint32_t cp)
{
    if (cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp <= 0xa0) || cp == 0xad)
        return false;
    if ((cp >= 0x2000 && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202f) ||
        (cp >= 0x205f && cp <= 0x206f) || cp == 0x3000 || cp == 0xfeff ||
        (cp >= 0xd800 && cp <= 0xf8ff) || (cp >= 0xfff9 && cp <= 0xfffb))
        return false;
    return true;
}

static void write_str_repr(struct jctx *c, struct jbuf *b, const struct jstr *s)
{
    bool sq = memchr(s->s, '\'', s->len) != NULL, dq = memchr(s->s, '"', s->len) != NULL;
    char quote = sq && !dq ? '"' : '\'';
    jbuf_putc(c, b, quote);
    for (size_t i = 0; i < s->len;) {
        uint32_t cp;
        size_t n = ju_decode(s->s, s->len, i, &cp);
        char esc[16];
        if (cp == '\\' || cp == (uint32_t)quote) {
            esc[0] = '\\';
            esc[1] = (char)cp;
            jbuf_put(c, b, esc, 2);
        } else if (cp == '\n') {
            jbuf_puts(c, b, "\\n");
        } else if (cp == '\r') {
            jbuf_puts(c, b, "\\r");
        } else if (cp == '\t') {
            jbuf_puts(c, b, "\\t");
        } else if (!printable(cp)) {
            if (cp < 0x100)
                snprintf(esc, sizeof esc, "\\x%02x", (unsigned)cp);
            else if (cp < 0x10000)
                snprintf(esc, sizeof esc, "\\u%04x", (unsigned)cp);
            else
                snprintf(esc, sizeof esc, "\\U%08x", (unsigned)cp);
            jbuf_puts(c, b, esc);
        } else {
            jbuf_put(c, b, s->s + i, n);
        }
        i += n;
    }
    jbuf_putc(c, b, quote);
}

static void write_any(struct jctx *c, struct jbuf *b, struct jval v, bool repr, uint32_t depth)
{
    char num[64];
    if (depth > c->t->lim.max_depth)
        jerr(c, KVR_ERANGE, 0, "values nested deeper than %u", (unsigned)c->t->lim.max_depth);
    jcharge(c, 1, 0);
    switch (v.t) {
    case JT_UNDEF:
        if (repr)
            jbuf_puts(c, b, "Undefined");
        break;
    case JT_NONE:
        jbuf_puts(c, b, "None");
        break;
    case JT_BOOL:
        jbuf_puts(c, b, v.u.b ? "True" : "False");
        break;
    case JT_INT:
        snprintf(num, sizeof num, "%lld", (long long)v.u.i);
        jbuf_puts(c, b, num);
        break;
    case JT_FLOAT:
        write_float(c, b, v.u.f, false);
        break;
    case JT_STR:
        if (repr)
            write_str_repr(c, b, v.u.s);
        else
            jbuf_put(c, b, v.u.s->s, v.u.s->len);
        break;
    case JT_LIST: {
        const struct jlist *l = v.u.l;
        jbuf_putc(c, b, l->tuple ? '(' : '[');
        for (uint32_t i = 0; i < l->n; i++) {
            if (i)
                jbuf_puts(c, b, ", ");
            write_any(c, b, l->v[i], true, depth + 1);
        }
        if (l->tuple && l->n == 1)
            jbuf_putc(c, b, ',');
        jbuf_putc(c, b, l->tuple ? ')' : ']');
        break;
    }
    case JT_DICT: {
        const struct jdict *d = v.u.d;
        /* A namespace prints as jinja2's Namespace: <Namespace {...}>. */
        jbuf_puts(c, b, d->ns ? "<Namespace {" : "{");
        for (uint32_t i = 0; i < d->n; i++) {
            if (i)
                jbuf_puts(c, b, ", ");
            write_any(c, b, d->k[i], true, depth + 1);
            jbuf_puts(c, b, ": ");
            write_any(c, b, d->v[i], true, depth + 1);
        }
        jbuf_puts(c, b, d->ns ? "}>" : "}");
        break;
    }
    case JT_FUNC:
        jbuf_puts(c, b, "<function>");
        break;
    case JT_LOOP:
        snprintf(num, sizeof num, "<LoopContext %lld/%lld>", (long long)v.u.loop->index0 + 1,
                 (long long)v.u.loop->length);
        jbuf_puts(c, b, num);
        break;
    default:
        break;
    }
}

void jv_write_str(struct jctx *c, struct jbuf *b, struct jval v)
{
    write_any(c, b, v, false, 0);
}
void jv_write_repr(struct jctx *c, struct jbuf *b, struct jval v)
{
    write_any(c, b, v, true, 0);
}

struct jval jv_to_str(struct jctx *c, struct jval v)
{
    if (v.t == JT_STR)
        return v;
    struct jbuf b = scratch(c);
    jv_write_str(c, &b, v);
    return jv_str(&c->ar, b.p ? b.p : "", b.len);
}

/* ---- JSON ------------------------------------------------------------------------------ */

static void json_quote(struct jctx *c, struct jbuf *b, const char *s, size_t len)
{
    jbuf_putc(c, b, '"');
    size_t run = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch >= 0x20 && ch != '"' && ch != '\\')
            continue;
        jbuf_put(c, b, s + run, i - run);
        run = i + 1;
        char esc[8];
        switch (ch) {
        case '"':
            jbuf_puts(c, b, "\\\"");
            break;
        case '\\':
            jbuf_puts(c, b, "\\\\");
            break;
        case '\n':
            jbuf_puts(c, b, "\\n");
            break;
        case '\r':
            jbuf_puts(c, b, "\\r");
            break;
        case '\t':
            jbuf_puts(c, b, "\\t");
            break;
        case '\b':
            jbuf_puts(c, b, "\\b");
            break;
        case '\f':
            jbuf_puts(c, b, "\\f");
            break;
        default:
            snprintf(esc, sizeof esc, "\\u%04x", ch);
            jbuf_puts(c, b, esc);
        }
    }
    jbuf_put(c, b, s + run, len - run);
    jbuf_putc(c, b, '"');
}

static void json_newline(struct jctx *c, struct jbuf *b, int indent, uint32_t depth)
{
    jbuf_putc(c, b, '\n');
    for (uint64_t i = 0; i < (uint64_t)indent * depth; i++)
        jbuf_putc(c, b, ' ');
}

/* A dict key as json.dumps converts it: str as is; numbers, bools and None as their JSON
 * text. */
static struct jval json_key(struct jctx *c, struct jval k, uint32_t line)
{
    struct jbuf b = scratch(c);
    switch (k.t) {
    case JT_STR:
        return k;
    case JT_NONE:
        return jv_str(&c->ar, "null", 4);
    case JT_BOOL:
        return k.u.b ? jv_str(&c->ar, "true", 4) : jv_str(&c->ar, "false", 5);
    case JT_INT:
        return jv_to_str(c, k);
    case JT_FLOAT:
        write_float(c, &b, k.u.f, true);
        return jv_str(&c->ar, b.p, b.len);
    default:
        jerr(c, KVR_EFORMAT, line, "keys must be str, int, float, bool or None, not %s",
             jv_type_name(k));
    }
}

void jv_write_json(struct jctx *c, struct jbuf *b, struct jval v, int indent, bool sort_keys,
                   uint32_t depth, uint32_t line)
{
    char num[32];
    if (depth > c->t->lim.max_depth)
        jerr(c, KVR_ERANGE, line, "values nested deeper than %u", (unsigned)c->t->lim.max_depth);
    jcharge(c, 1, line);
    switch (v.t) {
    case JT_NONE:
        jbuf_puts(c, b, "null");
        return;
    case JT_BOOL:
        jbuf_puts(c, b, v.u.b ? "true" : "false");
        return;
    case JT_INT:
        snprintf(num, sizeof num, "%lld", (long long)v.u.i);
        jbuf_puts(c, b, num);
        return;
    case JT_FLOAT:
        write_float(c, b, v.u.f, true);
        return;
    case JT_STR:
        json_quote(c, b, v.u.s->s, v.u.s->len);
        return;
    case JT_LIST: {
        const struct jlist *l = v.u.l;
        if (!l->n) {
            jbuf_puts(c, b, "[]");
            return;
        }
        jbuf_putc(c, b, '[');
        for (uint32_t i = 0; i < l->n; i++) {
            if (i)
                jbuf_puts(c, b, indent >= 0 ? "," : ", ");
            if (indent >= 0)
                json_newline(c, b, indent, depth + 1);
            jv_write_json(c, b, l->v[i], indent, sort_keys, depth + 1, line);
        }
        if (indent >= 0)
            json_newline(c, b, indent, depth);
        jbuf_putc(c, b, ']');
        return;
    }
    case JT_DICT:
        if (!v.u.d->ns) {
            const struct jdict *d = v.u.d;
            if (!d->n) {
                jbuf_puts(c, b, "{}");
                return;
            }
            uint32_t *order = ja_alloc_array(&c->ar, d->n, sizeof *order);
            struct jval *keys = ja_alloc_array(&c->ar, d->n, sizeof *keys);
            for (uint32_t i = 0; i < d->n; i++) {
                order[i] = i;
                keys[i] = json_key(c, d->k[i], line);
            }
            if (sort_keys) {
                /* Insertion sort: stable, and every comparison is counted as a step. */
                for (uint32_t i = 1; i < d->n; i++)
                    for (uint32_t j = i; j > 0; j--) {
                        if (jv_compare(c, d->k[order[j - 1]], d->k[order[j]], line) <= 0)
                            break;
                        uint32_t t = order[j];
                        order[j] = order[j - 1];
                        order[j - 1] = t;
                    }
            }
            jbuf_putc(c, b, '{');
            for (uint32_t i = 0; i < d->n; i++) {
                if (i)
                    jbuf_puts(c, b, indent >= 0 ? "," : ", ");
                if (indent >= 0)
                    json_newline(c, b, indent, depth + 1);
                const struct jstr *k = keys[order[i]].u.s;
                json_quote(c, b, k->s, k->len);
                jbuf_puts(c, b, ": ");
                jv_write_json(c, b, d->v[order[i]], indent, sort_keys, depth + 1, line);
            }
            if (indent >= 0)
                json_newline(c, b, indent, depth);
            jbuf_putc(c, b, '}');
            return;
        }
        break;
    default:
        break;
    }
    jerr(c, KVR_EFORMAT, line, "Object of type %s is not JSON serializable", jv_type_name(v));
}

struct jval jv_from_json(struct jctx *c, const json_t *j, uint32_t depth)
{
    if (depth > c->t->lim.max_depth)
        jerr(c, KVR_ERANGE, 0, "variables nested deeper than %u", (unsigned)c->t->lim.max_depth);
    jcharge(c, 1, 0);
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        struct jdict *d = jdict_new(&c->ar, (uint32_t)json_object_size(j) + 1);
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)j, k, x)
        {
            struct jval kv = jv_str(&c->ar, k, strlen(k));
            struct jval xv = jv_from_json(c, x, depth + 1);
            d->k[d->n] = kv;
            d->v[d->n] = xv;
            d->n++;
        }
        return (struct jval){.t = JT_DICT, .u.d = d};
    }
    case JSON_ARRAY: {
        size_t n = json_array_size(j);
        if (n >= UINT32_MAX)
            jerr(c, KVR_ERANGE, 0, "array too long");
        struct jlist *l = jlist_new(&c->ar, (uint32_t)n + 1);
        for (size_t i = 0; i < n; i++)
            jlist_push(&c->ar, l, jv_from_json(c, json_array_get(j, i), depth + 1));
        return (struct jval){.t = JT_LIST, .u.l = l};
    }
    case JSON_STRING:
        return jv_str(&c->ar, json_string_value(j), json_string_length(j));
    case JSON_INTEGER:
        return jv_int((int64_t)json_integer_value(j));
    case JSON_REAL:
        return jv_float(json_real_value(j));
    case JSON_TRUE:
        return jv_bool(true);
    case JSON_FALSE:
        return jv_bool(false);
    default:
        return jv_none();
    }
}

/* ---- truth, equality, order --------------------------------------------------------------- */

const char *jv_type_name(struct jval v)
{
    static const char *const names[JT_COUNT] = {
        [JT_UNDEF] = "Undefined", [JT_NONE] = "NoneType",    [JT_BOOL] = "bool", [JT_INT] = "int",
        [JT_FLOAT] = "float",     [JT_STR] = "str",          [JT_LIST] = "list", [JT_DICT] = "dict",
        [JT_FUNC] = "function",   [JT_LOOP] = "LoopContext",
    };
    if (v.t == JT_LIST && v.u.l->tuple)
        return "tuple";
    if (v.t == JT_DICT && v.u.d->ns)
        return "Namespace";
    return v.t < JT_COUNT ? names[v.t] : "?";
}

bool jv_truthy(struct jctx *c, struct jval v)
{
    switch (v.t) {
    case JT_UNDEF:
    case JT_NONE:
        return false;
    case JT_BOOL:
        return v.u.b;
    case JT_INT:
        return v.u.i != 0;
    case JT_FLOAT:
        return v.u.f != 0;
    case JT_STR:
        return v.u.s->len > 0;
    case JT_LIST:
        return v.u.l->n > 0;
    case JT_DICT:
        return v.u.d->ns || v.u.d->n > 0;
    default:
        return true;
    }
}

static bool is_num(struct jval v)
{
    return v.t == JT_BOOL || v.t == JT_INT || v.t == JT_FLOAT;
}

static double num_f(struct jval v)
{
    return v.t == JT_FLOAT ? v.u.f : v.t == JT_INT ? (double)v.u.i : (double)v.u.b;
}

static int64_t num_i(struct jval v)
{
    return v.t == JT_INT ? v.u.i : (int64_t)v.u.b;
}

bool jv_equal(struct jctx *c, struct jval a, struct jval b)
{
    if (is_num(a) && is_num(b)) {
        if (a.t == JT_FLOAT || b.t == JT_FLOAT)
            return num_f(a) == num_f(b);
        return num_i(a) == num_i(b);
    }
    if (a.t != b.t)
        return false;
    switch (a.t) {
    case JT_UNDEF:
    case JT_NONE:
        return true;
    case JT_STR:
        jcharge(c, a.u.s->len / 256, 0);
        return a.u.s->len == b.u.s->len && !memcmp(a.u.s->s, b.u.s->s, a.u.s->len);
    case JT_LIST:
        if (a.u.l->tuple != b.u.l->tuple || a.u.l->n != b.u.l->n)
            return false;
        for (uint32_t i = 0; i < a.u.l->n; i++) {
            jcharge(c, 1, 0);
            if (!jv_equal(c, a.u.l->v[i], b.u.l->v[i]))
                return false;
        }
        return true;
    case JT_DICT:
        if (a.u.d->ns || b.u.d->ns)
            return a.u.d == b.u.d;
        if (a.u.d->n != b.u.d->n)
            return false;
        for (uint32_t i = 0; i < a.u.d->n; i++) {
            int64_t j = jdict_find(c, b.u.d, a.u.d->k[i]);
            if (j < 0 || !jv_equal(c, a.u.d->v[i], b.u.d->v[j]))
                return false;
        }
        return true;
    case JT_FUNC:
        return a.u.fn == b.u.fn;
    case JT_LOOP:
        return a.u.loop == b.u.loop;
    default:
        return false;
    }
}

int jv_compare(struct jctx *c, struct jval a, struct jval b, uint32_t line)
{
    if (is_num(a) && is_num(b)) {
        if (a.t == JT_FLOAT || b.t == JT_FLOAT) {
            double x = num_f(a), y = num_f(b);
            return x < y ? -1 : x > y ? 1 : 0;
        }
        int64_t x = num_i(a), y = num_i(b);
        return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.t == JT_STR && b.t == JT_STR) {
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        jcharge(c, n / 256, line);
        int r = memcmp(a.u.s->s, b.u.s->s, n);
        if (r)
            return r < 0 ? -1 : 1;
        return a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len ? 1 : 0;
    }
    if (a.t == JT_LIST && b.t == JT_LIST && a.u.l->tuple == b.u.l->tuple) {
        for (uint32_t i = 0; i < a.u.l->n && i < b.u.l->n; i++) {
            jcharge(c, 1, line);
            if (!jv_equal(c, a.u.l->v[i], b.u.l->v[i]))
                return jv_compare(c, a.u.l->v[i], b.u.l->v[i], line);
        }
        return a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n ? 1 : 0;
    }
    jerr(c, KVR_EFORMAT, line, "'<' not supported between instances of '%s' and '%s'",
         jv_type_name(a), jv_type_name(b));
}

int64_t jv_len(struct jctx *c, struct jval v)
{
    switch (v.t) {
    case JT_UNDEF:
        return 0;
    case JT_STR:
        jcharge(c, v.u.s->len / 256, 0);
        return (int64_t)ju_count(v.u.s->s, v.u.s->len);
    case JT_LIST:
        return v.u.l->n;
    case JT_DICT:
        return v.u.d->ns ? -1 : (int64_t)v.u.d->n;
    default:
        return -1;
    }
}

struct jlist *jv_iter(struct jctx *c, struct jval v, uint32_t line)
{
    switch (v.t) {
    case JT_UNDEF:
        return jlist_new(&c->ar, 1);
    case JT_LIST:
        return v.u.l;
    case JT_DICT:
        if (!v.u.d->ns) {
            struct jlist *l = jlist_new(&c->ar, v.u.d->n + 1);
            memcpy(l->v, v.u.d->k, v.u.d->n * sizeof *l->v);
            l->n = v.u.d->n;
            return l;
        }
        break;
    case JT_STR: {
        const struct jstr *s = v.u.s;
        struct jlist *l = jlist_new(&c->ar, (uint32_t)(s->len < UINT32_MAX - 1 ? s->len + 1 : 1));
        for (size_t i = 0; i < s->len;) {
            uint32_t cp;
            size_t n = ju_decode(s->s, s->len, i, &cp);
            jlist_push(&c->ar, l, jv_str(&c->ar, s->s + i, n));
            i += n;
        }
        return l;
    }
    default:
        break;
    }
    jerr(c, KVR_EFORMAT, line, "'%s' object is not iterable", jv_type_name(v));
}
