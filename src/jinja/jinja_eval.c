/* jinja_eval.c - running a parsed template (see jinja.h and jinja_int.h).
 *
 * Scopes follow Jinja's rules: a for loop and a macro call open a scope, `if` does not;
 * `set` writes the innermost scope, so a value set inside a loop is gone after it (which
 * is why templates use namespace()). A macro sees its parameters and the template's
 * top-level names. Every node evaluated and every loop iteration is one step. */
#include "jinja/jinja_int.h"

#include "core/alloc.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

struct jscope {
    struct jscope *parent;
    uint32_t n, cap;
    const struct jstr **names;
    struct jval *vals;
};

_Noreturn void jerr(struct jctx *c, int code, uint32_t line, const char *fmt, ...)
{
    char msg[KVR_ERR_MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    jfail_at(&c->fail, code, line, "%s", msg);
}

void jcharge(struct jctx *c, uint64_t n, uint32_t line)
{
    c->steps += n;
    if (c->steps > c->t->lim.max_steps)
        jerr(c, KVR_ERANGE, line, "evaluation step limit (%llu) reached",
             (unsigned long long)c->t->lim.max_steps);
}

/* ---- scopes --------------------------------------------------------------------------- */

static struct jscope *scope_push(struct jctx *c, struct jscope *parent)
{
    struct jscope *s = ja_alloc(&c->ar, sizeof *s);
    s->parent = parent;
    return s;
}

static void scope_set(struct jctx *c, struct jscope *s, const struct jstr *name, struct jval v)
{
    for (uint32_t i = 0; i < s->n; i++)
        if (s->names[i]->len == name->len && !memcmp(s->names[i]->s, name->s, name->len)) {
            s->vals[i] = v;
            return;
        }
    if (s->n == s->cap) {
        uint32_t cap = s->cap ? s->cap * 2 : 8;
        const struct jstr **nn = ja_alloc_array(&c->ar, cap, sizeof *nn);
        struct jval *nv = ja_alloc_array(&c->ar, cap, sizeof *nv);
        if (s->n) {
            memcpy(nn, s->names, s->n * sizeof *nn);
            memcpy(nv, s->vals, s->n * sizeof *nv);
        }
        s->names = nn;
        s->vals = nv;
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n] = v;
    s->n++;
}

static struct jval func(struct jctx *c, enum jfunc_kind kind)
{
    struct jfunc *f = ja_alloc(&c->ar, sizeof *f);
    f->kind = kind;
    return (struct jval){.t = JT_FUNC, .u.fn = f};
}

static struct jval lookup(struct jctx *c, const struct jstr *name)
{
    for (const struct jscope *s = c->scope; s; s = s->parent) {
        jcharge(c, s->n / 16, 0);
        for (uint32_t i = s->n; i-- > 0;)
            if (s->names[i]->len == name->len && !memcmp(s->names[i]->s, name->s, name->len))
                return s->vals[i];
    }
    if (!strcmp(name->s, "range"))
        return func(c, JF_RANGE);
    if (!strcmp(name->s, "namespace"))
        return func(c, JF_NAMESPACE);
    if (!strcmp(name->s, "dict"))
        return func(c, JF_DICT);
    if (!strcmp(name->s, "raise_exception"))
        return func(c, JF_RAISE);
    if (!strcmp(name->s, "strftime_now") && c->now)
        return func(c, JF_STRFTIME);
    return jv_undef((struct jstr *)name);
}

_Noreturn static void undefined_error(struct jctx *c, struct jval v, uint32_t line)
{
    if (v.u.s)
        jerr(c, KVR_EFORMAT, line, "'%.100s' is undefined", v.u.s->s);
    jerr(c, KVR_EFORMAT, line, "an undefined value was used");
}

static void need_defined(struct jctx *c, struct jval v, uint32_t line)
{
    if (v.t == JT_UNDEF)
        undefined_error(c, v, line);
}

/* ---- attribute and item access ---------------------------------------------------------- */

static struct jval method(struct jctx *c, struct jval self, const struct jstr *name)
{
    struct jval f = func(c, JF_METHOD);
    f.u.fn->self = self;
    f.u.fn->name = name;
    return f;
}

static struct jval loop_attr(struct jctx *c, const struct jloop *l, const char *name)
{
    int64_t i = l->index0, n = l->length;
    if (!strcmp(name, "index"))
        return jv_int(i + 1);
    if (!strcmp(name, "index0"))
        return jv_int(i);
    if (!strcmp(name, "revindex"))
        return jv_int(n - i);
    if (!strcmp(name, "revindex0"))
        return jv_int(n - i - 1);
    if (!strcmp(name, "first"))
        return jv_bool(i == 0);
    if (!strcmp(name, "last"))
        return jv_bool(i == n - 1);
    if (!strcmp(name, "length"))
        return jv_int(n);
    if (!strcmp(name, "depth"))
        return jv_int(l->depth);
    if (!strcmp(name, "depth0"))
        return jv_int((int64_t)l->depth - 1);
    if (!strcmp(name, "previtem"))
        return i > 0 ? l->items->v[i - 1] : jv_undef(NULL);
    if (!strcmp(name, "nextitem"))
        return i + 1 < n ? l->items->v[i + 1] : jv_undef(NULL);
    if (!strcmp(name, "cycle")) {
        struct jval f = func(c, JF_CYCLE);
        f.u.fn->self = (struct jval){.t = JT_LOOP, .u.loop = (struct jloop *)l};
        return f;
    }
    return jv_undef(NULL);
}

struct jval jget_attr(struct jctx *c, struct jval obj, const struct jstr *name, uint32_t line)
{
    switch (obj.t) {
    case JT_UNDEF:
        undefined_error(c, obj, line);
    case JT_DICT: {
        if (!obj.u.d->ns && jmethod_exists(obj, name->s))
            return method(c, obj, name);
        int64_t i = jdict_find_str(c, obj.u.d, name->s, name->len);
        return i >= 0 ? obj.u.d->v[i] : jv_undef((struct jstr *)name);
    }
    case JT_STR:
    case JT_LIST:
        if (jmethod_exists(obj, name->s))
            return method(c, obj, name);
        return jv_undef((struct jstr *)name);
    case JT_LOOP:
        return loop_attr(c, obj.u.loop, name->s);
    default:
        return jv_undef((struct jstr *)name);
    }
}

static int64_t index_of(struct jval key, bool *ok)
{
    *ok = key.t == JT_INT || key.t == JT_BOOL;
    return key.t == JT_INT ? key.u.i : key.t == JT_BOOL ? key.u.b : 0;
}

struct jval jget_item(struct jctx *c, struct jval obj, struct jval key, uint32_t line)
{
    bool ok;
    int64_t i;
    switch (obj.t) {
    case JT_UNDEF:
        undefined_error(c, obj, line);
    case JT_DICT:
        if (!obj.u.d->ns) {
            int64_t k = jdict_find(c, obj.u.d, key);
            if (k >= 0)
                return obj.u.d->v[k];
        }
        break;
    case JT_LIST:
        i = index_of(key, &ok);
        if (ok) {
            if (i < 0)
                i += obj.u.l->n;
            return i >= 0 && i < obj.u.l->n ? obj.u.l->v[i] : jv_undef(NULL);
        }
        break;
    case JT_STR:
        i = index_of(key, &ok);
        if (ok) {
            const struct jstr *s = obj.u.s;
            int64_t n = (int64_t)ju_count(s->s, s->len);
            jcharge(c, s->len / 256, line);
            if (i < 0)
                i += n;
            if (i < 0 || i >= n)
                return jv_undef(NULL);
            size_t at = 0;
            uint32_t cp;
            for (int64_t k = 0; k < i; k++)
                at += ju_decode(s->s, s->len, at, &cp);
            return jv_str(&c->ar, s->s + at, ju_decode(s->s, s->len, at, &cp));
        }
        break;
    default:
        break;
    }
    if (key.t == JT_STR)
        return jget_attr(c, obj, key.u.s, line);
    return jv_undef(NULL);
}

/* Python's slice.indices(): clamp start and stop for a sequence of n items. */
static void slice_bounds(struct jctx *c, int64_t n, const struct jval *sv, int64_t *start,
                         int64_t *stop, int64_t *step, uint32_t line)
{
    bool ok = true;
    *step = 1;
    if (sv[2].t != JT_NONE) {
        *step = index_of(sv[2], &ok);
        if (!ok || *step == 0)
            jerr(c, KVR_EFORMAT, line, "slice step must be a non-zero integer");
    }
    int64_t lo = *step < 0 ? -1 : 0, hi = *step < 0 ? n - 1 : n;
    for (int k = 0; k < 2; k++) {
        int64_t *out = k ? stop : start;
        if (sv[k].t == JT_NONE) {
            *out = (*step < 0) == (k == 0) ? hi : lo;
            continue;
        }
        int64_t v = index_of(sv[k], &ok);
        if (!ok)
            jerr(c, KVR_EFORMAT, line, "slice indices must be integers or None");
        if (v < 0) {
            v += n;
            if (v < lo)
                v = lo;
        } else if (v > hi) {
            v = hi;
        }
        *out = v;
    }
}

static struct jval eval(struct jctx *c, const struct jnode *n);

static struct jval eval_slice(struct jctx *c, const struct jnode *n)
{
    struct jval obj = eval(c, n->a);
    struct jval sv[3];
    const struct jnode *parts[3] = {n->b, n->c, n->d};
    for (int k = 0; k < 3; k++)
        sv[k] = parts[k] ? eval(c, parts[k]) : jv_none();
    need_defined(c, obj, n->line);
    int64_t start, stop, step;
    if (obj.t == JT_LIST) {
        slice_bounds(c, obj.u.l->n, sv, &start, &stop, &step, n->line);
        struct jlist *l = jlist_new(&c->ar, 4);
        l->tuple = obj.u.l->tuple;
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            jcharge(c, 1, n->line);
            jlist_push(&c->ar, l, obj.u.l->v[i]);
        }
        return (struct jval){.t = JT_LIST, .u.l = l};
    }
    if (obj.t == JT_STR) {
        const struct jstr *s = obj.u.s;
        jcharge(c, s->len / 64, n->line);
        size_t count = ju_count(s->s, s->len);
        size_t *offs = ja_alloc_array(&c->ar, count + 1, sizeof *offs);
        size_t at = 0;
        uint32_t cp;
        for (size_t i = 0; i < count; i++) {
            offs[i] = at;
            at += ju_decode(s->s, s->len, at, &cp);
        }
        offs[count] = s->len;
        slice_bounds(c, (int64_t)count, sv, &start, &stop, &step, n->line);
        struct jbuf b = {.max = c->t->lim.max_output_bytes};
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
            jbuf_put(c, &b, s->s + offs[i], offs[i + 1] - offs[i]);
        return jv_str(&c->ar, b.p ? b.p : "", b.len);
    }
    /* jinja2 answers a failed subscript with Undefined. */
    return jv_undef(NULL);
}

/* ---- operators ---------------------------------------------------------------------------- */

static bool is_num(struct jval v)
{
    return v.t == JT_BOOL || v.t == JT_INT || v.t == JT_FLOAT;
}
static double as_f(struct jval v)
{
    return v.t == JT_FLOAT ? v.u.f : v.t == JT_INT ? (double)v.u.i : (double)v.u.b;
}
static int64_t as_i(struct jval v)
{
    return v.t == JT_INT ? v.u.i : (int64_t)v.u.b;
}

_Noreturn static void type_error(struct jctx *c, const char *op, struct jval a, struct jval b,
                                 uint32_t line)
{
    jerr(c, KVR_EFORMAT, line, "unsupported operand type(s) for %s: '%s' and '%s'", op,
         jv_type_name(a), jv_type_name(b));
}

static struct jval repeat(struct jctx *c, struct jval seq, int64_t times, uint32_t line)
{
    if (times < 0)
        times = 0;
    if (seq.t == JT_STR) {
        struct jbuf b = {.max = c->t->lim.max_output_bytes};
        for (int64_t i = 0; i < times && seq.u.s->len; i++) {
            jcharge(c, 1, line);
            jbuf_put(c, &b, seq.u.s->s, seq.u.s->len);
        }
        return jv_str(&c->ar, b.p ? b.p : "", b.len);
    }
    struct jlist *l = jlist_new(&c->ar, 4);
    l->tuple = seq.u.l->tuple;
    for (int64_t i = 0; i < times && seq.u.l->n; i++)
        for (uint32_t k = 0; k < seq.u.l->n; k++) {
            jcharge(c, 1, line);
            jlist_push(&c->ar, l, seq.u.l->v[k]);
        }
    return (struct jval){.t = JT_LIST, .u.l = l};
}

/* Python's integer arithmetic on 64-bit integers: overflow is an error, / gives a float,
 * // and % round toward negative infinity. */
static struct jval arith_int(struct jctx *c, enum jop op, int64_t x, int64_t y, uint32_t line)
{
    int64_t r = 0;
    bool ovf = false;
    switch (op) {
    case OP_ADD:
        ovf = __builtin_add_overflow(x, y, &r);
        break;
    case OP_SUB:
        ovf = __builtin_sub_overflow(x, y, &r);
        break;
    case OP_MUL:
        ovf = __builtin_mul_overflow(x, y, &r);
        break;
    case OP_DIV:
        if (!y)
            jerr(c, KVR_EFORMAT, line, "division by zero");
        return jv_float((double)x / (double)y);
    case OP_FLOORDIV:
    case OP_MOD:
        if (!y)
            jerr(c, KVR_EFORMAT, line, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) {
            ovf = op == OP_FLOORDIV;
            break;
        }
        r = op == OP_FLOORDIV ? x / y : x % y;
        if ((x % y != 0) && ((x < 0) != (y < 0)))
            r = op == OP_FLOORDIV ? r - 1 : r + y;
        break;
    case OP_POW:
        if (y < 0)
            return jv_float(pow((double)x, (double)y));
        r = 1;
        for (int64_t i = 0; i < y && !ovf; i++) {
            jcharge(c, 1, line);
            ovf = __builtin_mul_overflow(r, x, &r);
            if (r == 0 || r == 1)
                break;
        }
        if (x == -1)
            r = (y % 2) ? -1 : 1;
        break;
    default:
        break;
    }
    if (ovf)
        jerr(c, KVR_ERANGE, line, "integer overflow (integers are 64-bit)");
    return jv_int(r);
}

/* Python's float arithmetic (a or b is a float); a and b name the operands in errors. */
static struct jval arith_float(struct jctx *c, enum jop op, struct jval a, struct jval b,
                               uint32_t line)
{
    double x = as_f(a), y = as_f(b);
    switch (op) {
    case OP_ADD:
        return jv_float(x + y);
    case OP_SUB:
        return jv_float(x - y);
    case OP_MUL:
        return jv_float(x * y);
    case OP_DIV:
        if (y == 0)
            jerr(c, KVR_EFORMAT, line, "float division by zero");
        return jv_float(x / y);
    case OP_FLOORDIV:
    case OP_MOD: {
        if (y == 0)
            jerr(c, KVR_EFORMAT, line, "float modulo or division by zero");
        double m = fmod(x, y);
        if (m != 0 && ((m < 0) != (y < 0)))
            m += y;
        return jv_float(op == OP_MOD ? m : floor((x - m) / y + 0.5));
    }
    case OP_POW:
        return jv_float(pow(x, y));
    default:
        type_error(c, "?", a, b, line);
    }
}

static struct jval arith(struct jctx *c, enum jop op, struct jval a, struct jval b, uint32_t line)
{
    static const char *const names[OP_COUNT] = {
        [OP_ADD] = "+",       [OP_SUB] = "-", [OP_MUL] = "*",  [OP_DIV] = "/",
        [OP_FLOORDIV] = "//", [OP_MOD] = "%", [OP_POW] = "**",
    };
    if (op == OP_MOD && a.t == JT_STR) /* an undefined value formats as "" */
        return jpy_percent(c, a.u.s, b, line);
    need_defined(c, a, line);
    need_defined(c, b, line);
    if (op == OP_ADD && a.t == JT_STR && b.t == JT_STR) {
        struct jbuf buf = {.max = c->t->lim.max_output_bytes};
        jbuf_put(c, &buf, a.u.s->s, a.u.s->len);
        jbuf_put(c, &buf, b.u.s->s, b.u.s->len);
        return jv_str(&c->ar, buf.p ? buf.p : "", buf.len);
    }
    if (op == OP_ADD && a.t == JT_LIST && b.t == JT_LIST && a.u.l->tuple == b.u.l->tuple) {
        struct jlist *l = jlist_new(&c->ar, a.u.l->n + b.u.l->n + 1);
        l->tuple = a.u.l->tuple;
        jcharge(c, l->cap / 16, line);
        memcpy(l->v, a.u.l->v, a.u.l->n * sizeof *l->v);
        memcpy(l->v + a.u.l->n, b.u.l->v, b.u.l->n * sizeof *l->v);
        l->n = a.u.l->n + b.u.l->n;
        return (struct jval){.t = JT_LIST, .u.l = l};
    }
    if (op == OP_MUL && (a.t == JT_STR || a.t == JT_LIST) && (b.t == JT_INT || b.t == JT_BOOL))
        return repeat(c, a, as_i(b), line);
    if (op == OP_MUL && (b.t == JT_STR || b.t == JT_LIST) && (a.t == JT_INT || a.t == JT_BOOL))
        return repeat(c, b, as_i(a), line);
    if (!is_num(a) || !is_num(b))
        type_error(c, names[op] ? names[op] : "?", a, b, line);
    if (a.t != JT_FLOAT && b.t != JT_FLOAT)
        return arith_int(c, op, as_i(a), as_i(b), line);
    return arith_float(c, op, a, b, line);
}

static bool contains(struct jctx *c, struct jval hay, struct jval needle, uint32_t line)
{
    switch (hay.t) {
    case JT_UNDEF:
        return false;
    case JT_STR: {
        if (needle.t != JT_STR)
            jerr(c, KVR_EFORMAT, line, "'in <string>' requires string as left operand, not %s",
                 jv_type_name(needle));
        const struct jstr *h = hay.u.s, *x = needle.u.s;
        jcharge(c, h->len / 64, line);
        if (!x->len)
            return true;
        for (size_t i = 0; i + x->len <= h->len; i++)
            if (!memcmp(h->s + i, x->s, x->len))
                return true;
        return false;
    }
    case JT_LIST:
        for (uint32_t i = 0; i < hay.u.l->n; i++) {
            jcharge(c, 1, line);
            if (jv_equal(c, hay.u.l->v[i], needle))
                return true;
        }
        return false;
    case JT_DICT:
        if (!hay.u.d->ns)
            return jdict_find(c, hay.u.d, needle) >= 0;
        break;
    default:
        break;
    }
    jerr(c, KVR_EFORMAT, line, "argument of type '%s' is not iterable", jv_type_name(hay));
}

static bool compare(struct jctx *c, enum jop op, struct jval a, struct jval b, uint32_t line)
{
    switch (op) {
    case OP_EQ:
        return jv_equal(c, a, b);
    case OP_NE:
        return !jv_equal(c, a, b);
    case OP_IN:
        return contains(c, b, a, line);
    case OP_NOTIN:
        return !contains(c, b, a, line);
    default:
        break;
    }
    need_defined(c, a, line);
    need_defined(c, b, line);
    int r = jv_compare(c, a, b, line);
    switch (op) {
    case OP_LT:
        return r < 0;
    case OP_LE:
        return r <= 0;
    case OP_GT:
        return r > 0;
    default:
        return r >= 0;
    }
}

/* ---- calls ------------------------------------------------------------------------------- */

const struct jval *jargs_get(const struct jargs *a, int i, const char *name)
{
    for (uint32_t k = 0; name && k < a->n_kw; k++)
        if (!strcmp(a->kw_name[k]->s, name))
            return &a->kw[k];
    if (i >= 0 && (uint32_t)i < a->n_pos)
        return &a->pos[i];
    return NULL;
}

static void eval_args(struct jctx *c, const struct jnode *n, struct jargs *a)
{
    a->n_pos = a->n_kw = 0;
    for (uint32_t i = 0; i < n->n_kids && i < 16; i++) {
        const struct jnode *k = n->kids[i];
        if (k->kind == N_KWARG) {
            a->kw_name[a->n_kw] = k->val.u.s;
            a->kw[a->n_kw++] = eval(c, k->a);
        } else {
            a->pos[a->n_pos++] = eval(c, k);
        }
    }
}

static void exec(struct jctx *c, const struct jnode *n, struct jbuf *out);

static struct jval call_macro(struct jctx *c, const struct jnode *m, const struct jargs *a,
                              uint32_t line)
{
    if (a->n_pos > m->n_kids)
        jerr(c, KVR_EFORMAT, line, "macro '%s' takes not more than %u argument(s)", m->val.u.s->s,
             (unsigned)m->n_kids);
    for (uint32_t k = 0; k < a->n_kw; k++) {
        bool known = false;
        for (uint32_t i = 0; i < m->n_kids; i++)
            known |= !strcmp(m->kids[i]->val.u.s->s, a->kw_name[k]->s);
        if (!known)
            jerr(c, KVR_EFORMAT, line, "macro '%s' has no parameter '%s'", m->val.u.s->s,
                 a->kw_name[k]->s);
    }
    if (++c->depth > c->t->lim.max_depth)
        jerr(c, KVR_ERANGE, line, "macro calls nested deeper than %u",
             (unsigned)c->t->lim.max_depth);
    struct jscope *saved = c->scope;
    int saved_ctl = c->loop_ctl;
    c->scope = scope_push(c, c->root);
    for (uint32_t i = 0; i < m->n_kids; i++) {
        const struct jnode *p = m->kids[i];
        const struct jval *v = jargs_get(a, (int)i, p->val.u.s->s);
        struct jval val = v ? *v : p->kind == N_KWARG ? eval(c, p->a) : jv_undef(p->val.u.s);
        scope_set(c, c->scope, p->val.u.s, val);
    }
    struct jbuf b = {.max = c->t->lim.max_output_bytes};
    exec(c, m->b, &b);
    c->scope = saved;
    c->loop_ctl = saved_ctl;
    c->depth--;
    return jv_str(&c->ar, b.p ? b.p : "", b.len);
}

static struct jval call_range(struct jctx *c, const struct jargs *a, uint32_t line)
{
    int64_t v[3] = {0, 0, 1};
    if (a->n_pos < 1 || a->n_pos > 3 || a->n_kw)
        jerr(c, KVR_EFORMAT, line, "range expects 1 to 3 integer arguments");
    for (uint32_t i = 0; i < a->n_pos; i++) {
        if (a->pos[i].t != JT_INT && a->pos[i].t != JT_BOOL)
            jerr(c, KVR_EFORMAT, line, "'%s' object cannot be interpreted as an integer",
                 jv_type_name(a->pos[i]));
        v[a->n_pos == 1 ? 1 : i] = as_i(a->pos[i]);
    }
    if (!v[2])
        jerr(c, KVR_EFORMAT, line, "range() arg 3 must not be zero");
    struct jlist *l = jlist_new(&c->ar, 8);
    for (int64_t x = v[0]; v[2] > 0 ? x < v[1] : x > v[1];) {
        if (l->n >= 100000)
            jerr(c, KVR_ERANGE, line, "range too big, maximum size for range is 100000");
        jcharge(c, 1, line);
        jlist_push(&c->ar, l, jv_int(x));
        if (__builtin_add_overflow(x, v[2], &x))
            break;
    }
    return (struct jval){.t = JT_LIST, .u.l = l};
}

static struct jval make_dict(struct jctx *c, const struct jargs *a, bool ns, uint32_t line)
{
    struct jdict *d = jdict_new(&c->ar, 8);
    d->ns = ns;
    if (a->n_pos > 1)
        jerr(c, KVR_EFORMAT, line, "expected at most 1 positional argument");
    if (a->n_pos == 1) {
        if (a->pos[0].t != JT_DICT || a->pos[0].u.d->ns)
            jerr(c, KVR_EFORMAT, line, "expected a dict, not %s", jv_type_name(a->pos[0]));
        for (uint32_t i = 0; i < a->pos[0].u.d->n; i++)
            jdict_set(c, d, a->pos[0].u.d->k[i], a->pos[0].u.d->v[i]);
    }
    for (uint32_t i = 0; i < a->n_kw; i++)
        jdict_set(c, d, (struct jval){.t = JT_STR, .u.s = (struct jstr *)a->kw_name[i]}, a->kw[i]);
    return (struct jval){.t = JT_DICT, .u.d = d};
}

struct jval jcall(struct jctx *c, struct jval fn, const struct jargs *a, uint32_t line)
{
    if (fn.t == JT_UNDEF)
        undefined_error(c, fn, line);
    if (fn.t != JT_FUNC)
        jerr(c, KVR_EFORMAT, line, "'%s' object is not callable", jv_type_name(fn));
    const struct jfunc *f = fn.u.fn;
    switch (f->kind) {
    case JF_RANGE:
        return call_range(c, a, line);
    case JF_NAMESPACE:
        return make_dict(c, a, true, line);
    case JF_DICT:
        return make_dict(c, a, false, line);
    case JF_RAISE: {
        struct jval msg = a->n_pos ? jv_to_str(c, a->pos[0]) : jv_str(&c->ar, "", 0);
        jerr(c, KVR_EINVAL, line, "%s", msg.u.s->s);
    }
    case JF_STRFTIME: {
        if (a->n_pos != 1 || a->pos[0].t != JT_STR)
            jerr(c, KVR_EFORMAT, line, "strftime_now expects one format string");
        char buf[512];
        /* The format is the template's: strftime reads it like any format string, with
         * the output bounded by the buffer. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
        size_t n = a->pos[0].u.s->len ? strftime(buf, sizeof buf, a->pos[0].u.s->s, c->now) : 0;
#pragma GCC diagnostic pop
        return jv_str(&c->ar, buf, n);
    }
    case JF_CYCLE: {
        if (!a->n_pos)
            jerr(c, KVR_EFORMAT, line, "no items for cycling given");
        return a->pos[f->self.u.loop->index0 % a->n_pos];
    }
    case JF_MACRO:
        return call_macro(c, f->macro, a, line);
    case JF_METHOD:
        return jmethod_call(c, f->self, f->name, a, line);
    default:
        jerr(c, KVR_EFORMAT, line, "not callable");
    }
}

/* ---- expressions -------------------------------------------------------------------------- */

static struct jval eval_list(struct jctx *c, const struct jnode *n, bool tuple)
{
    struct jlist *l = jlist_new(&c->ar, n->n_kids + 1);
    l->tuple = tuple;
    for (uint32_t i = 0; i < n->n_kids; i++)
        jlist_push(&c->ar, l, eval(c, n->kids[i]));
    return (struct jval){.t = JT_LIST, .u.l = l};
}

/* Unary - and +: numbers only, a bool counts as 0 or 1. */
static struct jval eval_sign(struct jctx *c, const struct jnode *n)
{
    struct jval r = eval(c, n->a);
    need_defined(c, r, n->line);
    if (!is_num(r))
        jerr(c, KVR_EFORMAT, n->line, "bad operand type for unary %c: '%s'",
             n->kind == N_NEG ? '-' : '+', jv_type_name(r));
    if (r.t == JT_BOOL)
        r = jv_int(r.u.b);
    if (n->kind == N_NEG) {
        if (r.t == JT_FLOAT)
            r.u.f = -r.u.f;
        else if (r.u.i == INT64_MIN)
            jerr(c, KVR_ERANGE, n->line, "integer overflow (integers are 64-bit)");
        else
            r.u.i = -r.u.i;
    }
    return r;
}

/* A chain a < b < c: each operand evaluated once, stopping at the first false link. */
static struct jval eval_compare(struct jctx *c, const struct jnode *n)
{
    struct jval left = eval(c, n->a);
    for (uint32_t i = 0; i < n->n_kids; i++) {
        struct jval right = eval(c, n->kids[i]->a);
        if (!compare(c, (enum jop)n->kids[i]->op, left, right, n->kids[i]->line))
            return jv_bool(false);
        left = right;
    }
    return jv_bool(true);
}

/* A dict literal: keys and values in source order; lists and dicts cannot be keys. */
static struct jval eval_dict(struct jctx *c, const struct jnode *n)
{
    struct jdict *d = jdict_new(&c->ar, n->n_kids + 1);
    for (uint32_t i = 0; i < n->n_kids; i++) {
        struct jval k = eval(c, n->kids[i]->a);
        if (k.t == JT_LIST && !k.u.l->tuple)
            jerr(c, KVR_EFORMAT, n->line, "unhashable type: 'list'");
        if (k.t == JT_DICT)
            jerr(c, KVR_EFORMAT, n->line, "unhashable type: 'dict'");
        jdict_set(c, d, k, eval(c, n->kids[i]->b));
    }
    return (struct jval){.t = JT_DICT, .u.d = d};
}

static struct jval eval(struct jctx *c, const struct jnode *n)
{
    jcharge(c, 1, n->line);
    if (++c->depth > c->t->lim.max_depth * 2)
        jerr(c, KVR_ERANGE, n->line, "expressions nested too deeply");
    struct jval r;
    struct jargs args;
    switch (n->kind) {
    case N_CONST:
        r = n->val;
        break;
    case N_NAME:
        r = lookup(c, n->val.u.s);
        break;
    case N_ATTR:
        r = jget_attr(c, eval(c, n->a), n->val.u.s, n->line);
        break;
    case N_ITEM: {
        struct jval obj = eval(c, n->a);
        r = jget_item(c, obj, eval(c, n->b), n->line);
        break;
    }
    case N_SLICE:
        r = eval_slice(c, n);
        break;
    case N_CALL: {
        struct jval fn = eval(c, n->a);
        eval_args(c, n, &args);
        r = jcall(c, fn, &args, n->line);
        break;
    }
    case N_FILTER: {
        struct jval v = eval(c, n->a);
        eval_args(c, n, &args);
        r = jfilter(c, n->val.u.s, v, &args, n->line);
        break;
    }
    case N_TEST: {
        struct jval v = eval(c, n->a);
        eval_args(c, n, &args);
        r = jv_bool(jtest(c, n->val.u.s, v, &args, n->line) != n->flag);
        break;
    }
    case N_BIN: {
        struct jval a = eval(c, n->a);
        r = arith(c, (enum jop)n->op, a, eval(c, n->b), n->line);
        break;
    }
    case N_NEG:
    case N_POS:
        r = eval_sign(c, n);
        break;
    case N_NOT:
        r = jv_bool(!jv_truthy(c, eval(c, n->a)));
        break;
    case N_AND:
        r = eval(c, n->a);
        if (jv_truthy(c, r))
            r = eval(c, n->b);
        break;
    case N_OR:
        r = eval(c, n->a);
        if (!jv_truthy(c, r))
            r = eval(c, n->b);
        break;
    case N_CMP:
        r = eval_compare(c, n);
        break;
    case N_COND:
        if (jv_truthy(c, eval(c, n->a)))
            r = eval(c, n->b);
        else
            r = n->c ? eval(c, n->c) : jv_undef(NULL);
        break;
    case N_LIST:
        r = eval_list(c, n, false);
        break;
    case N_TUPLE:
        r = eval_list(c, n, true);
        break;
    case N_DICT:
        r = eval_dict(c, n);
        break;
    case N_CONCAT: {
        struct jbuf b = jbuf_new(c);
        for (uint32_t i = 0; i < n->n_kids; i++)
            jv_write_str(c, &b, eval(c, n->kids[i]));
        r = jv_buf(c, &b);
        break;
    }
    default:
        jerr(c, KVR_EFORMAT, n->line, "not an expression");
    }
    c->depth--;
    return r;
}

/* ---- statements ------------------------------------------------------------------------ */

static void assign(struct jctx *c, const struct jnode *target, struct jval v, uint32_t line)
{
    if (target->kind == N_NAME) {
        scope_set(c, c->scope, target->val.u.s, v);
        return;
    }
    if (target->kind == N_NSATTR) {
        struct jval ns = lookup(c, target->a->val.u.s);
        if (ns.t != JT_DICT || !ns.u.d->ns)
            jerr(c, KVR_EFORMAT, line, "cannot assign attribute on non-namespace object");
        jdict_set(c, ns.u.d, (struct jval){.t = JT_STR, .u.s = target->val.u.s}, v);
        return;
    }
    struct jlist *items = jv_iter(c, v, line);
    if (v.t == JT_UNDEF)
        undefined_error(c, v, line);
    if (items->n != target->n_kids)
        jerr(c, KVR_EFORMAT, line, "%s values to unpack (expected %u, got %u)",
             items->n > target->n_kids ? "too many" : "not enough", (unsigned)target->n_kids,
             (unsigned)items->n);
    for (uint32_t i = 0; i < target->n_kids; i++)
        scope_set(c, c->scope, target->kids[i]->val.u.s, items->v[i]);
}

static struct jval apply_filters(struct jctx *c, const struct jnode *n, struct jval v)
{
    struct jargs args;
    for (uint32_t i = 0; i < n->n_kids; i++) {
        eval_args(c, n->kids[i], &args);
        v = jfilter(c, n->kids[i]->val.u.s, v, &args, n->kids[i]->line);
    }
    return v;
}

static void exec_for(struct jctx *c, const struct jnode *n, struct jbuf *out)
{
    struct jval seq = eval(c, n->b);
    struct jlist *items = jv_iter(c, seq, n->line);
    struct jscope *saved = c->scope;
    c->scope = scope_push(c, saved);
    if (n->e) {
        struct jlist *kept = jlist_new(&c->ar, items->n + 1);
        for (uint32_t i = 0; i < items->n; i++) {
            jcharge(c, 1, n->line);
            assign(c, n->a, items->v[i], n->line);
            if (jv_truthy(c, eval(c, n->e)))
                jlist_push(&c->ar, kept, items->v[i]);
        }
        items = kept;
    }
    uint32_t depth = 1;
    const struct jstr *loop_name = jstr_new(&c->ar, "loop", 4);
    struct jval outer = lookup(c, loop_name);
    if (outer.t == JT_LOOP)
        depth = outer.u.loop->depth + 1;
    struct jloop *lp = ja_alloc(&c->ar, sizeof *lp);
    lp->items = items;
    lp->length = items->n;
    lp->depth = depth;
    scope_set(c, c->scope, loop_name, (struct jval){.t = JT_LOOP, .u.loop = lp});
    for (uint32_t i = 0; i < items->n; i++) {
        jcharge(c, 1, n->line);
        lp->index0 = i;
        assign(c, n->a, items->v[i], n->line);
        exec(c, n->c, out);
        if (c->loop_ctl == 1) {
            c->loop_ctl = 0;
            break;
        }
        c->loop_ctl = 0;
    }
    c->scope = saved;
    if (!items->n && n->d)
        exec(c, n->d, out);
}

static void exec(struct jctx *c, const struct jnode *n, struct jbuf *out)
{
    jcharge(c, 1, n->line);
    if (++c->depth > c->t->lim.max_depth * 2)
        jerr(c, KVR_ERANGE, n->line, "blocks nested too deeply");
    switch (n->kind) {
    case N_BODY:
        for (uint32_t i = 0; i < n->n_kids && !c->loop_ctl; i++)
            exec(c, n->kids[i], out);
        break;
    case N_TEXT:
        jbuf_put(c, out, n->val.u.s->s, n->val.u.s->len);
        break;
    case N_OUT:
        jv_write_str(c, out, eval(c, n->a));
        break;
    case N_IF:
        for (; n && n->kind == N_IF; n = n->c)
            if (jv_truthy(c, eval(c, n->a))) {
                exec(c, n->b, out);
                break;
            }
        if (n && n->kind != N_IF)
            exec(c, n, out);
        break;
    case N_FOR:
        exec_for(c, n, out);
        break;
    case N_SET:
        assign(c, n->a, eval(c, n->b), n->line);
        break;
    case N_SETBLOCK:
    case N_FILTERBLOCK: {
        struct jbuf b = {.max = c->t->lim.max_output_bytes};
        exec(c, n->b, &b);
        struct jval v = apply_filters(c, n, jv_str(&c->ar, b.p ? b.p : "", b.len));
        if (n->kind == N_SETBLOCK)
            assign(c, n->a, v, n->line);
        else
            jv_write_str(c, out, v);
        break;
    }
    case N_MACRO: {
        struct jval f = func(c, JF_MACRO);
        f.u.fn->macro = n;
        scope_set(c, c->scope, n->val.u.s, f);
        break;
    }
    case N_BREAK:
        c->loop_ctl = 1;
        break;
    case N_CONTINUE:
        c->loop_ctl = 2;
        break;
    default:
        jv_write_str(c, out, eval(c, n));
        break;
    }
    c->depth--;
}

/* ---- public API ---------------------------------------------------------------------------- */

void kvr_jinja_limits_default(struct kvr_jinja_limits *lim)
{
    lim->max_template_bytes = (size_t)1 << 20;
    lim->max_nodes = 200000;
    lim->max_depth = 100;
    lim->max_steps = 10000000;
    lim->max_output_bytes = (size_t)8 << 20;
    lim->max_memory_bytes = (size_t)64 << 20;
}

int kvr_jinja_parse(struct kvr_jinja **out, const char *src, size_t len,
                    const struct kvr_jinja_limits *lim, struct kvr_err *err)
{
    *out = NULL;
    struct kvr_jinja *t = kvr_calloc(1, sizeof *t);
    if (!t)
        return kvr_err_set(err, KVR_ENOMEM, "out of memory");
    if (lim)
        t->lim = *lim;
    else
        kvr_jinja_limits_default(&t->lim);
    if (t->lim.max_depth < 1)
        t->lim.max_depth = 1;
    if (len > t->lim.max_template_bytes) {
        size_t max = t->lim.max_template_bytes; /* read before t is freed */
        kvr_free(t);
        return kvr_err_set(err, KVR_ERANGE, "template of %zu bytes is larger than %zu", len, max);
    }
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t n = ju_decode(src, len, i, &cp);
        if (cp == 0xfffd && n == 1) {
            kvr_free(t);
            return kvr_err_set(err, KVR_EFORMAT, "template is not valid UTF-8 at byte %zu", i);
        }
        i += n;
    }
    t->fail.err = err;
    ja_init(&t->ar, t->lim.max_memory_bytes, &t->fail);
    if (setjmp(t->fail.jb)) {
        int code = t->fail.code;
        ja_fini(&t->ar);
        kvr_free(t);
        return code;
    }
    /* jinja2's defaults: \r\n and \r read as \n, and one trailing newline is dropped. */
    char *norm = ja_alloc(&t->ar, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n && norm[n - 1] == '\n')
        n--;
    struct jtoken *toks;
    uint32_t n_toks = jlex(&t->ar, &t->lim, norm, n, &toks);
    t->root = jparse(&t->ar, &t->lim, toks, n_toks);
    *out = t;
    return KVR_OK;
}

void kvr_jinja_destroy(struct kvr_jinja *t)
{
    if (!t)
        return;
    ja_fini(&t->ar);
    kvr_free(t);
}

int kvr_jinja_render(const struct kvr_jinja *t, const json_t *vars, const struct tm *now,
                     char **out, size_t *out_len, struct kvr_err *err)
{
    *out = NULL;
    if (out_len)
        *out_len = 0;
    if (vars && !json_is_object(vars))
        return kvr_err_set(err, KVR_EINVAL, "template variables must be a JSON object");
    struct jctx *c = kvr_calloc(1, sizeof *c);
    if (!c)
        return kvr_err_set(err, KVR_ENOMEM, "out of memory");
    c->t = t;
    c->now = now;
    c->fail.err = err;
    ja_init(&c->ar, t->lim.max_memory_bytes, &c->fail);
    if (setjmp(c->fail.jb)) {
        int code = c->fail.code;
        ja_fini(&c->ar);
        kvr_free(c);
        return code;
    }
    c->root = c->scope = scope_push(c, NULL);
    if (vars) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)vars, k, v)
        {
            scope_set(c, c->root, jstr_new(&c->ar, k, strlen(k)), jv_from_json(c, v, 0));
        }
    }
    struct jbuf b = {.max = t->lim.max_output_bytes};
    exec(c, t->root, &b);
    char *res = kvr_malloc(b.len + 1);
    if (!res) {
        ja_fini(&c->ar);
        kvr_free(c);
        return kvr_err_set(err, KVR_ENOMEM, "out of memory");
    }
    if (b.len)
        memcpy(res, b.p, b.len);
    res[b.len] = 0;
    *out = res;
    if (out_len)
        *out_len = b.len;
    ja_fini(&c->ar);
    kvr_free(c);
    return KVR_OK;
}
