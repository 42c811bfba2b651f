/* test_json_schema.c - JSON Schema to GBNF: each supported keyword's grammar compiles and
 * accepts the texts it should and refuses the ones it should not; every unsupported keyword
 * is refused with its JSON pointer; integer ranges are checked exhaustively. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/json_schema.h"
#include "model/grammar.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct kvr_grammar *schema_grammar(const char *schema_text)
{
    json_error_t jerr;
    json_t *s = json_loads(schema_text, JSON_DECODE_ANY, &jerr);
    if (!s)
        fail_msg("bad test schema: %s", jerr.text);
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    struct kvr_err err = {0};
    if (kvr_json_schema_gbnf(s, &out, &err))
        fail_msg("schema %s: %s", schema_text, err.msg);
    struct kvr_grammar *g = NULL;
    if (kvr_grammar_compile(&g, out.data, out.len, &err))
        fail_msg("schema %s: grammar does not compile: %s\n%s", schema_text, err.msg, out.data);
    kvr_sbuf_fini(&out);
    json_decref(s);
    return g;
}

static bool accepts(const struct kvr_grammar *g, const char *text)
{
    struct kvr_grammar_match *m;
    assert_int_equal(kvr_grammar_match_create(&m, g), 0);
    bool ok = !kvr_grammar_match_bytes(m, text, strlen(text)) && kvr_grammar_match_complete(m);
    kvr_grammar_match_destroy(m);
    return ok;
}

#define YES(g, t)                                                                                  \
    do {                                                                                           \
        if (!accepts(g, t))                                                                        \
            fail_msg("should accept: %s", t);                                                      \
    } while (0)
#define NO(g, t)                                                                                   \
    do {                                                                                           \
        if (accepts(g, t))                                                                         \
            fail_msg("should refuse: %s", t);                                                      \
    } while (0)

static void test_objects(void **state)
{
    (void)state;
    struct kvr_grammar *g = schema_grammar(
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
        "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
        "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\"]},\"maxItems\":2}},"
        "\"required\":[\"age\"],\"additionalProperties\":false}");
    YES(g, "{\"age\":3}");
    YES(g, "{\"name\":\"x y\", \"age\":150}");
    YES(g, "{ \"age\": 0, \"tags\": [\"a\", \"b\"] }");
    YES(g, "{\"name\":\"\",\"age\":42,\"tags\":[]}");
    NO(g, "{}");
    NO(g, "{\"name\":\"x\"}");
    NO(g, "{\"age\":151}");
    NO(g, "{\"age\":-1}");
    NO(g, "{\"age\":01}");
    NO(g, "{\"age\":3,\"tags\":[\"a\",\"b\",\"a\"]}");
    NO(g, "{\"age\":3,\"tags\":[\"c\"]}");
    NO(g, "{\"age\":3,\"other\":1}");
    NO(g, "{\"age\":3,\"name\":\"x\"}"); /* schema order */
    kvr_grammar_destroy(g);

    g = schema_grammar("{\"type\":\"object\",\"additionalProperties\":{\"type\":\"boolean\"}}");
    YES(g, "{}");
    YES(g, "{\"a\":true, \"b\":false}");
    NO(g, "{\"a\":1}");
    kvr_grammar_destroy(g);

    g = schema_grammar("{}");
    YES(g, "[1, {\"a\": [null, \"x\"]}, -2.5e3]");
    YES(g, "\"s\"");
    kvr_grammar_destroy(g);
}

static void test_unions_refs(void **state)
{
    (void)state;
    struct kvr_grammar *g = schema_grammar(
        "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
        "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},"
        "\"required\":[\"v\"]}},\"$ref\":\"#/$defs/node\"}");
    YES(g, "{\"v\":1}");
    YES(g, "{\"v\":1,\"kids\":[{\"v\":2,\"kids\":[{\"v\":3}]},{\"v\":4}]}");
    NO(g, "{\"v\":1,\"kids\":[{}]}");
    kvr_grammar_destroy(g);

    g = schema_grammar("{\"anyOf\":[{\"type\":\"null\"},{\"type\":[\"string\",\"number\"]},"
                       "{\"const\":{\"k\":[1,2]}}]}");
    YES(g, "null");
    YES(g, "\"x\"");
    YES(g, "-1.5");
    YES(g, "{\"k\":[1,2]}");
    NO(g, "true");
    kvr_grammar_destroy(g);

    g = schema_grammar("{\"type\":\"string\",\"enum\":[\"a\\\"b\",\"c\",3]}");
    YES(g, "\"a\\\"b\"");
    YES(g, "\"c\"");
    NO(g, "3"); /* not a string: left out */
    kvr_grammar_destroy(g);
}

static void test_strings(void **state)
{
    (void)state;
    struct kvr_grammar *g = schema_grammar("{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}");
    YES(g, "\"ab\"");
    YES(g, "\"a\\nb\"");
    NO(g, "\"a\"");
    NO(g, "\"abcd\"");
    kvr_grammar_destroy(g);

    g = schema_grammar("{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-\\\\d{3,4}(x|yz)?$\"}");
    YES(g, "\"AB-123\"");
    YES(g, "\"ZZ-1234yz\"");
    NO(g, "\"AB-12\"");
    NO(g, "\"ab-123\"");
    NO(g, "\"AB-123y\"");
    kvr_grammar_destroy(g);

    g = schema_grammar("{\"pattern\":\"[0-9]+\"}"); /* unanchored: contains digits */
    YES(g, "\"abc12def\"");
    NO(g, "\"abc\"");
    kvr_grammar_destroy(g);

    const char *fmts[][3] = {
        {"date", "\"2024-02-28\"", "\"2024-13-01\""},
        {"time", "\"23:59:01Z\"", "\"24:00:00Z\""},
        {"date-time", "\"2024-01-02T03:04:05Z\"", "\"2024-01-02 03:04:05\""},
        {"uuid", "\"123e4567-e89b-12d3-a456-426614174000\"",
         "\"123e4567e89b12d3a456426614174000\""},
        {"email", "\"a.b@example.com\"", "\"a.b.example.com\""},
        {"ipv4", "\"192.168.0.255\"", "\"192.168.0.256\""},
    };
    for (size_t i = 0; i < sizeof fmts / sizeof *fmts; i++) {
        char s[128];
        snprintf(s, sizeof s, "{\"type\":\"string\",\"format\":\"%s\"}", fmts[i][0]);
        g = schema_grammar(s);
        YES(g, fmts[i][1]);
        NO(g, fmts[i][2]);
        kvr_grammar_destroy(g);
    }
}

/* Every integer in a window against the bounds, for many bound pairs. */
static void test_int_ranges(void **state)
{
    (void)state;
    const int64_t bounds[] = {INT64_MIN, -1000, -101, -100, -99,  -10,      -9, -1,
                              0,         1,     9,    10,   11,   19,       99, 100,
                              101,       555,   999,  1000, 1234, INT64_MAX};
    size_t nb = sizeof bounds / sizeof *bounds;
    for (size_t a = 0; a < nb; a++)
        for (size_t b = a; b < nb; b++) {
            int64_t lo = bounds[a], hi = bounds[b];
            if (lo == INT64_MAX || hi == INT64_MIN)
                continue;
            struct kvr_sbuf body;
            kvr_sbuf_init(&body);
            kvr_sbuf_puts(&body, "root ::= ");
            kvr_gbnf_int_range(&body, lo, hi);
            struct kvr_grammar *g = NULL;
            struct kvr_err err = {0};
            if (kvr_grammar_compile(&g, body.data, body.len, &err))
                fail_msg("%s: %s", body.data, err.msg);
            for (int64_t x = -1200; x <= 1300; x++) {
                char t[32];
                snprintf(t, sizeof t, "%lld", (long long)x);
                bool want = x >= lo && x <= hi;
                if (accepts(g, t) != want)
                    fail_msg("[%lld, %lld] %s: want %d\n%s", (long long)lo, (long long)hi, t, want,
                             body.data);
            }
            NO(g, "01");
            NO(g, "-0");
            kvr_grammar_destroy(g);
            kvr_sbuf_fini(&body);
        }
}

static void test_numbers(void **state)
{
    (void)state;
    struct kvr_grammar *g =
        schema_grammar("{\"type\":\"number\",\"exclusiveMinimum\":0,\"maximum\":2.5}");
    YES(g, "1");
    YES(g, "2");
    YES(g, "1.75");
    NO(g, "0");
    NO(g, "3");
    NO(g, "2.9");
    kvr_grammar_destroy(g);
}

/* Unsupported keywords are refused with their pointer; bad values are refused too. */
static void test_refusals(void **state)
{
    (void)state;
    const char *cases[][2] = {
        {"{\"not\":{}}", "/not: unsupported keyword"},
        {"{\"properties\":{\"x\":{\"not\":{\"type\":\"string\"}}}}",
         "/properties/x/not: unsupported keyword"},
        {"{\"properties\":{\"a/b\":{\"if\":{}}}}", "/properties/a~1b/if: unsupported keyword"},
        {"{\"items\":{\"uniqueItems\":true}}", "/items/uniqueItems: unsupported keyword"},
        {"{\"anyOf\":[{\"type\":\"string\"},{\"patternProperties\":{}}]}",
         "/anyOf/1/patternProperties: unsupported keyword"},
        {"{\"$defs\":{\"a\":{\"dependentRequired\":{}}},\"$ref\":\"#/$defs/a\"}",
         "/$defs/a/dependentRequired: unsupported keyword"},
        {"{\"type\":\"number\",\"multipleOf\":0.5}", "/multipleOf: unsupported keyword"},
        {"{\"type\":\"string\",\"format\":\"hostname\"}", "/format: unsupported format hostname"},
        {"{\"type\":\"string\",\"pattern\":\"(?=a)\"}", "/pattern: lookaround"},
        {"{\"type\":\"string\",\"pattern\":\"(a)\\\\1\"}", "/pattern: a backreference"},
        {"{\"$ref\":\"#/$defs/missing\"}", "/$ref: '#/$defs/missing' does not resolve"},
        {"{\"$ref\":\"http://x/y\"}", "/$ref: only references inside"},
        {"{\"type\":\"frob\"}", "/type: unknown type 'frob'"},
        {"false", "/: the schema false allows no value"},
        {"{\"allOf\":[{},{}]}", "/allOf: only allOf with one schema"},
        {"{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", "/maximum: no integer lies"},
        {"{\"properties\":{\"a\":{}},\"required\":[\"b\"]}", "/required/0: a required property"},
        {"{\"maxLength\":100000}", "/maxLength: above 4096"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        json_t *s = json_loads(cases[i][0], JSON_DECODE_ANY, NULL);
        assert_non_null(s);
        struct kvr_sbuf out;
        kvr_sbuf_init(&out);
        struct kvr_err err = {0};
        assert_int_not_equal(kvr_json_schema_gbnf(s, &out, &err), 0);
        if (strncmp(err.msg, cases[i][1], strlen(cases[i][1])))
            fail_msg("%s: got '%s', want '%s...'", cases[i][0], err.msg, cases[i][1]);
        kvr_sbuf_fini(&out);
        json_decref(s);
    }
    /* nesting beyond the limit */
    char deep[2048] = "";
    for (int i = 0; i < 70; i++)
        strcat(deep, "{\"items\":");
    strcat(deep, "{}");
    for (int i = 0; i < 70; i++)
        strcat(deep, "}");
    json_t *s = json_loads(deep, 0, NULL);
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    struct kvr_err err = {0};
    assert_int_equal(kvr_json_schema_gbnf(s, &out, &err), KVR_ERANGE);
    kvr_sbuf_fini(&out);
    json_decref(s);
}

static void test_json_object(void **state)
{
    (void)state;
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    kvr_json_object_gbnf(&out);
    struct kvr_grammar *g = NULL;
    assert_int_equal(kvr_grammar_compile(&g, out.data, out.len, NULL), 0);
    YES(g, "{}");
    YES(g, "{\"a\": [1, {\"b\": null}]}");
    NO(g, "[1]");
    NO(g, "\"x\"");
    kvr_grammar_destroy(g);
    kvr_sbuf_fini(&out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_objects),     cmocka_unit_test(test_unions_refs),
        cmocka_unit_test(test_strings),     cmocka_unit_test(test_int_ranges),
        cmocka_unit_test(test_numbers),     cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_json_object),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
