/* jinja_int.h - what the files of the Jinja interpreter share (not a public header).
 *
 *   jinja_lex.c      source -> tokens (whitespace control, trim/lstrip_blocks, raw)
 *   jinja_parse.c    tokens -> AST (struct jnode)
 *   jinja_value.c    the arena, values, conversions (str, repr, tojson), comparisons
 *   jinja_eval.c     statements and expressions, scopes, calls, the public API
 *   jinja_filters.c  filters, tests, and the methods of str and dict
 *   jinja_strings.c  string operations filters and methods share (case, strip, split...)
 *   jinja_chars.c    code points: counting, isspace, case mapping
 *   jinja_python.c   Python built-ins: str % args, round(), list methods
 *
 * Every allocation of a parse or of a render comes from one struct jarena. A failure
 * anywhere (syntax, runtime, limit, memory) records its message and longjmps to the
 * entry point through the arena's struct jfail, which then frees the arena. */
#ifndef KVR_JINJA_JINJA_INT_H
#define KVR_JINJA_JINJA_INT_H

#include "jinja/jinja.h"

#include "core/utf8.h"

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- failure and arena ------------------------------------------------------------- */

struct jfail {
    jmp_buf jb;
    struct kvr_err *err;
    int code;
};

struct jchunk;
struct jarena {
    struct jchunk *chunks;
    size_t used_bytes; /* everything handed out, plus chunk headers */
    size_t cap_bytes;
    struct jfail *fail;
};

void ja_init(struct jarena *a, size_t cap_bytes, struct jfail *fail);
void ja_fini(struct jarena *a);
/* Zeroed, 16-aligned; never returns NULL (a failure longjmps). */
void *ja_alloc(struct jarena *a, size_t n);
void *ja_alloc_array(struct jarena *a, size_t n, size_t elem);
_Noreturn void jfail_at(struct jfail *f, int code, uint32_t line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- values -------------------------------------------------------------------------- */

enum jt {
    JT_UNDEF, /* u.s: the missing name, for messages (may be NULL) */
    JT_NONE,
    JT_BOOL,
    JT_INT,
    JT_FLOAT,
    JT_STR,
    JT_LIST, /* also tuples (l->tuple) */
    JT_DICT, /* also namespace() objects (d->ns) */
    JT_FUNC,
    JT_LOOP,
    JT_COUNT
};

struct jstr {
    size_t len;
    char s[]; /* len bytes of UTF-8, then a NUL */
};

struct jval;
struct jlist {
    uint32_t n, cap;
    bool tuple;
    struct jval *v;
};

struct jdict {
    uint32_t n, cap;
    bool ns;
    struct jval *k, *v;
};

enum jfunc_kind {
    JF_RANGE,
    JF_NAMESPACE,
    JF_DICT,
    JF_RAISE,
    JF_STRFTIME,
    JF_CYCLE,  /* loop.cycle: self is the loop */
    JF_MACRO,  /* node is the macro */
    JF_METHOD, /* name is the method of self */
    JF_COUNT
};

struct jnode;
struct jloop;
struct jval {
    uint8_t t;
    union {
        bool b;
        int64_t i;
        double f;
        struct jstr *s;
        struct jlist *l;
        struct jdict *d;
        struct jfunc *fn;
        struct jloop *loop;
    } u;
};

struct jfunc {
    enum jfunc_kind kind;
    struct jval self;
    const struct jstr *name;
    const struct jnode *macro;
};

struct jloop {
    int64_t index0, length;
    const struct jlist *items;
    uint32_t depth;
};

/* ---- AST ----------------------------------------------------------------------------- */

enum jk {
    /* statements */
    N_BODY,        /* kids: statements */
    N_TEXT,        /* val: the text */
    N_OUT,         /* a: expression */
    N_IF,          /* a: cond, b: body, c: else body or elif N_IF (or NULL) */
    N_FOR,         /* a: target, b: iterable, c: body, d: else body, e: filter (or NULL) */
    N_SET,         /* a: target (N_NAME, N_TUPLE of names, N_NSATTR), b: value */
    N_SETBLOCK,    /* a: target, b: body, kids: filters (N_FILTER with a == NULL) */
    N_MACRO,       /* val: name, kids: params (N_NAME or N_KWARG), b: body */
    N_FILTERBLOCK, /* b: body, kids: filters */
    N_BREAK,
    N_CONTINUE,
    /* expressions */
    N_CONST,  /* val */
    N_NAME,   /* val: name */
    N_NSATTR, /* set target ns.attr: a: N_NAME, val: attr */
    N_ATTR,   /* a: object, val: name */
    N_ITEM,   /* a: object, b: key */
    N_SLICE,  /* a: object, b: start, c: stop, d: step (each may be NULL) */
    N_CALL,   /* a: callee, kids: args (N_KWARG for keywords) */
    N_FILTER, /* a: operand (NULL in blocks), val: name, kids: args */
    N_TEST,   /* a: operand, val: name, kids: args, flag: "is not" */
    N_BIN,    /* op: enum jop, a, b */
    N_NEG,    /* a */
    N_POS,    /* a */
    N_NOT,    /* a */
    N_AND,    /* a, b */
    N_OR,     /* a, b */
    N_CMP,    /* a: first operand, kids: N_CMPOP (op, a: operand) */
    N_CMPOP,
    N_COND,  /* a: cond, b: value if true, c: value if false (may be NULL) */
    N_LIST,  /* kids */
    N_TUPLE, /* kids */
    N_DICT,  /* kids: N_PAIR (a: key, b: value) */
    N_PAIR,
    N_CONCAT, /* kids, joined with ~ */
    N_KWARG,  /* val: name, a: value */
    N_COUNT
};

enum jop {
    OP_NONE,
    OP_ADD,
    OP_SUB,
    OP_MUL,
    OP_DIV,
    OP_FLOORDIV,
    OP_MOD,
    OP_POW,
    OP_TILDE,
    OP_EQ,
    OP_NE,
    OP_LT,
    OP_LE,
    OP_GT,
    OP_GE,
    OP_IN,
    OP_NOTIN,
    OP_ASSIGN,
    OP_LPAREN,
    OP_RPAREN,
    OP_LBRACKET,
    OP_RBRACKET,
    OP_LBRACE,
    OP_RBRACE,
    OP_COMMA,
    OP_DOT,
    OP_COLON,
    OP_PIPE,
    OP_COUNT
};

struct jnode {
    uint8_t kind; /* enum jk */
    uint8_t op;   /* enum jop */
    bool flag;
    uint32_t line;
    struct jnode *a, *b, *c, *d, *e;
    struct jnode **kids;
    uint32_t n_kids;
    struct jval val;
};

/* ---- tokens -------------------------------------------------------------------------- */

enum jtok {
    T_TEXT, /* s: text, already stripped */
    T_BLOCK_BEGIN,
    T_BLOCK_END,
    T_VAR_BEGIN,
    T_VAR_END,
    T_NAME,  /* s */
    T_STR,   /* s: decoded */
    T_INT,   /* i */
    T_FLOAT, /* f */
    T_OP,    /* op */
    T_EOF,
    T_COUNT
};

struct jtoken {
    uint8_t kind;
    uint8_t op;
    uint32_t line;
    struct jstr *s;
    int64_t i;
    double f;
};

/* The parsed template (struct kvr_jinja of the public header). */
struct kvr_jinja {
    struct kvr_jinja_limits lim;
    struct jarena ar;
    struct jfail fail; /* only used while parsing */
    struct jnode *root;
};

/* Tokenize `src` (already newline-normalised); returns the number of tokens, the last
 * T_EOF. */
uint32_t jlex(struct jarena *a, const struct kvr_jinja_limits *lim, const char *src, size_t len,
              struct jtoken **out);
struct jnode *jparse(struct jarena *a, const struct kvr_jinja_limits *lim,
                     const struct jtoken *toks, uint32_t n_toks);

/* ---- value helpers (jinja_value.c) -------------------------------------------------- */

struct jbuf {
    char *p;
    size_t len, cap, max;
};

struct jctx; /* a render, jinja_eval.c */

struct jstr *jstr_new(struct jarena *a, const char *s, size_t len);
struct jval jv_str(struct jarena *a, const char *s, size_t len);
struct jval jv_int(int64_t i);
struct jval jv_float(double f);
struct jval jv_bool(bool b);
struct jval jv_none(void);
struct jval jv_undef(struct jstr *name);
struct jlist *jlist_new(struct jarena *a, uint32_t cap);
void jlist_push(struct jarena *a, struct jlist *l, struct jval v);
struct jdict *jdict_new(struct jarena *a, uint32_t cap);
/* Set key to v (replacing an equal key). */
void jdict_set(struct jctx *c, struct jdict *d, struct jval k, struct jval v);
/* Index of an equal key, or -1. */
int64_t jdict_find(struct jctx *c, const struct jdict *d, struct jval k);
int64_t jdict_find_str(struct jctx *c, const struct jdict *d, const char *k, size_t len);

void jbuf_put(struct jctx *c, struct jbuf *b, const char *p, size_t n);
void jbuf_putc(struct jctx *c, struct jbuf *b, char ch);

/* str(v) as Python prints it (undefined is ""), appended to b. */
void jv_write_str(struct jctx *c, struct jbuf *b, struct jval v);
/* repr(v) as Python prints it. */
void jv_write_repr(struct jctx *c, struct jbuf *b, struct jval v);
struct jval jv_to_str(struct jctx *c, struct jval v);
/* json.dumps(v, ensure_ascii=False, indent, separators=None, sort_keys); indent < 0 is
 * None. */
void jv_write_json(struct jctx *c, struct jbuf *b, struct jval v, int indent, bool sort_keys,
                   uint32_t depth, uint32_t line);
struct jval jv_from_json(struct jctx *c, const json_t *j, uint32_t depth);

bool jv_truthy(struct jctx *c, struct jval v);
bool jv_equal(struct jctx *c, struct jval a, struct jval b);
/* -1, 0, 1, or a type error (longjmp) for values Python cannot order. */
int jv_compare(struct jctx *c, struct jval a, struct jval b, uint32_t line);
const char *jv_type_name(struct jval v);
/* Length in Python's sense (code points for strings); -1 when v has none. */
int64_t jv_len(struct jctx *c, struct jval v);
/* The items iterating v yields (dict: keys; str: characters); undefined yields none.
 * Fails (type error) for values that cannot be iterated. */
struct jlist *jv_iter(struct jctx *c, struct jval v, uint32_t line);

/* ---- code points (jinja_chars.c) ---------------------------------------------------- */

/* The code point at s[i..len) (i < len) and its length in bytes. Strings are Python str:
 * a byte that is not part of a well-formed character reads as U+FFFD on its own. */
static inline size_t ju_decode(const char *s, size_t len, size_t i, uint32_t *cp)
{
    return kvr_utf8_decode(s + i, len - i, cp, KVR_UTF8_REPLACE_BYTE);
}
/* Code points in s[0..len), by ju_decode. */
size_t ju_count(const char *s, size_t len);
bool ju_isspace(uint32_t cp);
uint32_t ju_upper(uint32_t cp);
uint32_t ju_lower(uint32_t cp);
/* Has a case (upper or lower maps it to another code point). */
bool ju_iscased(uint32_t cp);
bool ju_isalnum(uint32_t cp);

/* ---- the render (jinja_eval.c) ------------------------------------------------------ */

struct jscope;
struct jctx {
    struct jarena ar;
    struct jfail fail;
    const struct kvr_jinja *t;
    struct jscope *root;
    struct jscope *scope;
    const struct tm *now;
    uint64_t steps;
    uint32_t depth;
    uint32_t loop_depth;
    int loop_ctl; /* 0, or 1 after break, 2 after continue */
};

_Noreturn void jerr(struct jctx *c, int code, uint32_t line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Count `n` evaluation steps against the limit. */
void jcharge(struct jctx *c, uint64_t n, uint32_t line);

struct jargs {
    uint32_t n_pos, n_kw;
    struct jval pos[16];
    const struct jstr *kw_name[16];
    struct jval kw[16];
};

/* Keyword `name`, else positional `i` (when i >= 0), else NULL. */
const struct jval *jargs_get(const struct jargs *a, int i, const char *name);
struct jval jcall(struct jctx *c, struct jval fn, const struct jargs *args, uint32_t line);
/* Attribute or item lookup as jinja2 does it: `attr` tries attributes first (x.name),
 * item lookup (x[key]) tries items first. */
struct jval jget_attr(struct jctx *c, struct jval obj, const struct jstr *name, uint32_t line);
struct jval jget_item(struct jctx *c, struct jval obj, struct jval key, uint32_t line);

/* An empty output buffer, bounded by the render's output limit; its text as a value. */
static inline struct jbuf jbuf_new(struct jctx *c)
{
    return (struct jbuf){.max = c->t->lim.max_output_bytes};
}
static inline struct jval jv_buf(struct jctx *c, const struct jbuf *b)
{
    return jv_str(&c->ar, b->p ? b->p : "", b->len);
}
static inline struct jval jv_list(struct jlist *l)
{
    return (struct jval){.t = JT_LIST, .u.l = l};
}

/* ---- string operations (jinja_strings.c) -------------------------------------------- */

/* PYTITLE is Python's str.title (after any uncased character); jinja2's title filter is
 * js_title (after whitespace, '-' and opening brackets). */
enum jcasing { JCASE_UPPER, JCASE_LOWER, JCASE_CAPITALIZE, JCASE_PYTITLE, JCASE_COUNT };

struct jval js_case(struct jctx *c, const struct jstr *s, enum jcasing how);
struct jval js_title(struct jctx *c, const struct jstr *s);
/* Strip the code points in `chars` (NULL: whitespace) from the chosen ends. */
struct jval js_strip(struct jctx *c, const struct jstr *s, const struct jstr *chars, bool left,
                     bool right);
/* The first x[0..xn) in h[0..hn), or NULL; an empty x is found at h. */
const char *js_find(const char *h, size_t hn, const char *x, size_t xn);
/* Python's str.replace (count < 0: every occurrence). */
struct jval js_replace(struct jctx *c, const struct jstr *s, const struct jstr *old,
                       const struct jstr *new, int64_t count);
/* Python's str.split (sep NULL: runs of whitespace; maxsplit < 0: no limit). */
struct jval js_split(struct jctx *c, const struct jstr *s, const struct jstr *sep, int64_t maxsplit,
                     uint32_t line);
/* Python's str.rsplit: the same parts as js_split, the maxsplit cuts counted from the end. */
struct jval js_rsplit(struct jctx *c, const struct jstr *s, const struct jstr *sep,
                      int64_t maxsplit, uint32_t line);
struct jlist *js_splitlines(struct jctx *c, const struct jstr *s, bool keepends);

/* ---- Python built-ins (jinja_python.c) ---------------------------------------------- */

/* Python's `f % args` (printf-style formatting). */
struct jval jpy_percent(struct jctx *c, const struct jstr *f, struct jval args, uint32_t line);
/* Python's round(v, ndigits) for an int or a float: half to even, an int stays an int. */
struct jval jpy_round(struct jctx *c, struct jval v, int64_t ndigits, uint32_t line);
/* list.index and list.count. */
bool jpy_list_method_exists(const char *name);
struct jval jpy_list_method(struct jctx *c, const struct jlist *l, const char *m,
                            const struct jargs *a, uint32_t line);

/* ---- filters, tests, methods (jinja_filters.c) -------------------------------------- */

struct jval jfilter(struct jctx *c, const struct jstr *name, struct jval v,
                    const struct jargs *args, uint32_t line);
bool jtest(struct jctx *c, const struct jstr *name, struct jval v, const struct jargs *args,
           uint32_t line);
bool jtest_exists(const char *name);
bool jfilter_exists(const char *name);
/* Is `name` a method of v's type (so x.name is a bound method)? */
bool jmethod_exists(struct jval v, const char *name);
struct jval jmethod_call(struct jctx *c, struct jval self, const struct jstr *name,
                         const struct jargs *args, uint32_t line);

#endif
