/* test_grammar.c - the GBNF compiler's errors and limits, matching by code points and by
 * bytes split anywhere, random small grammars checked exhaustively against a naive
 * matcher written here, and masks checked token by token against matching each token. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/rng.h"
#include "model/grammar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct kvr_grammar *compile(const char *text)
{
    struct kvr_grammar *g = NULL;
    struct kvr_err err = {0};
    int rc = kvr_grammar_compile(&g, text, strlen(text), &err);
    if (rc)
        fail_msg("compile failed: %s\n%s", err.msg, text);
    return g;
}

static void expect_error(const char *text, int code, const char *part)
{
    struct kvr_grammar *g = NULL;
    struct kvr_err err = {0};
    if (kvr_grammar_compile(&g, text, strlen(text), &err) != code)
        fail_msg("'%s': expected %d, got '%s'", text, code, err.msg);
    assert_null(g);
    if (!strstr(err.msg, part))
        fail_msg("error '%s' lacks '%s'", err.msg, part);
}

/* Whether the whole of s matches (fed at once). */
static bool matches(const struct kvr_grammar *g, const char *s)
{
    struct kvr_grammar_match *m;
    assert_int_equal(kvr_grammar_match_create(&m, g), 0);
    bool ok = !kvr_grammar_match_bytes(m, s, strlen(s)) && kvr_grammar_match_complete(m);
    kvr_grammar_match_destroy(m);
    return ok;
}

static void test_errors(void **state)
{
    (void)state;
    expect_error("root ::= foo", KVR_EFORMAT, "line 1 col 10: rule 'foo' is not defined");
    expect_error("root ::= \"a\"\nroot ::= \"b\"", KVR_EFORMAT,
                 "line 2 col 1: rule 'root' is defined twice");
    expect_error("a ::= \"x\"", KVR_EFORMAT, "no rule named root");
    expect_error("root ::= \"abc", KVR_EFORMAT, "unterminated literal");
    expect_error("root ::= [abc", KVR_EFORMAT, "unterminated character class");
    expect_error("root ::= \"\\q\"", KVR_EFORMAT, "unknown escape \\q");
    expect_error("root ::= (\"a\"", KVR_EFORMAT, "unclosed (");
    expect_error("root ::= \"a\")", KVR_EFORMAT, "unmatched )");
    expect_error("root ::= root \"a\" | \"b\"", KVR_EFORMAT, "left-recursive");
    expect_error("root ::= x\nx ::= y? root \"a\"\ny ::= \"b\"", KVR_EFORMAT, "left-recursive");
    expect_error("root ::= \"a\"{3,2}", KVR_EFORMAT, "below the minimum");
    expect_error("root ::= \"a\"{10001}", KVR_ERANGE, "repetition count above");
    expect_error("root ::= [z-a]", KVR_EFORMAT, "backwards");
    expect_error("root ::= \"\\u12\"", KVR_EFORMAT, "hex digits");
    expect_error("root ::= @", KVR_EFORMAT, "unexpected '@'");
    expect_error("root \"a\"", KVR_EFORMAT, "expected ::=");
    /* expansion past the element limit */
    expect_error("root ::= a a a a\na ::= \"abcdefghijklmnop\"{10000}\nb ::= a\nc ::= a\nd ::= a\n"
                 "e ::= \"abcdefghijklmnop\"{10000}\nf ::= \"abcdefghijklmnop\"{10000}\n"
                 "g ::= \"abcdefghijklmnop\"{10000}\nh ::= \"abcdefghijklmnop\"{10000}",
                 KVR_ERANGE, "elements");
    /* nesting */
    char deep[400] = "root ::= ";
    for (int i = 0; i < 70; i++)
        strcat(deep, "(");
    strcat(deep, "\"a\"");
    for (int i = 0; i < 70; i++)
        strcat(deep, ")");
    expect_error(deep, KVR_ERANGE, "nested deeper");
    /* right recursion is fine, and a nullable prefix before a consuming one too */
    struct kvr_grammar *g = compile("root ::= \"a\" root | \"b\"\nx ::= \"\" \"c\" x |");
    kvr_grammar_destroy(g);
}

static void test_syntax(void **state)
{
    (void)state;
    struct kvr_grammar *g = compile("# a comment\n"
                                    "root ::= greet ws name (\"!\" | \"?\")?  # trailing\n"
                                    "greet ::= \"hi\" | \"hello\"\n"
                                    "   | \"hey\"\n"
                                    "ws ::= [ \\t]+\n"
                                    "name ::= [A-Z] [a-z]{1,4} digit{0,2}\n"
                                    "digit ::= [0-9]\n");
    assert_true(matches(g, "hi Bob"));
    assert_true(matches(g, "hey \tAnna42!"));
    assert_true(matches(g, "hello Zz?"));
    assert_false(matches(g, "hi bob"));
    assert_false(matches(g, "hi Bobbie"));
    assert_false(matches(g, "hi Bob123"));
    assert_false(matches(g, "hiBob"));
    assert_false(matches(g, "hi Bob!!"));
    kvr_grammar_destroy(g);

    g = compile("root ::= [^\"\\\\]* \"\\x41\\u00e9\\U0001F600\" . [\\]\\-]");
    assert_true(matches(g, "xyzA\xc3\xa9\xf0\x9f\x98\x80\xe4\xb8\xad]"));
    assert_true(matches(g, "A\xc3\xa9\xf0\x9f\x98\x80z-"));
    assert_false(matches(g, "\"A\xc3\xa9\xf0\x9f\x98\x80z-"));
    assert_false(matches(g, "A\xc3\xa9\xf0\x9f\x98\x80z"));
    kvr_grammar_destroy(g);

    g = compile("root ::= \"a\"{2} \"b\"{2,} \"c\"{0,2} \"d\"{1,}");
    assert_true(matches(g, "aabbd"));
    assert_true(matches(g, "aabbbbccdd"));
    assert_false(matches(g, "abbd"));
    assert_false(matches(g, "aabd"));
    assert_false(matches(g, "aabbcccd"));
    kvr_grammar_destroy(g);
}

/* Bytes split anywhere, including inside a character, give the same answer; a refused
 * byte leaves the state as it was; a bad UTF-8 byte is refused. */
static void test_bytes_split(void **state)
{
    (void)state;
    struct kvr_grammar *g = compile("root ::= \"\xc3\xa9t\xc3\xa9 \" [\\u4e00-\\u9fff]+");
    const char *text = "\xc3\xa9t\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87";
    size_t n = strlen(text);
    for (size_t cut = 0; cut <= n; cut++) {
        struct kvr_grammar_match *m;
        assert_int_equal(kvr_grammar_match_create(&m, g), 0);
        assert_int_equal(kvr_grammar_match_bytes(m, text, cut), 0);
        assert_int_equal(kvr_grammar_match_bytes(m, "x", 1), KVR_EINVAL);
        assert_int_equal(kvr_grammar_match_bytes(m, "\xff", 1), KVR_EINVAL);
        assert_int_equal(kvr_grammar_match_bytes(m, text + cut, n - cut), 0);
        assert_true(kvr_grammar_match_complete(m));
        kvr_grammar_match_destroy(m);
    }
    struct kvr_grammar_match *m;
    assert_int_equal(kvr_grammar_match_create(&m, g), 0);
    assert_int_equal(kvr_grammar_match_bytes(m, text, 8), 0);
    assert_false(kvr_grammar_match_complete(m)); /* half of a character */
    /* a lead byte whose characters lie outside the class is refused at once */
    assert_int_equal(kvr_grammar_match_bytes(m, "\xf0", 1), KVR_EINVAL);
    assert_int_equal(kvr_grammar_match_cp(m, 0xad), KVR_EINVAL);
    kvr_grammar_match_destroy(m);
    kvr_grammar_destroy(g);
}

/* ---- random grammars against a naive matcher ------------------------------------------------ */

/* A tiny grammar AST: a node set of end positions is computed directly (naive). */
enum nk { NK_LIT, NK_CLASS, NK_SEQ, NK_ALT, NK_STAR, NK_PLUS, NK_OPT, NK_REP, NK_REF };
struct node {
    enum nk k;
    char lit[4];
    char cls[4];
    bool neg;
    int a, b; /* children (SEQ/ALT), child (STAR..REP), rule (REF) */
    int m, n; /* REP */
};
#define MAXN 200
#define NRULES 4
#define MAXLEN 5
static struct node nodes[MAXN];
static int n_nodes;
static int rule_root[NRULES];

static int gen_into(uint64_t *rng, int depth, int rule, int id);

static int gen(uint64_t *rng, int depth, int rule)
{
    return gen_into(rng, depth, rule, n_nodes++);
}

static int gen_into(uint64_t *rng, int depth, int rule, int id)
{
    struct node *x = &nodes[id];
    memset(x, 0, sizeof *x);
    uint64_t r = kvr_splitmix64(rng) % (depth > 2 ? 3 : 9);
    if (r == 2 && rule == 0)
        r = 0;
    switch (r) {
    case 0:
        x->k = NK_LIT;
        for (uint64_t i = 0, l = kvr_splitmix64(rng) % 3; i < l; i++)
            x->lit[i] = (char)('a' + kvr_splitmix64(rng) % 3);
        break;
    case 1:
        x->k = NK_CLASS;
        x->neg = kvr_splitmix64(rng) % 4 == 0;
        x->cls[0] = (char)('a' + kvr_splitmix64(rng) % 3);
        x->cls[1] = (char)('a' + kvr_splitmix64(rng) % 3);
        break;
    case 2:
        x->k = NK_REF;
        x->a = (int)(kvr_splitmix64(rng) % (uint64_t)rule); /* earlier rules only */
        break;
    case 3:
    case 4:
        x->k = r == 3 ? NK_SEQ : NK_ALT;
        x->a = gen(rng, depth + 1, rule);
        nodes[id].b = gen(rng, depth + 1, rule);
        break;
    default: /* the repeated item always consumes: a nullable one is refused (grammar.h) */
        x->k = (enum nk)(NK_STAR + (r - 5));
        x->a = n_nodes;
        nodes[n_nodes++] = (struct node){.k = NK_SEQ, .a = n_nodes, .b = n_nodes + 1};
        nodes[n_nodes++] = (struct node){.k = NK_CLASS, .cls = {'a', 'c'}};
        n_nodes++;
        nodes[id].a = x->a;
        gen_into(rng, depth + 1, rule, x->a + 2);
        if (nodes[id].k == NK_REP) {
            nodes[id].m = (int)(kvr_splitmix64(rng) % 3);
            int extra = (int)(kvr_splitmix64(rng) % 3);
            nodes[id].n = extra ? nodes[id].m + extra - 1 : -1; /* -1: unbounded */
        }
    }
    return id;
}

static void print(char *out, int id)
{
    const struct node *x = &nodes[id];
    char t[64];
    switch (x->k) {
    case NK_LIT:
        sprintf(t, "\"%s\"", x->lit);
        strcat(out, t);
        break;
    case NK_CLASS:
        sprintf(t, "[%s%c-%c]", x->neg ? "^" : "", x->cls[0] < x->cls[1] ? x->cls[0] : x->cls[1],
                x->cls[0] < x->cls[1] ? x->cls[1] : x->cls[0]);
        strcat(out, t);
        break;
    case NK_REF:
        sprintf(t, "r%d", x->a);
        strcat(out, t);
        break;
    case NK_SEQ:
    case NK_ALT:
        strcat(out, "(");
        print(out, x->a);
        strcat(out, x->k == NK_SEQ ? " " : " | ");
        print(out, x->b);
        strcat(out, ")");
        break;
    default:
        strcat(out, "(");
        print(out, x->a);
        strcat(out, ")");
        if (x->k == NK_STAR)
            strcat(out, "*");
        else if (x->k == NK_PLUS)
            strcat(out, "+");
        else if (x->k == NK_OPT)
            strcat(out, "?");
        else if (x->n < 0) {
            sprintf(t, "{%d,}", x->m);
            strcat(out, t);
        } else if (x->n == x->m) {
            sprintf(t, "{%d}", x->m);
            strcat(out, t);
        } else {
            sprintf(t, "{%d,%d}", x->m, x->n);
            strcat(out, t);
        }
    }
}

/* End positions (a bit set) of node id matched at each start in `from` over s. */
static uint32_t naive(int id, const char *s, int len, uint32_t from)
{
    const struct node *x = &nodes[id];
    uint32_t out = 0;
    switch (x->k) {
    case NK_LIT:
        for (int i = 0; i <= len; i++)
            if ((from >> i) & 1) {
                int l = (int)strlen(x->lit);
                if (i + l <= len && !memcmp(s + i, x->lit, (size_t)l))
                    out |= 1u << (i + l);
            }
        return out;
    case NK_CLASS: {
        char lo = x->cls[0] < x->cls[1] ? x->cls[0] : x->cls[1];
        char hi = x->cls[0] < x->cls[1] ? x->cls[1] : x->cls[0];
        for (int i = 0; i < len; i++)
            if (((from >> i) & 1) && ((s[i] >= lo && s[i] <= hi) != x->neg))
                out |= 1u << (i + 1);
        return out;
    }
    case NK_REF:
        return naive(rule_root[x->a], s, len, from);
    case NK_SEQ:
        return naive(x->b, s, len, naive(x->a, s, len, from));
    case NK_ALT:
        return naive(x->a, s, len, from) | naive(x->b, s, len, from);
    case NK_OPT:
        return from | naive(x->a, s, len, from);
    case NK_STAR:
    case NK_PLUS: {
        uint32_t reach = x->k == NK_STAR ? from : 0, cur = naive(x->a, s, len, from);
        while ((cur | reach) != reach) {
            reach |= cur;
            cur = naive(x->a, s, len, cur);
        }
        return reach;
    }
    case NK_REP: {
        uint32_t cur = from;
        for (int k = 0; k < x->m; k++)
            cur = naive(x->a, s, len, cur);
        uint32_t reach = cur;
        for (int k = x->m; x->n < 0 ? k < len + 1 : k < x->n; k++) {
            cur = naive(x->a, s, len, cur);
            reach |= cur;
        }
        return reach;
    }
    }
    return 0;
}

static void test_random_vs_naive(void **state)
{
    (void)state;
    uint64_t rng = 12345;
    static char text[8192];
    int n_refused = 0;
    for (int trial = 0; trial < 150; trial++) {
        n_nodes = 0;
        text[0] = 0;
        for (int r = 0; r < NRULES; r++) {
            rule_root[r] = gen(&rng, 0, r);
            char line[32];
            sprintf(line, "%sr%d ::= ", r ? "\n" : "", r);
            strcat(text, line);
            print(text, rule_root[r]);
        }
        strcat(text, "\nroot ::= r3\n");
        struct kvr_grammar *g = NULL;
        struct kvr_err err = {0};
        if (kvr_grammar_compile(&g, text, strlen(text), &err)) {
            /* a repeated item that matches the empty text is left recursion */
            if (!strstr(err.msg, "left-recursive"))
                fail_msg("%s\n%s", err.msg, text);
            n_refused++;
            continue;
        }
        struct kvr_grammar_match *m;
        assert_int_equal(kvr_grammar_match_create(&m, g), 0);
        char s[MAXLEN + 1];
        /* every string over {a, b, c, d} up to MAXLEN */
        for (int len = 0; len <= MAXLEN; len++) {
            int total = 1;
            for (int i = 0; i < len; i++)
                total *= 4;
            for (int w = 0; w < total; w++) {
                int v = w;
                for (int i = 0; i < len; i++, v /= 4)
                    s[i] = (char)('a' + v % 4);
                s[len] = 0;
                bool in = (naive(rule_root[3], s, len, 1u) >> len) & 1;
                kvr_grammar_match_reset(m);
                int rc = kvr_grammar_match_bytes(m, s, (size_t)len);
                bool got = !rc && kvr_grammar_match_complete(m);
                if (in != got)
                    fail_msg("grammar:\n%s\nstring '%s': naive %d, matcher %d (rc %d)", text, s, in,
                             got, rc);
                if (rc) { /* refused: no word of the language continues the prefix */
                    size_t k = 0;
                    kvr_grammar_match_reset(m);
                    while (!kvr_grammar_match_bytes(m, s + k, 1))
                        k++;
                    for (int e = (int)k + 1; e <= MAXLEN; e++) {
                        /* any word of length e starting with s[0..k+1) */
                        int rest = e - (int)k - 1, tot = 1;
                        for (int i = 0; i < rest; i++)
                            tot *= 4;
                        char u[MAXLEN + 1];
                        memcpy(u, s, k + 1);
                        for (int w2 = 0; w2 < tot; w2++) {
                            int v2 = w2;
                            for (int i = 0; i < rest; i++, v2 /= 4)
                                u[k + 1 + (size_t)i] = (char)('a' + v2 % 4);
                            if ((naive(rule_root[3], u, e, 1u) >> e) & 1)
                                fail_msg("grammar:\n%s\nprefix of '%.*s' refused at %zu", text, e,
                                         u, k);
                        }
                    }
                }
            }
        }
        kvr_grammar_match_destroy(m);
        kvr_grammar_destroy(g);
    }
    assert_int_equal(n_refused, 0);
}

/* ---- masks ---------------------------------------------------------------------------------- */

static const char *vocab_bytes[] = {
    "{",    "}",     "\"",   "\"a",  "a",    "ab",       "abc",      "b",    "c",
    ":",    ",",     " ",    "  ",   "{\"",  "\":",      "1",        "12",   "123",
    "-",    ".",     "e",    "\xc3", "\xa9", "\xc3\xa9", "\xe4\xb8", "\xad", "\xe4\xb8\xad",
    "true", "false", "null", "\\",   "\\n",  "n",        "\n",       "",     "x\"",
    "\"}",  "[",     "]",    "u",    "l",    "r",        "s",        "t",    "f",
    "E",    "+",     "/",    "\t",   "<eos>"};
#define NV ((int32_t)(sizeof vocab_bytes / sizeof *vocab_bytes))

static struct kvr_grammar_vocab *small_vocab(void)
{
    size_t lens[NV];
    bool eog[NV] = {0};
    for (int32_t i = 0; i < NV; i++)
        lens[i] = strlen(vocab_bytes[i]);
    eog[NV - 1] = true;
    struct kvr_grammar_vocab *v = NULL;
    assert_int_equal(kvr_grammar_vocab_create_bytes(&v, NV, vocab_bytes, lens, eog, NULL), 0);
    return v;
}

static const char *json_gbnf =
    "root ::= value\n"
    "value ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n"
    "object ::= \"{\" ws ( string ws \":\" ws value ws (\",\" ws string ws \":\" ws value ws)* )? "
    "\"}\"\n"
    "array ::= \"[\" ws ( value ws (\",\" ws value ws)* )? \"]\"\n"
    "string ::= \"\\\"\" ( [^\"\\\\\\x00-\\x1f] | \"\\\\\" [\"\\\\/bfnrt] )* \"\\\"\"\n"
    "number ::= \"-\"? [0-9]+ (\".\" [0-9]+)? ([eE] [-+]? [0-9]+)?\n"
    "ws ::= [ \\t\\n]{0,8}\n";

/* The mask of every state along random walks equals matching each token on a copy. */
static void test_mask_vs_tokens(void **state)
{
    (void)state;
    struct kvr_grammar_vocab *v = small_vocab();
    struct kvr_grammar *g = compile(json_gbnf);
    struct kvr_grammar_match *m, *c;
    assert_int_equal(kvr_grammar_match_create(&m, g), 0);
    assert_int_equal(kvr_grammar_match_create(&c, g), 0);
    uint64_t rng = 7;
    uint32_t bits[(NV + 31) / 32];
    int finished = 0;
    for (int walk = 0; walk < 200; walk++) {
        kvr_grammar_match_reset(m);
        for (int step = 0; step < 40; step++) {
            int32_t n = kvr_grammar_mask(m, v, bits);
            int32_t count = 0, allowed[NV];
            for (int32_t t = 0; t < NV; t++) {
                bool bit = (bits[t >> 5] >> (t & 31)) & 1;
                assert_int_equal(kvr_grammar_match_copy(c, m), 0);
                bool ok =
                    !kvr_grammar_accept_token(c, v, t) && strlen(vocab_bytes[t]) + (t == NV - 1);
                if (bit != ok)
                    fail_msg("walk %d step %d token %d '%s': mask %d, match %d", walk, step, t,
                             vocab_bytes[t], bit, ok);
                if (ok)
                    allowed[count++] = t;
            }
            assert_int_equal(n, count);
            if (!count)
                fail_msg("walk %d step %d: nothing allowed", walk, step);
            int32_t t = allowed[kvr_splitmix64(&rng) % (uint64_t)count];
            if (getenv("GRAMMAR_TRACE"))
                fprintf(stderr, "%d.%d '%s'\n", walk, step, vocab_bytes[t]);
            assert_int_equal(kvr_grammar_accept_token(m, v, t), 0);
            if (t == NV - 1) {
                finished++;
                break;
            }
        }
    }
    assert_true(finished > 10);
    struct kvr_grammar_stats st;
    kvr_grammar_match_stats(m, &st);
    assert_true(st.n_cached > 0); /* states recur */
    kvr_grammar_match_destroy(c);
    kvr_grammar_match_destroy(m);
    kvr_grammar_destroy(g);
    kvr_grammar_vocab_destroy(v);
}

/* apply: -inf exactly where the mask refuses; the end token only when complete. */
static void test_apply(void **state)
{
    (void)state;
    struct kvr_grammar_vocab *v = small_vocab();
    struct kvr_grammar *g = compile("root ::= \"ab\" \"c\"?");
    struct kvr_grammar_match *m;
    assert_int_equal(kvr_grammar_match_create(&m, g), 0);
    float logits[NV];
    for (int32_t i = 0; i < NV; i++)
        logits[i] = (float)i;
    assert_int_equal(kvr_grammar_apply(m, v, logits, NV), 3); /* "a", "ab", "abc" */
    for (int32_t i = 0; i < NV; i++)
        assert_true(i >= 4 && i <= 6 ? logits[i] == (float)i : isinf(logits[i]));
    assert_int_equal(kvr_grammar_accept_token(m, v, NV - 1), KVR_EINVAL);
    assert_int_equal(kvr_grammar_accept_token(m, v, 5), 0);
    for (int32_t i = 0; i < NV; i++)
        logits[i] = 0.0f;
    assert_int_equal(kvr_grammar_apply(m, v, logits, NV), 2); /* "c", <eos> */
    assert_true(logits[8] == 0.0f && logits[NV - 1] == 0.0f && isinf(logits[6]));
    assert_int_equal(kvr_grammar_accept_token(m, v, NV - 1), 0);
    kvr_grammar_match_destroy(m);
    kvr_grammar_destroy(g);
    kvr_grammar_vocab_destroy(v);
}

/* Deep nesting beyond the stack limit is refused instead of growing without bound. */
static void test_depth_limit(void **state)
{
    (void)state;
    struct kvr_grammar *g = compile("root ::= \"[\" root \"]\" | \"x\"");
    struct kvr_grammar_match *m;
    assert_int_equal(kvr_grammar_match_create(&m, g), 0);
    int k = 0;
    while (k < 2000 && !kvr_grammar_match_bytes(m, "[", 1))
        k++;
    assert_true(k > 100 && k < (int)KVR_GRAMMAR_MAX_DEPTH + 2);
    kvr_grammar_match_destroy(m);
    kvr_grammar_destroy(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_errors),         cmocka_unit_test(test_syntax),
        cmocka_unit_test(test_bytes_split),    cmocka_unit_test(test_random_vs_naive),
        cmocka_unit_test(test_mask_vs_tokens), cmocka_unit_test(test_apply),
        cmocka_unit_test(test_depth_limit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
