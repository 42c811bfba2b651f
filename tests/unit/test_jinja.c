/* test_jinja.c - the Jinja interpreter: whitespace rules, expressions, statements, filters
 * and methods against the strings jinja2 (configured as Hugging Face configures it)
 * renders for them, then errors, limits and allocation failures. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "jinja/jinja.h"
#include "core/alloc.h"

#include <stdio.h>
#include <string.h>

struct rcase {
    const char *tmpl;
    const char *vars; /* JSON object, or NULL */
    const char *want;
};

static int render(const char *tmpl, const char *vars, const struct kvr_jinja_limits *lim,
                  char **out, struct kvr_err *err)
{
    struct kvr_jinja *t = NULL;
    *out = NULL;
    int rc = kvr_jinja_parse(&t, tmpl, strlen(tmpl), lim, err);
    if (rc)
        return rc;
    json_t *v = vars ? json_loads(vars, 0, NULL) : NULL;
    if (vars)
        assert_non_null(v);
    struct tm now = {.tm_year = 124, .tm_mon = 6, .tm_mday = 26, .tm_hour = 12};
    size_t len = 0;
    rc = kvr_jinja_render(t, v, &now, out, &len, err);
    if (!rc)
        assert_int_equal(len, strlen(*out));
    json_decref(v);
    kvr_jinja_destroy(t);
    return rc;
}

static void check_cases(const struct rcase *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char *out;
        struct kvr_err err = {0};
        int rc = render(cases[i].tmpl, cases[i].vars, NULL, &out, &err);
        if (rc != 0 || strcmp(out, cases[i].want) != 0) {
            fprintf(stderr, "case %zu: %s\n  want: [%s]\n  got:  [%s] (rc %d: %s)\n", i,
                    cases[i].tmpl, cases[i].want, out ? out : "", rc, err.msg);
            fail();
        }
        kvr_free(out);
    }
}

#define N(a) (sizeof(a) / sizeof((a)[0]))

static void test_whitespace(void **state)
{
    static const struct rcase cases[] = {
        /* trim_blocks eats the newline after %}, lstrip_blocks the indentation before {%. */
        {"{% if true %}\n  yes\n{% endif %}\n", NULL, "  yes\n"},
        {"a\n    {% if true %}\nb\n    {% endif %}\nc", NULL, "a\nb\nc"},
        {"a  {% if true %}b{% endif %}", NULL, "a  b"},
        {"  {{ 'x' }}\n", NULL, "  x"},
        {"a\n  {%- if true %} b {% endif -%}  \n c", NULL, "a b c"},
        {"a\n  {%+ if true %}b{% endif %}", NULL, "a\n  b"},
        {"{% if true +%}\nb{% endif %}", NULL, "\nb"},
        {"x {#- comment -#} y\n{# c #}\nz", NULL, "xy\nz"},
        {"{{- ' a ' -}}  \n\n", NULL, " a "},
        {"a\r\nb\rc\n\n", NULL, "a\nb\nc\n"},
        {"{% raw %}{{ not }}{% endraw %}", NULL, "{{ not }}"},
        {"{{ {'a': {'b': 1}}['a']['b'] }}", NULL, "1"},
    };
    check_cases(cases, N(cases));
}

static void test_expressions(void **state)
{
    static const struct rcase cases[] = {
        {"{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ -2 ** 2 }} {{ 2 ** 3 ** 2 }}", NULL, "7 9 4 64"},
        {"{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ 7 / 2 }} {{ 1 / 3 }}", NULL,
         "3 -4 -2 3.5 0.3333333333333333"},
        {"{{ 1.0 }} {{ 1e20 }} {{ 1.5e-7 }} {{ 0.1 + 0.2 }} {{ 2.0 * 3 }}", NULL,
         "1.0 1e+20 1.5e-07 0.30000000000000004 6.0"},
        {"{{ 'a' ~ 1 ~ none ~ true }} {{ 'ab' * 3 }} {{ [1] + [2] }}", NULL,
         "a1NoneTrue ababab [1, 2]"},
        {"{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 'b' > 'a' }} {{ 1 == 1.0 }} {{ true == 1 }}", NULL,
         "True False True True True"},
        {"{{ 'ell' in 'hello' }} {{ 2 not in [1, 3] }} {{ 'k' in {'k': 1} }}", NULL,
         "True True True"},
        {"{{ none or 'x' }} {{ 0 and 1 }} {{ not 0 }} {{ 'y' if 0 else 'n' }}", NULL, "x 0 True n"},
        {"[{{ 'y' if false }}]", NULL, "[]"},
        {"{{ [1, 'a', none, true, 2.5] }} {{ (1,) }} {{ {'k': [1]} }} {{ ('a', \"b'\") }}", NULL,
         "[1, 'a', None, True, 2.5] (1,) {'k': [1]} ('a', \"b'\")"},
        {"{{ 'héllo'[1] }} {{ 'héllo'[-1] }} {{ 'héllo'[1:3] }} {{ 'abc'[::-1] }}", NULL,
         "é o él cba"},
        {"{{ [1, 2, 3, 4][1:] }} {{ [1, 2, 3, 4][:-1] }} {{ [1, 2, 3, 4][::2] }}", NULL,
         "[2, 3, 4] [1, 2, 3] [1, 3]"},
        {"{{ m.role }} {{ m['content'] }} {{ m.missing }}|{{ l.0 }} {{ l[5] }}|",
         "{\"m\": {\"role\": \"user\", \"content\": \"hi\"}, \"l\": [7]}", "user hi |7 |"},
        {"{{ 'a' 'b' }} {{ \"\\n\\t\\u00e9\\x41\" }}", NULL, "ab \n\téA"},
        {"{{ 0x1f }} {{ 0o17 }} {{ 0b101 }} {{ 0 }} {{ 00 }} {{ 007.5 }} [{{ 1[::-1] }}]", NULL,
         "31 15 5 0 0 7.5 []"},
        {"{% set ns = namespace(a=1, b='x') %}{{ ns }}", NULL, "<Namespace {'a': 1, 'b': 'x'}>"},
        {"{{ {'k': 'é😀'}|tojson(true) }}|{{ [1]|tojson(ensure_ascii=true, indent=1) }}", NULL,
         "{\"k\": \"\\u00e9\\ud83d\\ude00\"}|[\n 1\n]"},
    };
    check_cases(cases, N(cases));
}

static void test_statements(void **state)
{
    static const struct rcase cases[] = {
        {"{% for x in [1, 2, 3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
         "{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
         NULL, "103TrueFalse3;212FalseFalse3;321FalseTrue3;"},
        {"{% for x in 'ab' %}{{ loop.previtem }}-{{ x }}-{{ loop.nextitem }} {% endfor %}", NULL,
         "-a-b a-b- "},
        {"{% for x in [] %}a{% else %}empty{% endfor %}", NULL, "empty"},
        {"{% for x in range(10) if x is odd %}{{ x }}{% endfor %}", NULL, "13579"},
        {"{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}"
         "{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
         NULL, "013"},
        {"{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }} {% endfor %}", NULL,
         "a=1 b=2 "},
        {"{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.depth }}{{ a }}{{ b }}"
         "{{ loop.cycle('+', '-') }}{% endfor %}{% endfor %}",
         NULL, "21x+21y-22x+22y-"},
        {"{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}", NULL, "1"},
        {"{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}"
         "{% endfor %}{{ ns.n }}",
         NULL, "6"},
        {"{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t %}in{{ a }}{% endset %}[{{ t }}]", NULL,
         "12[in1]"},
        {"{% if 0 %}a{% elif '' %}b{% elif [1] %}c{% else %}d{% endif %}", NULL, "c"},
        {"{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
         "{{ greet('Ann') }} {{ greet('Bo', punct='?') }}",
         NULL, "Hi Ann! Hi Bo?"},
        {"{% filter upper %}abc{% endfilter %}{% generation %}x{% endgeneration %}", NULL, "ABCx"},
        {"{{ strftime_now('%d %b %Y') }}", NULL, "26 Jul 2024"},
        {"{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
         "{% endif %}{{ add_generation_prompt }}",
         NULL, "False"},
    };
    check_cases(cases, N(cases));
}

static void test_filters(void **state)
{
    static const struct rcase cases[] = {
        {"[{{ '  a b \n' | trim }}] {{ 'x'|upper }}{{ 'ÉA'|lower }} {{ 'hello wORLD'|title }}"
         " {{ 'hELLO'|capitalize }}",
         NULL, "[a b] Xéa Hello World Hello"},
        {"{{ [3, 1, 2]|sort }} {{ ['b', 'A', 'c']|sort }} {{ [1, 2]|reverse|list }} "
         "{{ 'abc'|reverse }} {{ [1, 1, 2]|unique|list }}",
         NULL, "[1, 2, 3] ['A', 'b', 'c'] [2, 1] cba [1, 2]"},
        {"{{ ms|map(attribute='role')|join(',') }} {{ ms|selectattr('role', 'equalto', 'u')|list"
         "|length }} {{ ms|rejectattr('role', 'eq', 'u')|map(attribute='c')|first }}",
         "{\"ms\": [{\"role\": \"u\", \"c\": 1}, {\"role\": \"a\", \"c\": 2}]}", "u,a 1 2"},
        {"{{ [1, 2, 3]|first }}{{ [1, 2, 3]|last }}{{ 'abc'|length }}{{ {'a': 1}|count }}"
         "{{ [1, 2, 3]|sum }}{{ [4, 9, 2]|max }}{{ [4, 9, 2]|min }}",
         NULL, "1331692"},
        {"{{ x|default('d') }} {{ ''|default('e', true) }} {{ '3'|int + 1 }} {{ '2.5'|float }} "
         "{{ 2.567|round(2) }} {{ -3|abs }} {{ 'a-b'|replace('-', '+') }}",
         NULL, "d e 4 2.5 2.57 3 a+b"},
        {"{{ {'b': 1, 'a': 2}|dictsort }} {{ {'a': 1}|items|list }}", NULL,
         "[('a', 2), ('b', 1)] [('a', 1)]"},
        {"{{ 'a\nb'|indent(2) }}|{{ 'a\nb'|indent(2, true) }}|{{ [1, 2]|string }}", NULL,
         "a\n  b|  a\n  b|[1, 2]"},
        {"{{ {'k': 'é\"\\n', 'n': [1, 2.5, true, none]}|tojson }}", NULL,
         "{\"k\": \"é\\\"\\n\", \"n\": [1, 2.5, true, null]}"},
        {"{{ {'a': [1, {}], 'b': []}|tojson(indent=2) }}", NULL,
         "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}"},
    };
    check_cases(cases, N(cases));
}

static void test_methods_and_tests(void **state)
{
    static const struct rcase cases[] = {
        {"{{ '  x  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\\nab\\n'.lstrip('\\n') }}|"
         "{{ 'a b  c'.split() }}{{ 'a,b'.split(',') }}{{ 'a b c'.split(' ', 1) }}",
         NULL, "x|a|ab\n|['a', 'b', 'c']['a', 'b']['a', 'b c']"},
        {"{{ 'hello'.startswith('he') }}{{ 'hello'.endswith(('x', 'lo')) }}"
         "{{ 'héllo'.find('l') }}{{ 'aXbX'.count('X') }}{{ '-'.join(['a', 'b']) }}"
         "{{ 'Hi'.upper() }}{{ 'x y'.title() }}",
         NULL, "TrueTrue22a-bHIX Y"},
        {"{{ d.get('a') }} {{ d.get('z', 5) }} {{ d.keys()|list }} {{ d.values()|list }}",
         "{\"d\": {\"a\": 1}}", "1 5 ['a'] [1]"},
        {"{{ x is defined }}{{ none is none }}{{ 'a' is string }}{{ 1 is number }}"
         "{{ {} is mapping }}{{ [] is iterable }}{{ 3 is divisibleby 3 }}{{ 2 is even }}"
         "{{ 1 is not odd }}{{ 'a' is in 'abc' }}{{ false is false }}",
         NULL, "FalseTrueTrueTrueTrueTrueTrueTrueFalseTrueTrue"},
    };
    check_cases(cases, N(cases));
}

static void expect_error(const char *tmpl, const char *vars, const struct kvr_jinja_limits *lim,
                         int code, const char *msg_part)
{
    char *out;
    struct kvr_err err = {0};
    int rc = render(tmpl, vars, lim, &out, &err);
    if (rc != code || !strstr(err.msg, msg_part)) {
        fprintf(stderr, "%s: want %d with '%s', got %d: %s\n", tmpl, code, msg_part, rc, err.msg);
        fail();
    }
    assert_null(out);
}

static void test_errors(void **state)
{
    expect_error("a\n{% if x %}\nb", NULL, NULL, KVR_EFORMAT, "line 3: unexpected end");
    expect_error("{{ 1 + }}", NULL, NULL, KVR_EFORMAT, "line 1:");
    expect_error("{% for x in y %}{% endif %}", NULL, NULL, KVR_EFORMAT, "endif");
    expect_error("{% break %}", NULL, NULL, KVR_EFORMAT, "outside of a loop");
    expect_error("{% include 'x' %}", NULL, NULL, KVR_EFORMAT, "unknown");
    expect_error("{{ 'abc }}", NULL, NULL, KVR_EFORMAT, "unterminated string");
    expect_error("{{ x|nosuchfilter }}", NULL, NULL, KVR_EFORMAT, "no filter named");
    expect_error("\n\n{{ raise_exception('roles must alternate') }}", NULL, NULL, KVR_EINVAL,
                 "line 3: roles must alternate");
    expect_error("{{ x + 1 }}", NULL, NULL, KVR_EFORMAT, "'x' is undefined");
    expect_error("{{ x.y }}", NULL, NULL, KVR_EFORMAT, "'x' is undefined");
    expect_error("{{ 1 + 'a' }}", NULL, NULL, KVR_EFORMAT, "unsupported operand");
    expect_error("{{ 1 // 0 }}", NULL, NULL, KVR_EFORMAT, "by zero");
    expect_error("{{ 9223372036854775807 + 1 }}", NULL, NULL, KVR_ERANGE, "overflow");
    expect_error("{{ x|tojson }}", NULL, NULL, KVR_EFORMAT, "not JSON serializable");
    expect_error("{{ 1 < 'a' }}", NULL, NULL, KVR_EFORMAT, "not supported");
    expect_error("{{ range(1000000)|length }}", NULL, NULL, KVR_ERANGE, "range too big");
    expect_error("{{ 'a\xff' }}", NULL, NULL, KVR_EFORMAT, "UTF-8");
    expect_error("{{ 010 }}", NULL, NULL, KVR_EFORMAT, "expected '}}'");
    expect_error("{{ [1]|tojson(indnt=2) }}", NULL, NULL, KVR_EFORMAT, "unexpected keyword");
    expect_error("{{ [1]|join(',', d='x') }}", NULL, NULL, KVR_EFORMAT, "multiple values");
    expect_error("{{ [1]|trim(1, 2) }}", NULL, NULL, KVR_EFORMAT, "at most 1 arguments");
    expect_error("{{ nothing|indent }}", NULL, NULL, KVR_EFORMAT, "'nothing' is undefined");
    expect_error("{{ [{'a': 1}]|rejectattr('c.x')|list }}", NULL, NULL, KVR_EFORMAT,
                 "'c' is undefined");
    expect_error("{{ 1 is eq(1, 2) }}", NULL, NULL, KVR_EFORMAT, "expected 1 argument(s)");
    expect_error("{{ 1 is odd(1) }}", NULL, NULL, KVR_EFORMAT, "expected 0 argument(s)");
    /* 127 digits fill the lexer's buffer; the '.' after them once wrote past its end. */
    char big[160] = "{{ ";
    memset(big + 3, '1', 127);
    strcpy(big + 130, ".5 }}");
    expect_error(big, NULL, NULL, KVR_EFORMAT, "number literal too long");
    char *out;
    struct kvr_err err = {0};
    assert_int_equal(render("x", "[1]", NULL, &out, &err), KVR_EINVAL);
}

/* Python's % formatting (and the format filter), round(), rsplit with maxsplit, index and
 * count; every expected text is jinja2 3.1's. */
static void test_python_builtins(void **state)
{
    static const struct rcase cases[] = {
        {"{{ '%s|%5.1f|%-4d|%x|%r' % ('a', 2.5, 7, 255, 'q') }}", NULL, "a|  2.5|7   |ff|'q'"},
        {"{{ '%+d % d %05d %#x %#o %X %c%c %%' % (5, 5, -42, 255, 8, 255, 65, '\u00e9') }}", NULL,
         "+5  5 -0042 0xff 0o10 FF A\u00e9 %"},
        {"{{ '%.3s|%8.2s|%-4s|' % ('abcdef', 'xyz', '\u6771') }}{{ '%(a)s-%(b)03d' % d }}",
         "{\"d\": {\"a\": \"A\", \"b\": 4}}", "abc|      xy|\u6771   |A-004"},
        {"{{ '%d %d %.0f %.0f %s' % (3.9, -3.9, 0.5, 1.5, [1]) }}", NULL, "3 -3 0 2 [1]"},
        {"{{ '%s-%s'|format('a', 1) }} {{ '%(x)s'|format(x=5) }} {{ '%.2f'|format(2.5) }}", NULL,
         "a-1 5 2.50"},
        {"{{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ -2.5|round }} {{ 3|round }} "
         "{{ 25|round(-1) }} {{ 35|round(-1) }} {{ 2.1|round(0, 'ceil') }}",
         NULL, "2.0 4.0 2.67 -2.0 3 20 40 3.0"},
        {"{{ 'a b  c'.rsplit(' ', 1) }} {{ '  a b  c  '.rsplit(None, 1) }} {{ ',a,'.rsplit(',', 1) "
         "}}"
         " {{ 'x y'.rsplit(maxsplit=0) }} {{ 'a,b'.rsplit(',') }}",
         NULL, "['a b ', 'c'] ['  a b', 'c'] [',a', ''] ['x y'] ['a', 'b']"},
        {"{{ [3, 1, 3].index(3) }} {{ [3, 1, 3].count(3) }} {{ ['a', none].index(none) }} "
         "{{ 'Hello'.index('l') }}",
         NULL, "0 2 1 2"},
    };
    check_cases(cases, N(cases));
    expect_error("{{ '%s %s' % ('a',) }}", NULL, NULL, KVR_EFORMAT, "not enough arguments");
    expect_error("{{ '%s' % ('a', 'b') }}", NULL, NULL, KVR_EFORMAT, "not all arguments");
    expect_error("{{ '%d' % 'x' }}", NULL, NULL, KVR_EFORMAT, "a real number is required");
    expect_error("{{ '%x' % 2.0 }}", NULL, NULL, KVR_EFORMAT, "an integer is required");
    expect_error("{{ '%z' % 1 }}", NULL, NULL, KVR_EFORMAT, "unsupported format character");
    expect_error("{{ 'a%' % () }}", NULL, NULL, KVR_EFORMAT, "incomplete format");
    expect_error("{{ '%999s' % 1 }}", NULL, NULL, KVR_ERANGE, "too large");
    expect_error("{{ '%s'|format(1, x=2) }}", NULL, NULL, KVR_EFORMAT, "positional and keyword");
    expect_error("{{ [1].index(2) }}", NULL, NULL, KVR_EFORMAT, "not in list");
    expect_error("{{ 'ab'.index('q') }}", NULL, NULL, KVR_EFORMAT, "substring not found");
}

static void test_limits(void **state)
{
    struct kvr_jinja_limits lim;
    kvr_jinja_limits_default(&lim);
    lim.max_output_bytes = 1000;
    expect_error("{% for i in range(2000) %}x{% endfor %}", NULL, &lim, KVR_ERANGE, "output limit");
    expect_error("{{ 'x' * 5000 }}", NULL, &lim, KVR_ERANGE, "output limit");
    kvr_jinja_limits_default(&lim);
    lim.max_steps = 10000;
    expect_error("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}", NULL,
                 &lim, KVR_ERANGE, "step limit");
    kvr_jinja_limits_default(&lim);
    lim.max_depth = 20;
    expect_error("{{ ((((((((((((((((((((((1)))))))))))))))))))))) }}", NULL, &lim, KVR_ERANGE,
                 "nested");
    expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, &lim, KVR_ERANGE,
                 "nested");
    kvr_jinja_limits_default(&lim);
    lim.max_memory_bytes = 1 << 20;
    expect_error("{% set ns = namespace(s='x') %}{% for i in range(100000) %}"
                 "{% set ns.s = ns.s + 'xxxxxxxxxxxxxxxx' %}{% endfor %}",
                 NULL, &lim, KVR_ERANGE, "memory limit");
    kvr_jinja_limits_default(&lim);
    lim.max_nodes = 50;
    expect_error("{{ 1 }}{{ 2 }}{{ 3 }}{{ 4 }}{{ 5 }}{{ 6 }}{{ 7 }}{{ 8 }}{{ 9 }}{{ 10 }}"
                 "{{ 1 }}{{ 2 }}{{ 3 }}{{ 4 }}{{ 5 }}{{ 6 }}{{ 7 }}{{ 8 }}{{ 9 }}{{ 10 }}",
                 NULL, &lim, KVR_ERANGE, "more than 50");
    kvr_jinja_limits_default(&lim);
    lim.max_template_bytes = 4;
    expect_error("hello", NULL, &lim, KVR_ERANGE, "larger than");
}

/* Every allocation of parse and render failing in turn gives ENOMEM (or success once
 * the failure point is past the last allocation), never a crash or leak. */
static void test_alloc_failures(void **state)
{
    const char *tmpl = "{% set ns = namespace(a=[]) %}{% for m in messages %}"
                       "{{ m.role|upper }}: {{ m.content|trim }}{% endfor %}";
    const char *vars = "{\"messages\": [{\"role\": \"user\", \"content\": \" hi \"}]}";
    bool succeeded = false;
    for (long n = 0; n < 200 && !succeeded; n++) {
        struct kvr_jinja *t = NULL;
        struct kvr_err err = {0};
        json_t *v = json_loads(vars, 0, NULL);
        kvr_alloc_fail_after(n);
        int rc = kvr_jinja_parse(&t, tmpl, strlen(tmpl), NULL, &err);
        char *out = NULL;
        if (rc == 0)
            rc = kvr_jinja_render(t, v, NULL, &out, NULL, &err);
        kvr_alloc_fail_after(-1);
        if (rc == 0) {
            assert_string_equal(out, "USER: hi");
            succeeded = true;
        } else {
            assert_int_equal(rc, KVR_ENOMEM);
        }
        kvr_free(out);
        kvr_jinja_destroy(t);
        json_decref(v);
    }
    assert_true(succeeded);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_whitespace),        cmocka_unit_test(test_expressions),
        cmocka_unit_test(test_statements),        cmocka_unit_test(test_filters),
        cmocka_unit_test(test_methods_and_tests), cmocka_unit_test(test_errors),
        cmocka_unit_test(test_python_builtins),   cmocka_unit_test(test_limits),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
