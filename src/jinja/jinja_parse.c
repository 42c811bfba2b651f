/* jinja_parse.c - the Jinja parser: tokens to an AST (see jinja_int.h for the nodes).
 *
 * Recursive descent with Jinja's precedence, lowest first:
 *   a if b else c  <  or  <  and  <  not  <  comparisons (chained; in, not in)
 *   <  + -  <  ~  <  * / // %  <  **  <  unary - +  <  primary with . [] () then | and is
 * Note that ** is left-associative and binds looser than unary minus (-2**2 == 4), as in
 * Jinja and unlike Python. Recursion is bounded by limits.max_depth and the node count by
 * limits.max_nodes. */
#include "jinja/jinja_int.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

struct parser {
    struct jarena *ar;
    const struct kvr_jinja_limits *lim;
    const struct jtoken *t;
    uint32_t n, pos;
    uint32_t n_nodes, depth, loops;
};

struct kids {
    struct jnode **p;
    uint32_t n, cap;
};

_Noreturn static void pfail(struct parser *P, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
_Noreturn static void pfail(struct parser *P, const char *fmt, ...)
{
    char msg[KVR_ERR_MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    jfail_at(P->ar->fail, KVR_EFORMAT, P->t[P->pos].line, "%s", msg);
}

static const struct jtoken *peek(struct parser *P)
{
    return &P->t[P->pos];
}
static const struct jtoken *peek2(struct parser *P)
{
    return &P->t[P->pos + 1 < P->n ? P->pos + 1 : P->pos];
}

static const struct jtoken *next(struct parser *P)
{
    const struct jtoken *t = &P->t[P->pos];
    if (P->pos + 1 < P->n)
        P->pos++;
    return t;
}

static bool is_op(struct parser *P, enum jop op)
{
    return peek(P)->kind == T_OP && peek(P)->op == op;
}

static bool is_name(struct parser *P, const char *name)
{
    const struct jtoken *t = peek(P);
    return t->kind == T_NAME && !strcmp(t->s->s, name);
}

static bool skip_op(struct parser *P, enum jop op)
{
    if (!is_op(P, op))
        return false;
    next(P);
    return true;
}

static bool skip_name(struct parser *P, const char *name)
{
    if (!is_name(P, name))
        return false;
    next(P);
    return true;
}

static const char *op_text(enum jop op)
{
    static const char *const text[OP_COUNT] = {
        [OP_RPAREN] = ")", [OP_RBRACKET] = "]", [OP_RBRACE] = "}", [OP_COLON] = ":",
        [OP_ASSIGN] = "=", [OP_LPAREN] = "(",   [OP_COMMA] = ",",
    };
    return text[op] ? text[op] : "operator";
}

static void expect_op(struct parser *P, enum jop op)
{
    if (!skip_op(P, op))
        pfail(P, "expected '%s'", op_text(op));
}

static void expect(struct parser *P, enum jtok kind)
{
    if (peek(P)->kind != kind)
        pfail(P, "%s", kind == T_BLOCK_END ? "expected '%}'" : "expected '}}'");
    next(P);
}

static const struct jstr *expect_name(struct parser *P)
{
    if (peek(P)->kind != T_NAME)
        pfail(P, "%s", "expected a name");
    return next(P)->s;
}

static struct jnode *node(struct parser *P, enum jk kind, uint32_t line)
{
    if (++P->n_nodes > P->lim->max_nodes)
        jfail_at(P->ar->fail, KVR_ERANGE, line, "more than %u syntax nodes",
                 (unsigned)P->lim->max_nodes);
    struct jnode *n = ja_alloc(P->ar, sizeof *n);
    n->kind = (uint8_t)kind;
    n->line = line;
    return n;
}

static void kid(struct parser *P, struct kids *k, struct jnode *n)
{
    if (k->n == k->cap) {
        uint32_t cap = k->cap ? k->cap * 2 : 4;
        struct jnode **np = ja_alloc_array(P->ar, cap, sizeof *np);
        if (k->n)
            memcpy(np, k->p, k->n * sizeof *np);
        k->p = np;
        k->cap = cap;
    }
    k->p[k->n++] = n;
}

static void set_kids(struct jnode *n, const struct kids *k)
{
    n->kids = k->p;
    n->n_kids = k->n;
}

static void enter(struct parser *P)
{
    if (++P->depth > P->lim->max_depth)
        jfail_at(P->ar->fail, KVR_ERANGE, peek(P)->line, "nested deeper than %u",
                 (unsigned)P->lim->max_depth);
}

static void leave(struct parser *P)
{
    P->depth--;
}

/* ---- expressions ---------------------------------------------------------------------- */

static struct jnode *parse_expr(struct parser *P);
static struct jnode *parse_or(struct parser *P);
static struct jnode *parse_unary(struct parser *P, bool with_filter);
static struct jnode *parse_primary(struct parser *P);
static struct jnode *parse_postfix(struct parser *P, struct jnode *n);

static bool tuple_end(struct parser *P)
{
    const struct jtoken *t = peek(P);
    return t->kind == T_VAR_END || t->kind == T_BLOCK_END || t->kind == T_EOF ||
           is_op(P, OP_RPAREN);
}

/* A comma-separated expression list; a single item without a comma is that item. */
static struct jnode *parse_tuple(struct parser *P, bool condexpr, bool force_tuple)
{
    uint32_t line = peek(P)->line;
    struct jnode *first = condexpr ? parse_expr(P) : parse_or(P);
    if (!is_op(P, OP_COMMA) && !force_tuple)
        return first;
    struct kids k = {0};
    kid(P, &k, first);
    while (skip_op(P, OP_COMMA)) {
        if (tuple_end(P))
            break;
        kid(P, &k, condexpr ? parse_expr(P) : parse_or(P));
    }
    struct jnode *t = node(P, N_TUPLE, line);
    set_kids(t, &k);
    return t;
}

/* Call arguments after '(' up to and including ')'. */
static void parse_args(struct parser *P, struct kids *k)
{
    bool kw_seen = false;
    while (!skip_op(P, OP_RPAREN)) {
        if (k->n)
            expect_op(P, OP_COMMA);
        if (skip_op(P, OP_RPAREN))
            break;
        if (is_op(P, OP_MUL) || is_op(P, OP_POW))
            pfail(P, "%s", "*args and **kwargs are not supported");
        if (peek(P)->kind == T_NAME && peek2(P)->kind == T_OP && peek2(P)->op == OP_ASSIGN) {
            struct jnode *kw = node(P, N_KWARG, peek(P)->line);
            kw->val.t = JT_STR;
            kw->val.u.s = (struct jstr *)next(P)->s;
            next(P);
            kw->a = parse_expr(P);
            kid(P, k, kw);
            kw_seen = true;
        } else {
            if (kw_seen)
                pfail(P, "%s", "positional argument after a keyword argument");
            kid(P, k, parse_expr(P));
        }
        if (k->n > 16)
            pfail(P, "%s", "more than 16 arguments");
    }
}

static struct jnode *named(struct parser *P, enum jk kind, struct jnode *a)
{
    uint32_t line = peek(P)->line;
    struct jnode *n = node(P, kind, line);
    n->a = a;
    n->val.t = JT_STR;
    n->val.u.s = (struct jstr *)expect_name(P);
    while (kind == N_FILTER && is_op(P, OP_DOT)) {
        next(P);
        n->val.u.s = (struct jstr *)expect_name(P); /* dotted filter names: the last part */
    }
    return n;
}

static struct jnode *parse_filter(struct parser *P, struct jnode *operand)
{
    struct jnode *f = named(P, N_FILTER, operand);
    if (skip_op(P, OP_LPAREN)) {
        struct kids k = {0};
        parse_args(P, &k);
        set_kids(f, &k);
    }
    return f;
}

static struct jnode *parse_filter_expr(struct parser *P, struct jnode *n)
{
    for (;;) {
        if (skip_op(P, OP_PIPE)) {
            n = parse_filter(P, n);
        } else if (is_name(P, "is")) {
            next(P);
            bool neg = skip_name(P, "not");
            struct jnode *t = named(P, N_TEST, n);
            t->flag = neg;
            struct kids k = {0};
            const struct jtoken *a = peek(P);
            if (skip_op(P, OP_LPAREN)) {
                parse_args(P, &k);
            } else if ((a->kind == T_NAME || a->kind == T_STR || a->kind == T_INT ||
                        a->kind == T_FLOAT || is_op(P, OP_LBRACKET) || is_op(P, OP_LBRACE)) &&
                       !is_name(P, "else") && !is_name(P, "or") && !is_name(P, "and")) {
                enter(P);
                kid(P, &k, parse_postfix(P, parse_primary(P)));
                leave(P);
            }
            set_kids(t, &k);
            n = t;
        } else if (is_op(P, OP_LPAREN)) {
            n = parse_postfix(P, n);
        } else {
            return n;
        }
    }
}

static struct jnode *parse_subscript(struct parser *P, struct jnode *obj, uint32_t line)
{
    struct jnode *parts[3] = {NULL, NULL, NULL};
    int n_colons = 0;
    if (!is_op(P, OP_COLON))
        parts[0] = parse_expr(P);
    while (n_colons < 2 && skip_op(P, OP_COLON)) {
        n_colons++;
        if (!is_op(P, OP_COLON) && !is_op(P, OP_RBRACKET))
            parts[n_colons] = parse_expr(P);
    }
    expect_op(P, OP_RBRACKET);
    struct jnode *n = node(P, n_colons ? N_SLICE : N_ITEM, line);
    n->a = obj;
    n->b = parts[0];
    n->c = parts[1];
    n->d = parts[2];
    return n;
}

static struct jnode *parse_postfix(struct parser *P, struct jnode *n)
{
    for (;;) {
        uint32_t line = peek(P)->line;
        if (skip_op(P, OP_DOT)) {
            if (peek(P)->kind == T_INT) {
                struct jnode *k = node(P, N_CONST, line);
                k->val = jv_int(next(P)->i);
                struct jnode *it = node(P, N_ITEM, line);
                it->a = n;
                it->b = k;
                n = it;
            } else {
                struct jnode *at = node(P, N_ATTR, line);
                at->a = n;
                at->val.t = JT_STR;
                at->val.u.s = (struct jstr *)expect_name(P);
                n = at;
            }
        } else if (skip_op(P, OP_LBRACKET)) {
            enter(P);
            n = parse_subscript(P, n, line);
            leave(P);
        } else if (skip_op(P, OP_LPAREN)) {
            enter(P);
            struct jnode *call = node(P, N_CALL, line);
            call->a = n;
            struct kids k = {0};
            parse_args(P, &k);
            set_kids(call, &k);
            n = call;
            leave(P);
        } else {
            return n;
        }
    }
}

static struct jnode *parse_primary(struct parser *P)
{
    const struct jtoken *t = peek(P);
    uint32_t line = t->line;
    struct jnode *n;
    switch (t->kind) {
    case T_NAME: {
        const char *s = t->s->s;
        n = node(P, N_CONST, line);
        if (!strcmp(s, "true") || !strcmp(s, "True")) {
            n->val = jv_bool(true);
        } else if (!strcmp(s, "false") || !strcmp(s, "False")) {
            n->val = jv_bool(false);
        } else if (!strcmp(s, "none") || !strcmp(s, "None")) {
            n->val = jv_none();
        } else {
            n->kind = N_NAME;
            n->val.t = JT_STR;
            n->val.u.s = t->s;
        }
        next(P);
        return n;
    }
    case T_STR: {
        n = node(P, N_CONST, line);
        n->val.t = JT_STR;
        n->val.u.s = next(P)->s;
        while (peek(P)->kind == T_STR) {
            const struct jstr *a = n->val.u.s, *b = next(P)->s;
            struct jstr *joined = ja_alloc(P->ar, sizeof *joined + a->len + b->len + 1);
            joined->len = a->len + b->len;
            memcpy(joined->s, a->s, a->len);
            memcpy(joined->s + a->len, b->s, b->len);
            n->val.u.s = joined;
        }
        return n;
    }
    case T_INT:
        n = node(P, N_CONST, line);
        n->val = jv_int(next(P)->i);
        return n;
    case T_FLOAT:
        n = node(P, N_CONST, line);
        n->val = jv_float(next(P)->f);
        return n;
    default:
        break;
    }
    if (skip_op(P, OP_LPAREN)) {
        if (skip_op(P, OP_RPAREN)) {
            n = node(P, N_TUPLE, line);
            return n;
        }
        n = parse_tuple(P, true, false);
        expect_op(P, OP_RPAREN);
        return n;
    }
    if (skip_op(P, OP_LBRACKET) || skip_op(P, OP_LBRACE)) {
        bool dict = P->t[P->pos - 1].op == OP_LBRACE;
        enum jop close = dict ? OP_RBRACE : OP_RBRACKET;
        struct kids k = {0};
        while (!skip_op(P, close)) {
            if (k.n)
                expect_op(P, OP_COMMA);
            if (skip_op(P, close))
                break;
            struct jnode *item = parse_expr(P);
            if (dict) {
                struct jnode *pair = node(P, N_PAIR, item->line);
                pair->a = item;
                expect_op(P, OP_COLON);
                pair->b = parse_expr(P);
                item = pair;
            }
            kid(P, &k, item);
        }
        n = node(P, dict ? N_DICT : N_LIST, line);
        set_kids(n, &k);
        return n;
    }
    pfail(P, "%s",
          t->kind == T_VAR_END || t->kind == T_BLOCK_END
              ? "expected an expression before the end of the tag"
              : "unexpected token in expression");
}

static struct jnode *parse_unary(struct parser *P, bool with_filter)
{
    enter(P);
    uint32_t line = peek(P)->line;
    struct jnode *n;
    if (skip_op(P, OP_SUB) || skip_op(P, OP_ADD)) {
        n = node(P, P->t[P->pos - 1].op == OP_SUB ? N_NEG : N_POS, line);
        n->a = parse_unary(P, false);
    } else {
        n = parse_postfix(P, parse_primary(P));
    }
    if (with_filter)
        n = parse_filter_expr(P, n);
    leave(P);
    return n;
}

static struct jnode *binary(struct parser *P, enum jop op, struct jnode *a, struct jnode *b)
{
    struct jnode *n = node(P, N_BIN, a->line);
    n->op = (uint8_t)op;
    n->a = a;
    n->b = b;
    return n;
}

static struct jnode *parse_pow(struct parser *P)
{
    struct jnode *n = parse_unary(P, true);
    while (skip_op(P, OP_POW))
        n = binary(P, OP_POW, n, parse_unary(P, true));
    return n;
}

static struct jnode *parse_math2(struct parser *P)
{
    struct jnode *n = parse_pow(P);
    for (;;) {
        const struct jtoken *t = peek(P);
        if (t->kind != T_OP ||
            (t->op != OP_MUL && t->op != OP_DIV && t->op != OP_FLOORDIV && t->op != OP_MOD))
            return n;
        enum jop op = (enum jop)next(P)->op;
        n = binary(P, op, n, parse_pow(P));
    }
}

static struct jnode *parse_concat(struct parser *P)
{
    struct jnode *first = parse_math2(P);
    if (!is_op(P, OP_TILDE))
        return first;
    struct kids k = {0};
    kid(P, &k, first);
    while (skip_op(P, OP_TILDE))
        kid(P, &k, parse_math2(P));
    struct jnode *n = node(P, N_CONCAT, first->line);
    set_kids(n, &k);
    return n;
}

static struct jnode *parse_math1(struct parser *P)
{
    struct jnode *n = parse_concat(P);
    while (is_op(P, OP_ADD) || is_op(P, OP_SUB)) {
        enum jop op = (enum jop)next(P)->op;
        n = binary(P, op, n, parse_concat(P));
    }
    return n;
}

static struct jnode *parse_compare(struct parser *P)
{
    struct jnode *first = parse_math1(P);
    struct kids k = {0};
    for (;;) {
        const struct jtoken *t = peek(P);
        enum jop op;
        if (t->kind == T_OP && t->op >= OP_EQ && t->op <= OP_GE) {
            op = (enum jop)next(P)->op;
        } else if (skip_name(P, "in")) {
            op = OP_IN;
        } else if (is_name(P, "not") && peek2(P)->kind == T_NAME && !strcmp(peek2(P)->s->s, "in")) {
            next(P);
            next(P);
            op = OP_NOTIN;
        } else {
            break;
        }
        struct jnode *c = node(P, N_CMPOP, t->line);
        c->op = (uint8_t)op;
        c->a = parse_math1(P);
        kid(P, &k, c);
    }
    if (!k.n)
        return first;
    struct jnode *n = node(P, N_CMP, first->line);
    n->a = first;
    set_kids(n, &k);
    return n;
}

static struct jnode *parse_not(struct parser *P)
{
    if (is_name(P, "not")) {
        uint32_t line = next(P)->line;
        enter(P);
        struct jnode *n = node(P, N_NOT, line);
        n->a = parse_not(P);
        leave(P);
        return n;
    }
    return parse_compare(P);
}

static struct jnode *parse_and(struct parser *P)
{
    struct jnode *n = parse_not(P);
    while (skip_name(P, "and")) {
        struct jnode *a = node(P, N_AND, n->line);
        a->a = n;
        a->b = parse_not(P);
        n = a;
    }
    return n;
}

static struct jnode *parse_or(struct parser *P)
{
    struct jnode *n = parse_and(P);
    while (skip_name(P, "or")) {
        struct jnode *o = node(P, N_OR, n->line);
        o->a = n;
        o->b = parse_and(P);
        n = o;
    }
    return n;
}

static struct jnode *parse_expr(struct parser *P)
{
    enter(P);
    struct jnode *n = parse_or(P);
    while (skip_name(P, "if")) {
        struct jnode *c = node(P, N_COND, n->line);
        c->b = n;
        c->a = parse_or(P);
        if (skip_name(P, "else"))
            c->c = parse_expr(P);
        n = c;
    }
    leave(P);
    return n;
}

/* ---- statements ----------------------------------------------------------------------- */

static struct jnode *parse_body(struct parser *P, const char *const *ends);

/* A for/set target: a name, or names separated by commas (optionally in parentheses);
 * `set` also takes namespace attributes (ns.name). */
static struct jnode *parse_target(struct parser *P, bool with_ns)
{
    uint32_t line = peek(P)->line;
    if (with_ns && peek(P)->kind == T_NAME && peek2(P)->kind == T_OP && peek2(P)->op == OP_DOT) {
        struct jnode *n = node(P, N_NSATTR, line);
        struct jnode *name = node(P, N_NAME, line);
        name->val.t = JT_STR;
        name->val.u.s = (struct jstr *)next(P)->s;
        next(P);
        n->a = name;
        n->val.t = JT_STR;
        n->val.u.s = (struct jstr *)expect_name(P);
        return n;
    }
    bool paren = skip_op(P, OP_LPAREN);
    struct kids k = {0};
    do {
        if (k.n && (is_name(P, "in") || is_op(P, OP_ASSIGN) || is_op(P, OP_RPAREN)))
            break;
        struct jnode *n = node(P, N_NAME, peek(P)->line);
        n->val.t = JT_STR;
        n->val.u.s = (struct jstr *)expect_name(P);
        kid(P, &k, n);
    } while (skip_op(P, OP_COMMA));
    if (paren)
        expect_op(P, OP_RPAREN);
    if (k.n == 1 && !paren)
        return k.p[0];
    struct jnode *t = node(P, N_TUPLE, line);
    set_kids(t, &k);
    return t;
}

/* Consume "{% name" of the tag that ended a body. */
static const char *end_tag(struct parser *P)
{
    expect(P, T_BLOCK_BEGIN);
    return expect_name(P)->s;
}

/* Filters of a block ({% filter f | g %}, {% set x | f %}), as N_FILTER nodes without an
 * operand. */
static void parse_block_filters(struct parser *P, struct kids *k, bool first_needs_pipe)
{
    bool first = true;
    while ((first && !first_needs_pipe) || skip_op(P, OP_PIPE)) {
        first = false;
        kid(P, k, parse_filter(P, NULL));
    }
}

static struct jnode *parse_if(struct parser *P, uint32_t line)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    static const char *const endif[] = {"endif", NULL};
    struct jnode *n = node(P, N_IF, line);
    n->a = parse_tuple(P, true, false);
    expect(P, T_BLOCK_END);
    n->b = parse_body(P, ends);
    uint32_t tag_line = peek(P)->line;
    const char *tag = end_tag(P);
    if (!strcmp(tag, "elif")) {
        enter(P);
        n->c = parse_if(P, tag_line);
        leave(P);
        return n;
    }
    if (!strcmp(tag, "else")) {
        expect(P, T_BLOCK_END);
        n->c = parse_body(P, endif);
        end_tag(P);
    }
    expect(P, T_BLOCK_END);
    return n;
}

static struct jnode *parse_for(struct parser *P, uint32_t line)
{
    static const char *const ends[] = {"else", "endfor", NULL};
    static const char *const endfor[] = {"endfor", NULL};
    struct jnode *n = node(P, N_FOR, line);
    n->a = parse_target(P, false);
    if (!skip_name(P, "in"))
        pfail(P, "%s", "expected 'in' in a for loop");
    n->b = parse_tuple(P, false, false);
    if (skip_name(P, "if"))
        n->e = parse_expr(P);
    if (is_name(P, "recursive"))
        pfail(P, "%s", "recursive loops are not supported");
    expect(P, T_BLOCK_END);
    P->loops++;
    n->c = parse_body(P, ends);
    P->loops--;
    if (!strcmp(end_tag(P), "else")) {
        expect(P, T_BLOCK_END);
        n->d = parse_body(P, endfor);
        end_tag(P);
    }
    expect(P, T_BLOCK_END);
    return n;
}

static struct jnode *parse_set(struct parser *P, uint32_t line)
{
    static const char *const ends[] = {"endset", NULL};
    struct jnode *target = parse_target(P, true);
    if (skip_op(P, OP_ASSIGN)) {
        struct jnode *n = node(P, N_SET, line);
        n->a = target;
        n->b = parse_tuple(P, true, false);
        expect(P, T_BLOCK_END);
        return n;
    }
    struct jnode *n = node(P, N_SETBLOCK, line);
    n->a = target;
    struct kids k = {0};
    parse_block_filters(P, &k, true);
    set_kids(n, &k);
    expect(P, T_BLOCK_END);
    n->b = parse_body(P, ends);
    end_tag(P);
    expect(P, T_BLOCK_END);
    return n;
}

static struct jnode *parse_macro(struct parser *P, uint32_t line)
{
    static const char *const ends[] = {"endmacro", NULL};
    struct jnode *n = node(P, N_MACRO, line);
    n->val.t = JT_STR;
    n->val.u.s = (struct jstr *)expect_name(P);
    expect_op(P, OP_LPAREN);
    struct kids k = {0};
    while (!skip_op(P, OP_RPAREN)) {
        if (k.n)
            expect_op(P, OP_COMMA);
        if (skip_op(P, OP_RPAREN))
            break;
        struct jnode *p = node(P, N_NAME, peek(P)->line);
        p->val.t = JT_STR;
        p->val.u.s = (struct jstr *)expect_name(P);
        if (skip_op(P, OP_ASSIGN)) {
            p->kind = N_KWARG;
            p->a = parse_expr(P);
        } else if (k.n && k.p[k.n - 1]->kind == N_KWARG) {
            pfail(P, "%s", "a macro parameter without a default follows one with a default");
        }
        kid(P, &k, p);
        if (k.n > 16)
            pfail(P, "%s", "more than 16 macro parameters");
    }
    set_kids(n, &k);
    expect(P, T_BLOCK_END);
    uint32_t loops = P->loops;
    P->loops = 0;
    n->b = parse_body(P, ends);
    P->loops = loops;
    end_tag(P);
    expect(P, T_BLOCK_END);
    return n;
}

static struct jnode *parse_stmt(struct parser *P)
{
    uint32_t line = peek(P)->line;
    const char *tag = expect_name(P)->s;
    struct jnode *n;
    if (!strcmp(tag, "if"))
        return parse_if(P, line);
    if (!strcmp(tag, "for"))
        return parse_for(P, line);
    if (!strcmp(tag, "set"))
        return parse_set(P, line);
    if (!strcmp(tag, "macro"))
        return parse_macro(P, line);
    if (!strcmp(tag, "break") || !strcmp(tag, "continue")) {
        if (!P->loops)
            pfail(P, "'%s' outside of a loop", tag);
        n = node(P, tag[0] == 'b' ? N_BREAK : N_CONTINUE, line);
        expect(P, T_BLOCK_END);
        return n;
    }
    if (!strcmp(tag, "filter")) {
        static const char *const ends[] = {"endfilter", NULL};
        n = node(P, N_FILTERBLOCK, line);
        struct kids k = {0};
        parse_block_filters(P, &k, false);
        set_kids(n, &k);
        expect(P, T_BLOCK_END);
        n->b = parse_body(P, ends);
        end_tag(P);
        expect(P, T_BLOCK_END);
        return n;
    }
    if (!strcmp(tag, "generation")) {
        /* Hugging Face's tag marking assistant text: it renders its body. */
        static const char *const ends[] = {"endgeneration", NULL};
        expect(P, T_BLOCK_END);
        n = parse_body(P, ends);
        end_tag(P);
        expect(P, T_BLOCK_END);
        return n;
    }
    P->pos--;
    pfail(P, "unknown or unexpected tag '%s'", tag);
}

static bool is_end(const char *name, const char *const *ends)
{
    for (; ends && *ends; ends++)
        if (!strcmp(name, *ends))
            return true;
    return false;
}

/* Statements up to a {% tag %} named in `ends` (left unconsumed) or the end of the
 * template (only when ends is NULL). */
static struct jnode *parse_body(struct parser *P, const char *const *ends)
{
    enter(P);
    struct jnode *body = node(P, N_BODY, peek(P)->line);
    struct kids k = {0};
    for (;;) {
        const struct jtoken *t = peek(P);
        if (t->kind == T_EOF) {
            if (ends)
                pfail(P, "unexpected end of template, expected '{%% %s %%}'", ends[0]);
            break;
        }
        if (t->kind == T_TEXT) {
            struct jnode *n = node(P, N_TEXT, t->line);
            n->val.t = JT_STR;
            n->val.u.s = next(P)->s;
            kid(P, &k, n);
        } else if (t->kind == T_VAR_BEGIN) {
            next(P);
            struct jnode *n = node(P, N_OUT, t->line);
            n->a = parse_tuple(P, true, false);
            expect(P, T_VAR_END);
            kid(P, &k, n);
        } else if (t->kind == T_BLOCK_BEGIN) {
            const struct jtoken *name = peek2(P);
            if (name->kind == T_NAME && is_end(name->s->s, ends))
                break;
            next(P);
            kid(P, &k, parse_stmt(P));
        } else {
            pfail(P, "%s", "unexpected token outside of a tag");
        }
    }
    set_kids(body, &k);
    leave(P);
    return body;
}

struct jnode *jparse(struct jarena *a, const struct kvr_jinja_limits *lim,
                     const struct jtoken *toks, uint32_t n_toks)
{
    struct parser P = {.ar = a, .lim = lim, .t = toks, .n = n_toks};
    return parse_body(&P, NULL);
}
